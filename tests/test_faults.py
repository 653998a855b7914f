"""Launch mistakes and faults: each is found early with a one-line error naming the flag or the
file, and none loses a committed checkpoint.

Most cases run in-process (preflight, the checkpoint files); the few that need the real loop
start one process of the tiny model; two torchrun tests cover the launcher killed (-9) and
stopped (SIGTERM) and a rank killed at each point of a save. The checkpoint faults under 2
ranks (rotation through a failed write, a read-only directory, no overwrite) share the launch
of tests/test_checkpoint.py. A scripted HTTP server plays a misbehaving reward server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import importlib.machinery
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.workers import kill_during_save
from tests.workers.fs_faults import failing_shard_writes, read_only
from tests.workers.launch import ROOT, free_port
from tests.workers.recipes import tiny_recipe
from trainer import checkpoint as ck
from trainer import train
from trainer.config import load_config
from trainer.preflight import PreflightError, validate

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def _prompts(path: Path, n: int = 4) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"a red ball {i}", "metadata": {"task": "t2i", "sample_id": f"p{i}"}}) + "\n")
    return path


def _recipe(tmp: Path, model_dir: Path | str, ranks: int = 2) -> Path:
    """A tiny run: 2 groups of 4, 32x32, 4 steps; `ranks` processes."""
    path = tmp / "recipe.toml"
    extra = 'reward-runtime = "cpu"\nreward-scorer-path = "color"\nnum-rollout = 3'
    path.write_text(tiny_recipe(model_dir, _prompts(tmp / "train.jsonl"), ranks=ranks, extra=extra))
    return path


def _problems(args: list[str], world: int | None = 2) -> str:
    with pytest.raises(PreflightError) as e:
        validate(load_config(args), world)
    return str(e.value)


def _commit_fake(save: Path, *iterations: int) -> None:
    """Committed-looking iterations (preflight only reads the directory layout)."""
    for it in iterations:
        d = ck.iteration_dir(save, "t2i", it)
        d.mkdir(parents=True)
        (d / ck.COMMITTED).write_text(f"{it}\n")


def _outputs(tmp: Path, name: str = "run") -> list[str]:
    out = tmp / name
    return ["--artifact-root", str(out / "artifacts"), "--save", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb")]


@pytest.fixture
def recipe(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    return ["--config", str(_recipe(tmp_path, model))]


# ----------------------------------------------------------------------------------------------
# launch mistakes, found by preflight before anything loads


def test_a_process_without_torchrun_is_checked_against_its_own_world(recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train.main([*recipe, *_outputs(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not started by torchrun" in err and "--actor-num-gpus-per-node" in err
    assert "torchrun --nproc-per-node 2" in err
    # the recipe on its own still checks against its 2 ranks
    assert train.main([*recipe, *_outputs(tmp_path), "--preflight-only"]) == 0
    # and one process is fine when the recipe says so
    fake = types.ModuleType("trainer.loop")
    fake.__spec__ = importlib.machinery.ModuleSpec("trainer.loop", None)
    fake.run = lambda cfg, recipe=None: 0
    monkeypatch.setitem(sys.modules, "trainer.loop", fake)
    assert train.main([*recipe, *_outputs(tmp_path), "--actor-num-gpus-per-node", "1"]) == 0


def test_a_fresh_run_refuses_an_earlier_runs_outputs(recipe, tmp_path):
    save = tmp_path / "run" / "ckpt"
    _commit_fake(save, 0, 1)
    msg = _problems([*recipe, *_outputs(tmp_path)])
    assert f"--save {save} already holds checkpoints of an earlier run (iterations [0, 1])" in msg
    assert f"--load {save}" in msg and "choose a new --save" in msg
    # resuming in place is the explicit request
    validate(load_config([*recipe, *_outputs(tmp_path), "--load", str(save)]), 2)
    # another run's checkpoints in --save while resuming from elsewhere
    other = tmp_path / "other"
    _commit_fake(other, 5)
    msg = _problems([*recipe, *_outputs(tmp_path), "--load", str(other)])
    assert "holds checkpoints of another run (iterations [0, 1])" in msg
    # an earlier run's TensorBoard events, with a fresh --save
    tb = tmp_path / "run2" / "tb"
    tb.mkdir(parents=True)
    (tb / "events.out.tfevents.1.host").write_bytes(b"")
    msg = _problems([*recipe, *_outputs(tmp_path, "run2")])
    assert f"TensorBoard directory {tb} already holds an earlier run's events" in msg
    assert "its run left no committed checkpoint" in msg
    # a first save that crashed left nothing to resume or keep: a fresh start may reuse --save
    ck.iteration_dir(tmp_path / "run3" / "ckpt", "t2i", 0).mkdir(parents=True)
    validate(load_config([*recipe, *_outputs(tmp_path, "run3")]), 2)


def test_load_must_hold_a_committed_checkpoint(recipe, tmp_path):
    save = tmp_path / "run" / "ckpt"
    _commit_fake(save, 3)
    # <save>/t2i instead of <save>
    msg = _problems([*recipe, "--load", str(save / "t2i"), *_outputs(tmp_path, "new")])
    assert f"--load {save / 't2i'} is the task directory inside the checkpoint directory {save}" in msg
    assert f"pass --load {save}," in msg
    # a typo: an empty directory, and one with only an interrupted save
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "it holds nothing" in _problems([*recipe, "--load", str(empty), *_outputs(tmp_path, "new")])
    crashed = tmp_path / "crashed"
    ck.iteration_dir(crashed, "t2i", 0).mkdir(parents=True)
    assert "none carries COMMITTED" in _problems([*recipe, "--load", str(crashed), *_outputs(tmp_path, "new")])


def test_ckpt_step_resumes_an_older_iteration_without_overwriting(recipe, tmp_path):
    save = tmp_path / "run" / "ckpt"
    _commit_fake(save, 1, 3)
    assert "--ckpt-step 2 is not a committed iteration" in _problems(
        [*recipe, *_outputs(tmp_path), "--load", str(save), "--ckpt-step", "2"])
    msg = _problems([*recipe, *_outputs(tmp_path), "--load", str(save), "--ckpt-step", "1"])
    assert "resumes before committed iterations [3]" in msg and "new, empty --save" in msg
    validate(load_config([*recipe, *_outputs(tmp_path, "branch"), "--load", str(save), "--ckpt-step", "1"]), 2)
    assert "--ckpt-step 1 needs --load" in _problems([*recipe, *_outputs(tmp_path, "x"), "--ckpt-step", "1"])


def test_unusable_output_paths_are_found_at_start(recipe, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    with read_only(locked):
        msg = _problems([*recipe, "--save", str(blocker / "ckpt"), "--artifact-root", str(locked / "art"),
                         "--tensorboard-dir", str(locked)])
    assert f"--save {blocker / 'ckpt'}: {blocker} is a regular file" in msg
    assert f"--artifact-root {locked / 'art'}: cannot write in {locked}" in msg
    assert f"--tensorboard-dir {locked}: cannot write in {locked}" in msg
    assert not (locked / "art").exists()


def test_preflight_only_reads_the_data_files(recipe, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "metadata": {"task": "t2i", "sample_id": "a"}}\n{"prompt": "broken\n')
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"prompt": "x" * 8_000_000, "metadata": {"task": "t2i", "sample_id": "h"}}) + "\n")
    assert train.main([*recipe, *_outputs(tmp_path), "--prompt-data", str(bad),
                       "--eval-prompt-data", "big", str(huge), "--preflight-only"]) == 2
    err = capsys.readouterr().err
    assert f"--prompt-data: {bad}:2: not valid JSON" in err
    # an 8 MB line is refused by its length before it is read whole (trainer.data.MAX_LINE_BYTES)
    assert f"--eval-prompt-data big: {huge}:1: line longer than 1048576 bytes" in err


def test_run_sh_train_can_use_the_current_environment(tmp_path):
    """USE_CURRENT_ENV=1: no .venv is created or installed into; the python given runs torchrun."""
    model = tmp_path / "model"
    model.mkdir()
    venv = tmp_path / "no-venv"
    env = {**ENV, "USE_CURRENT_ENV": "1", "PYTHON": sys.executable, "VENV": str(venv), "NPROC": "1",
           "TORCHRUN_ARGS": f"--master-port {free_port()}"}
    proc = subprocess.run(["bash", "run.sh", "train", str(_recipe(tmp_path, model, ranks=1)), *_outputs(tmp_path),
                           "--preflight-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preflight ok" in proc.stdout and not venv.exists()
    proc = subprocess.run(["bash", "run.sh", "train", "x.toml"], cwd=ROOT, env={**env, "PYTHON": "/bin/false"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "USE_CURRENT_ENV=1: /bin/false cannot import torch" in proc.stderr


# ----------------------------------------------------------------------------------------------
# start-up faults of the real loop (one process of the tiny model)


def _run_one(args: list[str], timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainer.train", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t0


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("[rank 0] error: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-4000:]
    return lines[0]


def test_held_out_eval_scorers_are_built_at_start_up_too(tmp_path):
    """--eval-reward-scorers entries are constructed with the trained scorer, before the policy
    loads: a partial directory fails the start, naming the entry and the missing file."""
    from trainer.config import load_config
    from trainer.loop import RunError, build_reward_manager

    partial = tmp_path / "aesthetic"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    cfg = load_config(["--reward-scorer-path", "jpeg_compressibility"])
    with pytest.raises(RunError, match=rf"--eval-reward-scorers entry aesthetic={partial}.*is missing"):
        build_reward_manager(cfg.reward, "cpu", held_out=("aesthetic", str(partial)))
    held = build_reward_manager(cfg.reward, "cpu", held_out=("jpeg_compressibility", None))
    assert "jpeg_compressibility" in held.components


def test_the_scorer_is_built_before_the_policy_loads(tmp_path):
    # a model directory with every subfolder but no weights: loading it would fail, so a
    # scorer error proves the scorer came first
    model = tmp_path / "hollow"
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        (model / sub).mkdir(parents=True)
    pick = tmp_path / "PickScore_v1"
    pick.mkdir()
    (pick / "config.json").write_text("{}")
    base = ["--config", str(_recipe(tmp_path, model, ranks=1)), *_outputs(tmp_path)]
    proc, _ = _run_one([*base, "--reward-scorer-path", "pickscore", "--reward-model-path", str(pick)])
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 1
    assert f"PickScoreScorer (--reward-model-path {pick})" in line
    assert f"--reward-model-path={pick} is missing model.safetensors" in line  # names the missing file
    port = free_port()
    proc, _ = _run_one([*base, "--reward-runtime", "remote", "--reward-endpoint", f"http://127.0.0.1:{port}/score"])
    line = _one_error_line(proc.stderr)
    assert f"--reward-endpoint http://127.0.0.1:{port}/score" in line and "Connection refused" in line


def test_rollouts_that_fully_fail_are_loud_then_fatal(tmp_path, tiny_model_dir):
    args = ["--config", str(_recipe(tmp_path, tiny_model_dir, ranks=1)), *_outputs(tmp_path), "--num-rollout", "5",
            "--reward-scorer-path", "tests.workers.scorers.NeverFiniteScorer", "--reward-max-failed-rollouts", "2"]
    proc, _ = _run_one(args)
    assert proc.returncode == 1
    assert "2 consecutive rollouts (up to rollout 1) in which every group failed to score" in _one_error_line(proc.stderr)
    assert "rollout 0: all 2 groups failed to score" in proc.stderr
    assert "rollout 0/5 | FAILED groups=2/2" in proc.stderr + proc.stdout


# ----------------------------------------------------------------------------------------------
# the launcher killed: the ranks go with it


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an unreaped zombie has exited


def _torchrun(tmp: Path, model_dir: Path, *args: str, env: dict | None = None,
              module: str = "trainer.train", launcher_args: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *launcher_args, "-m", module, "--config", str(_recipe(tmp, model_dir)),
           *_outputs(tmp), "--save-interval", "1", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_commit(launcher: subprocess.Popen, save: Path, iteration: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (ck.iteration_dir(save, "t2i", iteration) / ck.COMMITTED).is_file():
        assert launcher.poll() is None, f"training ended before checkpoint {iteration}:\n{launcher.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint {iteration} within {timeout} s"
        time.sleep(0.1)


def _wait_dead(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while any(_alive(p) for p in pids) and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
    assert not any(_alive(p) for p in pids), "ranks outlived their launcher"
    return time.monotonic() - t0


def test_kill_9_of_the_launcher_takes_the_ranks_down(tmp_path, tiny_model_dir):
    """kill -9 of torchrun's process group after the first commit: both ranks die with it and
    nothing is committed afterwards."""
    save = tmp_path / "run" / "ckpt"
    launcher = _torchrun(tmp_path, tiny_model_dir, "--num-rollout", "200")
    ranks: list[int] = []
    try:
        _wait_for_commit(launcher, save, 0)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _wait_dead(ranks, 5)
        newest = ck.committed_iterations(save, "t2i")[-1]
        time.sleep(2)
        assert ck.committed_iterations(save, "t2i")[-1] == newest, "a checkpoint was committed after the kill"
    finally:
        _kill_leftovers([launcher.pid, *ranks])


def _kill_leftovers(pids: list[int]) -> None:
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


def test_kill_9_at_each_point_of_a_save_resumes_from_the_last_commit(tmp_path, tiny_model_dir):
    """A rank SIGKILLed after its shards, after the sidecars, and after COMMITTED but before the
    markers (one launch each, each resuming the previous): the job goes down and resume always
    continues after the newest COMMITTED iteration. The last resume, stopped by SIGTERM to its
    torchrun after its next commit, takes every rank down within seconds, that commit intact.
    Then that commit's DCP .metadata is deleted: a resume with the ranks' output redirected away
    from the console (torchrun --redirects 3) still shows the error naming the file, through
    torchrun's own failure report, whichever rank failed first."""
    save = tmp_path / "run" / "ckpt"
    resume: list[str] = []
    before: list[int] = []
    for point, it, rank, committed in (("shards", 1, 1, [0]), ("sidecars", 2, 0, [0, 1]),
                                       ("committed", 3, 0, [0, 1, 2, 3])):
        proc = _torchrun(tmp_path, tiny_model_dir, "--num-rollout", "5", *resume,
                         env={kill_during_save.KILL_AT_ENV: f"{point}:{it}:{rank}"},
                         module="tests.workers.kill_during_save")
        out = proc.communicate(timeout=240)[0]
        assert proc.returncode != 0, f"the kill at {point} did not take the job down:\n{out[-3000:]}"
        assert ck.committed_iterations(save, "t2i") == committed, point
        if before:
            assert f"continuing at rollout {before[-1] + 1}" in out, out[-3000:]
        resume, before = ["--load", str(save)], committed
    # the markers lag behind the last COMMITTED, which is what resume trusts
    assert (save / "t2i" / ck.LATEST).read_text().strip() == "2"
    # the last resume is stopped with SIGTERM to its torchrun once it has committed again
    launcher = _torchrun(tmp_path, tiny_model_dir, "--num-rollout", "200", *resume)
    ranks: list[int] = []
    try:
        _wait_for_commit(launcher, save, 4)
        ranks = _children(launcher.pid)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=10)
        stopped = max(time.monotonic() - t0, _wait_dead(ranks, 5))
        assert stopped < 5, f"SIGTERM took {stopped:.1f} s"
        assert "continuing at rollout 4" in launcher.stdout.read()
        assert ck.committed_iterations(save, "t2i")[:5] == [0, 1, 2, 3, 4]
        state = json.loads((ck.iteration_dir(save, "t2i", 4) / ck.TRAINER_STATE).read_text())
        assert state["rollout_id"] == 4
    finally:
        _kill_leftovers([launcher.pid, *ranks])
    newest = ck.iteration_dir(save, "t2i", ck.committed_iterations(save, "t2i")[-1])
    (newest / "fsdp" / ".metadata").unlink()
    proc = _torchrun(tmp_path, tiny_model_dir, "--num-rollout", "200", *resume, launcher_args=("--redirects", "3"))
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 1, out[-3000:]
    assert f"error: {newest / 'fsdp' / '.metadata'} is missing although {newest.name} is COMMITTED" in out, out[-3000:]


