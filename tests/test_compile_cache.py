"""--compile-cache-dir in a directory others can write (as /tmp): torch.compile imports the code it
finds in the cache, so the run creates the directory itself, exclusively and private to the
user, and refuses (exit 2, the flag named, nothing loaded) a directory that someone else made,
whether before preflight or between preflight and the run's start. The tests run as root, so
"another user" is a chown."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OTHER_UID = 4242

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user needs chown (CI runs as root)")


class _Plant:
    """A pickle that, when loaded, proves it by writing `marker`: what another user would put in
    the run's cache in place of a profile or a compiled graph."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "their code ran"))


def _argv(tmp: Path, cache: Path) -> list[str]:
    """A one-process run that passes preflight and compiles: the model directory is empty, so a
    run that went past the cache check would stop at the model load (exit 1), not with exit 2."""
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    train = tmp / "train.jsonl"
    train.write_text('{"prompt": "a red ball", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    return ["--generation-task", "t2i", "--model-path", str(model), "--prompt-data", str(train),
            "--num-rollout", "1", "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "1",
            "--n-samples-per-prompt", "2", "--num-updates-per-batch", "1", "--micro-batch-size", "2",
            "--sampling-config", json.dumps({"height": 64, "width": 64, "num_inference_steps": 4,
                                             "sde_indices": [1, 2]}),
            "--reward-scorer-path", "color", "--reward-runtime", "cpu",
            "--artifact-root", str(tmp / "artifacts"), "--save", str(tmp / "ckpt"),
            "--fsdp-compile", "--compile-cache-dir", str(cache)]