# ----------------------------------------------------------------------------------------------
# damaged checkpoints are named by their file


def _tiny_checkpoint(root: Path, *iterations: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    for it in iterations:
        assert ck.save_checkpoint(root, "t2i", it, model=model, optimizer=opt, trainer_state={"rollout_id": it},
                                  weight_sync_manifest={}, adapter_contract={"mode": "full"}, trainable_only=False)
    return model, opt


def _load(root: Path, model, opt, iteration=None):
    return ck.load_checkpoint(root, "t2i", model=model, optimizer=opt, adapter_contract={"mode": "full"},
                              trainable_only=False, iteration=iteration)


def test_damaged_checkpoint_files_are_named(tmp_path):
    model, opt = _tiny_checkpoint(tmp_path, 1, 2)
    # the marker is only a hint: undecodable bytes fall back to the COMMITTED scan
    (tmp_path / "t2i" / ck.LATEST).write_bytes(b"\xff\xfe2\n")
    assert ck.latest_committed_iteration(tmp_path, "t2i") == 2
    assert _load(tmp_path, model, opt)["rollout_id"] == 2
    # an older iteration on request
    assert _load(tmp_path, model, opt, iteration=1)["rollout_id"] == 1
    d = ck.iteration_dir(tmp_path, "t2i", 2)
    rng = d / "rng_rank0.pt"
    good = rng.read_bytes()
    rng.write_bytes(good[:100])
    with pytest.raises(ck.CheckpointError, match=f"{rng} cannot be read"):
        _load(tmp_path, model, opt)
    rng.write_bytes(good)  # the RNG file is checked first, before anything loads
    shard = sorted((d / "fsdp").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ck.CheckpointError, match=f"{shard} has 10 bytes, the metadata needs"):
        _load(tmp_path, model, opt)


def test_rotation_never_leaves_fewer_than_n_committed(tmp_path):
    model, opt = _tiny_checkpoint(tmp_path, 1)
    with failing_shard_writes():
        failed = ck.save_checkpoint(tmp_path, "t2i", 2, model=model, optimizer=opt, trainer_state={},
                                    weight_sync_manifest={}, adapter_contract={"mode": "full"}, trainable_only=False,
                                    max_to_keep=1)
    assert failed is False and ck.committed_iterations(tmp_path, "t2i") == [1]
    assert ck.save_checkpoint(tmp_path, "t2i", 2, model=model, optimizer=opt, trainer_state={}, weight_sync_manifest={},
                              adapter_contract={"mode": "full"}, trainable_only=False, max_to_keep=1)
    assert ck.committed_iterations(tmp_path, "t2i") == [2]


def test_a_config_that_does_not_match_the_weights_names_config_json(tmp_path, tiny_model_dir):
    from trainer.models.base import ModelFilesError
    from trainer.models.qwen_image import load_qwen_image_transformer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg_file = model / "transformer" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["num_layers"] += 1
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ModelFilesError, match=f"{cfg_file} does not match the weight files"):
        load_qwen_image_transformer(model)