def _plant(cache: Path, marker: Path, job_file: str = "code_state_flowgrpo_0_.pkl") -> None:
    """Another user's directory at the cache's path: a dynamo profile and an fxgraph entry that
    run their code when unpickled."""
    for sub in ("dynamo", "fxgraph/ab", "aotautograd/cd"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
    blob = pickle.dumps(_Plant(str(marker)))
    for f in (cache / "dynamo" / job_file, cache / "fxgraph" / "ab" / "fab", cache / "aotautograd" / "cd" / "entry"):
        f.write_bytes(blob)
    for root, dirs, files in os.walk(cache):
        for name in (root, *(os.path.join(root, n) for n in dirs + files)):
            os.chown(name, OTHER_UID, OTHER_UID)
            os.chmod(name, 0o777 if os.path.isdir(name) else 0o666)


def _planted_after_preflight(cache: Path, marker: Path) -> str:
    """`python -c` source of trainer.train's main in which another user plants their directory
    at `cache` (_plant, `marker` its proof) right after preflight passed: the race's window."""
    return ("import sys, trainer.train as t, tests.test_compile_cache as c\n"
            "from pathlib import Path\n"
            "real = t.validate\n"
            "def validate(*a, **k):\n"
            "    out = real(*a, **k)\n"
            f"    c._plant(Path({str(cache)!r}), Path({str(marker)!r}))\n"
            "    return out\n"
            "t.validate = validate\n"
            "sys.exit(t.main(sys.argv[1:]))\n")


@pytest.fixture
def shared(tmp_path) -> Path:
    """A directory like /tmp: everyone may create in it, the sticky bit keeps them from renaming
    or deleting what others made."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


def _train(args: list[str], *, wrapper: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-c", wrapper, *args] if wrapper else [sys.executable, "-m", "trainer.train", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_cache_directory_another_user_made_first_is_refused_by_preflight(tmp_path, shared):
    cache = shared / "cc"
    marker = tmp_path / "marker"
    _plant(cache, marker)
    res = _train(_argv(tmp_path, cache) + ["--preflight-only"])
    assert res.returncode == 2, res.stderr
    assert f"--compile-cache-dir {cache}:" in res.stderr and f"is owned by uid {OTHER_UID}" in res.stderr
    assert not marker.exists()


def test_a_cache_directory_made_between_preflight_and_the_run_is_refused(tmp_path, shared):
    """The race: preflight passes (nothing at the path yet), then another user creates the
    directory before the run does. The run's exclusive create fails, the check of what is
    there refuses it: exit 2 naming the flag, before any model load, their pickles never read."""
    cache = shared / "cc"
    marker = tmp_path / "marker"
    # the other user acts right after preflight: trainer.train's own validate, then the plant
    wrapper = _planted_after_preflight(cache, marker)
    res = _train(_argv(tmp_path, cache), wrapper=wrapper)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"--compile-cache-dir {cache}:" in res.stderr and f"is owned by uid {OTHER_UID}" in res.stderr
    assert "Nothing was loaded" in res.stderr and "Traceback" not in res.stderr
    assert not marker.exists()
    assert not (tmp_path / "ckpt").exists()  # it stopped before the run began
    assert os.stat(cache).st_uid == OTHER_UID  # their directory left as it was


def test_under_torchrun_every_rank_refuses_a_directory_planted_after_preflight(tmp_path, shared):
    """2 ranks: the other user plants the directory once, after the first rank's preflight (as
    one watching for a run to start would). A rank finds it on its exclusive create and refuses
    it with the flag named (exit 2, which torchrun reports for the rank); no rank reads it."""
    from tests.workers.launch import free_port

    cache = shared / "cc"
    marker = tmp_path / "marker"
    wrapper = tmp_path / "rank.py"
    wrapper.write_text(
        "import os, sys, trainer.train as t, tests.test_compile_cache as c\n"
        "from pathlib import Path\n"
        "real = t.validate\n"
        "def validate(*a, **k):\n"
        "    out = real(*a, **k)\n"
        "    try:\n"
        f"        os.mkdir({str(cache)!r})\n"
        "    except FileExistsError:\n"
        "        return out  # planted already, or another rank made it (then it is refused as its own would be)\n"
        f"    c._plant(Path({str(cache)!r}), Path({str(marker)!r}))\n"
        "    return out\n"
        "t.validate = validate\n"
        "sys.exit(t.main(sys.argv[1:]))\n")
    argv = _argv(tmp_path, cache)
    argv[argv.index("--actor-num-gpus-per-node") + 1] = "2"
    argv[argv.index("--n-samples-per-prompt") + 1] = "4"  # 2 candidates a rank
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), str(wrapper), *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "exitcode  : 2" in out, out[-4000:]
    # the first rank to refuse ends the job (torchrun stops the other, which may not have got there)
    refusals = [ln for ln in out.splitlines() if f"] error: --compile-cache-dir {cache}:" in ln]
    assert refusals and all(f"is owned by uid {OTHER_UID}" in ln for ln in refusals), out[-4000:]
    assert not marker.exists() and not (tmp_path / "ckpt").exists()


def test_a_parent_made_by_someone_else_between_preflight_and_the_run_is_refused(tmp_path, shared):
    """--compile-cache-dir /tmp/run/cc with /tmp/run absent at preflight, then made by another user:
    they could rename the cache away and put theirs in its place, so the run refuses (exit 2)
    and creates nothing in their directory."""
    cache = shared / "run" / "cc"
    wrapper = (
        "import os, sys, trainer.train as t\n"
        "real = t.validate\n"
        "def validate(*a, **k):\n"
        "    out = real(*a, **k)\n"
        f"    os.mkdir({str(cache.parent)!r}); os.chown({str(cache.parent)!r}, {OTHER_UID}, {OTHER_UID})\n"
        f"    os.chmod({str(cache.parent)!r}, 0o777)\n"
        "    return out\n"
        "t.validate = validate\n"
        "sys.exit(t.main(sys.argv[1:]))\n"
    )
    res = _train(_argv(tmp_path, cache), wrapper=wrapper)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"--compile-cache-dir {cache}: its parent {cache.parent} is owned by uid {OTHER_UID}" in res.stderr
    assert list(cache.parent.iterdir()) == []


def test_a_cache_directory_group_or_others_can_write_is_refused(tmp_path, shared):
    cache = shared / "cc"
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    res = _train(_argv(tmp_path, cache) + ["--preflight-only"])
    assert res.returncode == 2 and f"{cache} is writable by group or others (mode 777)" in res.stderr


def test_preflight_leaves_no_probe_file_beside_a_cache_that_does_not_exist_yet(tmp_path, shared, monkeypatch):
    """A probe file appearing in the shared parent would tell a watcher that a run is starting and
    when to plant the directory: preflight checks the parent without writing in it."""
    import tempfile

    from trainer.config import load_config
    from trainer.preflight import validate

    real = tempfile.mkstemp

    def mkstemp(*a, **k):
        assert Path(k.get("dir", "")) != shared, "a probe file in the shared parent"
        return real(*a, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    validate(load_config(_argv(tmp_path, shared / "cc")), 1, torchrun=False)
    assert not (shared / "cc").exists()  # preflight creates nothing


def test_every_rank_creates_or_checks_the_same_directory(tmp_path, shared):
    """Ranks starting together: one mkdir wins, the others find the directory theirs (same
    user, 0700) and go on; nobody takes it on trust."""
    cache = shared / "cc" / "run1"
    code = ("import sys\nfrom trainer.config import load_config\nfrom trainer.preflight import prepare_compile_cache\n"
            f"print(prepare_compile_cache(load_config(sys.argv[1:])))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, *_argv(tmp_path, cache)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["None"] * 3
    st = os.stat(cache)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700


def test_the_launchers_check_creates_the_cache_and_refuses_a_planted_one_with_exit_2(tmp_path, shared):
    """`bash run.sh train` checks the recipe once before torchrun starts the ranks; that check
    makes the cache too, so a directory planted after its preflight is refused there with exit
    2 (under torchrun a rank's 2 reaches the user as the launcher's 1). Unplanted, the launch
    leaves the cache made private to the user; a user's own --preflight-only makes nothing."""
    cache = shared / "cc"
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("")
    env = {**os.environ, "USE_CURRENT_ENV": "1", "PYTHON": sys.executable, "NPROC": "1",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    res = subprocess.run(["bash", str(ROOT / "run.sh"), "train", str(recipe), *_argv(tmp_path, cache)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    st = os.stat(cache)  # the run itself then stopped at the empty model directory
    assert res.returncode != 2 and st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700, res.stderr[-3000:]

    cache2, marker = shared / "cc2", tmp_path / "marker"
    wrapper = _planted_after_preflight(cache2, marker)
    env2 = {**env, "FLOWGRPO_LAUNCH_CHECK": "1"}
    res = subprocess.run([sys.executable, "-c", wrapper, *_argv(tmp_path, cache2), "--preflight-only", "--quiet"],
                         cwd=ROOT, env=env2, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and f"--compile-cache-dir {cache2}:" in res.stderr, res.stderr[-3000:]
    assert f"is owned by uid {OTHER_UID}" in res.stderr and not marker.exists()

    res = _train(_argv(tmp_path, shared / "cc3") + ["--preflight-only"])
    assert res.returncode == 0 and not (shared / "cc3").exists(), res.stderr[-3000:]