def test_remote_scores_must_be_finite_numbers():
    from trainer.rewards.remote import decode_response

    body = json.dumps({"color": [0.5, "0", False, True, None, "nan", 2]}).encode()
    got = decode_response(body, 7, "http://scorer").get("color").tolist()
    assert got[0] == 0.5 and got[6] == 2.0
    assert all(v != v for v in got[1:6]), got  # NaN: the image's group fails, counted


# ----------------------------------------------------------------------------------------------
# a misbehaving reward server


@contextlib.contextmanager
def _scripted_server(answers: list[tuple[int, str, bytes]]):
    """An HTTP server answering each POST with the next (status, content type, body), and GET
    with the protocol's info (one component, "color")."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            body = json.dumps({"protocol": 1, "components": ["color"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802 - the http.server API
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, ctype, body = answers.pop(0)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def _batch(n: int = 2):
    from trainer.rewards.base import ImageBatch

    return ImageBatch.from_any(torch.rand(n, 3, 4, 4)), ["a red ball"] * n, [{}] * n


def test_misbehaving_reward_server_answers_are_clear_errors(caplog):
    """A malformed 200 answer fails the batch's groups (NaN, counted, logged naming the endpoint)
    and the run goes on; a server that keeps failing is an error naming the endpoint."""
    from trainer.rewards.remote import RemoteScorer, RewardEndpointError

    answers = [(200, "text/html", b"<html>proxy login</html>"),
               (200, "application/json", b'{"color": [0.1, 0.2, 0.3]}'),
               *[(500, "application/json", b'{"error": "scorer crashed"}')] * 2]
    with _scripted_server(answers) as url:
        scorer = RemoteScorer(url, timeout_s=5, max_retries=1, backoff_s=0.01)
        with caplog.at_level("WARNING", logger="trainer.rewards.remote"):
            assert torch.isnan(scorer.score(*_batch())["color"]).all()
            assert torch.isnan(scorer.score(*_batch())["color"]).all()
        assert f"reward endpoint {url} returned a body that is not JSON" in caplog.text
        assert "returned 3 values for component 'color', expected 2" in caplog.text
        assert scorer.pop_failures() == {"malformed": 4}
        with pytest.raises(RewardEndpointError, match="failed 2 attempt.*HTTP 500: scorer crashed"):
            scorer.score(*_batch())


def test_a_reward_server_restarted_within_a_second_is_ridden_out_by_the_retry():
    from tools.reward_server import make_server
    from trainer.rewards.color import ColorScorer
    from trainer.rewards.remote import RemoteScorer

    port = free_port()
    scorer = RemoteScorer(f"http://127.0.0.1:{port}/score", timeout_s=5, max_retries=3, backoff_s=0.4)

    def restart():
        time.sleep(0.5)
        server = make_server(ColorScorer(), "127.0.0.1", port, "color")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    starter = concurrent.futures.ThreadPoolExecutor(1).submit(restart)
    try:
        got = scorer.score(*_batch())["color"]
        assert got.shape == (2,) and torch.isfinite(got).all()
    finally:
        starter.result().shutdown()
