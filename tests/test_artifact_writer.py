"""The background artifact writer (--artifact-writer-queue): the same files as the synchronous
path, byte for byte; a failed write surfaces on the main thread with its message; retention
keeps exactly what the synchronous path keeps; the queue bound holds."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.workers.launch import ROOT
from tests.workers.recipes import TINY_GEOMETRY, TINY_SAMPLING
from trainer import artifacts
from trainer.artifact_writer import ArtifactWriteError, ArtifactWriter
from trainer.rollout import generate_rollout

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 2], "sde_resample_per_rollout": True, "num_sde_steps": 2, "sde_pool": [1, 2, 3]}
PROMPTS = [
    {"prompt": "a red panda in a teacup", "metadata": {"task": "t2i", "sample_id": "p0"}},
    {"prompt": "a lighthouse", "metadata": {"task": "t2i", "sample_id": "p1"}},
]


class MemoEngine:
    """The tiny engine, each rollout generated once: a second call with the same requests gets
    the same trajectory back (fresh tensors), so two artifact paths can be compared on the very
    same rollout."""

    def __init__(self, engine):
        self.engine, self.seen = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests):
        key = tuple((r.sample_id, r.generation_seed, tuple(r.sde_indices)) for r in requests)
        if key not in self.seen:
            self.seen[key] = self.engine.generate(requests)
        return copy.deepcopy(self.seen[key])


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from trainer.engine.native import NativeEngine

    return MemoEngine(NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=4))


def rollout(engine, root, k, writer=None, **kw):
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    kw.setdefault("retention", 2)
    return generate_rollout(engine, QwenImageAdapter(), PROMPTS, rollout_id=k, sampling=parse_sampling_config(SAMPLING),
                            group_size=2, generation_seed=5, artifact_root=root, task="t2i", weight_manifest_hash="h",
                            writer=writer, **kw)


def canonical(path: Path) -> object:
    """A file's bytes; for a safetensors file its header as parsed JSON and its data bytes, since
    safetensors writes the header's metadata entries in an arbitrary order (two writes of one
    payload in one process differ in that order only)."""
    data = path.read_bytes()
    if path.suffix != ".safetensors":
        return data
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def files(root: Path) -> dict[str, object]:
    return {str(p.relative_to(root)): canonical(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_async_writes_the_same_bytes_even_when_the_trajectory_changes_after_the_hand_over(engine, tmp_path):
    sync = rollout(engine, tmp_path / "sync", 3)
    writer = ArtifactWriter(2)
    gate = threading.Event()
    writer.submit("gate", 0, [gate.wait])  # holds the thread until the rollout is handed over
    out = rollout(engine, tmp_path / "async", 3, writer=writer)
    assert not any(out.artifact_dir.iterdir())  # nothing written yet
    # what a scorer or the update might do to the returned trajectory must not reach the files
    traj = out.trajectory
    for t in (traj.images, traj.latents, traj.next_latents, traj.log_probs, *traj.conditions.values()):
        t.zero_()
    traj.metadata[0]["sample_id"] = "changed"
    traj.train_metadata[0]["policy_version"] = 99
    gate.set()
    writer.close()
    a, b = files(tmp_path / "sync"), files(tmp_path / "async")
    assert sorted(a) == sorted(b) and len(a) == 2 * 2 + 2  # 4 PNGs, 2 sidecars
    assert [n for n in a if a[n] != b[n]] == []
    assert sync.stats["perf/rollout_artifact_time"] > 0 and "perf/artifact_writer_time" not in sync.stats
    assert "perf/artifact_writer_time" in out.stats


def test_retention_with_a_slow_writer_keeps_what_the_sync_path_keeps(engine, tmp_path, monkeypatch):
    def three_rollouts(root, writer=None):
        for k in range(3):
            rollout(engine, root, k, writer=writer)
            rollout(engine, root, k, writer=writer, eval=True, retention=1) if k % 2 == 0 else None

    three_rollouts(tmp_path / "sync")
    real = artifacts.atomic_write_bytes

    def slow(path, data, **kw):  # rollout 0's files land while rollout 2 prunes its directory
        time.sleep(0.3 if "rollout_0000000" in str(path) else 0.0)
        return real(path, data, **kw)

    monkeypatch.setattr(artifacts, "atomic_write_bytes", slow)
    writer = ArtifactWriter(4)  # room for every rollout: only the retention wait orders the prune
    three_rollouts(tmp_path / "async", writer)
    writer.close()
    a, b = files(tmp_path / "sync"), files(tmp_path / "async")
    # the same directories (a write into a pruned one would recreate it), every file complete
    assert sorted(a) == sorted(b) and [n for n in a if a[n] != b[n]] == []
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path / "async", "t2i")] == [1, 2]
    assert [i for i, _ in artifacts.list_rollout_dirs(tmp_path / "async", "t2i", eval=True)] == [2]


def test_retention_barrier_names_exactly_the_rollouts_the_prune_removes():
    writer = ArtifactWriter(8)
    assert writer.retention_barrier("t", 0, 2) == []
    for k in range(4):
        writer.submit("t", k, [])
    assert writer.retention_barrier("t", 4, 2) == [0, 1, 2]  # the prune at 4 keeps 3 and 4
    writer.submit("t", 4, [])
    assert writer.retention_barrier("t", 5, 2) == [3]  # then 4 and 5
    for k in (9, 19):  # eval trees have gaps; the prune counts directories, not ids
        writer.submit("e", k, [])
    assert writer.retention_barrier("e", 29, 3) == [] and writer.retention_barrier("e", 29, 2) == [9]
    writer.submit("k", 0, [])
    assert writer.retention_barrier("k", 1, 0) == []  # <= 0 keeps everything
    writer.close()


def test_a_failed_write_surfaces_on_the_main_thread_with_its_message(engine, tmp_path, monkeypatch, caplog):
    real = artifacts.atomic_write_bytes

    def disk_full_at_rollout_1(path, data, **kw):
        if "rollout_0000001" in str(path) and str(path).endswith(".png"):
            raise OSError(28, "No space left on device (injected)")
        return real(path, data, **kw)

    monkeypatch.setattr(artifacts, "atomic_write_bytes", disk_full_at_rollout_1)
    # the synchronous path raises the error itself, in the rollout stage
    rollout(engine, tmp_path / "sync", 0)
    with pytest.raises(OSError, match="No space left on device"):
        rollout(engine, tmp_path / "sync", 1)

    writer = ArtifactWriter(2)
    rollout(engine, tmp_path / "async", 0, writer=writer)
    rollout(engine, tmp_path / "async", 1, writer=writer)  # handed over: the failure comes later
    writer.wait("x", [])  # no such rollout: returns at once
    with pytest.raises(ArtifactWriteError) as e:
        writer.flush()
    msg = str(e.value)
    assert "rollout 1 in" in msg and "OSError: [Errno 28] No space left on device (injected)" in msg
    assert isinstance(e.value.__cause__, OSError)
    with pytest.raises(ArtifactWriteError, match="No space left on device"):  # and at the next submit
        rollout(engine, tmp_path / "async", 2, writer=writer)
    assert len(list(artifacts.iter_sidecars(tmp_path / "async" / "t2i" / "rollout_0000000"))) == 2
    writer.close(raise_errors=False)  # the run is failing already: logged, not raised over its error
    assert "No space left on device (injected)" in caplog.text


def test_rollouts_handed_over_after_a_failure_are_named_not_written():
    writer = ArtifactWriter(3)
    gate = threading.Event()
    writer.submit("t", 0, [gate.wait, lambda: 1 / 0])
    written = []
    writer.submit("t", 1, [lambda: written.append(1)], label="rollout 1")
    gate.set()
    with pytest.raises(ArtifactWriteError, match=r"ZeroDivisionError: division by zero; not written either: rollout 1"):
        writer.close()
    assert written == []


def test_the_queue_bound_blocks_submit_instead_of_growing():
    writer = ArtifactWriter(2)
    gate, held = threading.Event(), []
    blocked = []

    def job():
        held.append(writer.pending)
        gate.wait()

    for k in range(2):
        assert writer.submit("t", k, [job]) < 0.1
    third = threading.Thread(target=lambda: blocked.append(writer.submit("t", 2, [job])))
    third.start()
    third.join(0.3)
    assert third.is_alive() and writer.pending == 2  # the third rollout waits for a slot
    gate.set()
    third.join(5)
    writer.close()
    assert not third.is_alive() and blocked[0] >= 0.25 and max(held) <= 2
    assert writer.take_busy_time() > 0.25 and writer.take_busy_time() == 0.0
    with pytest.raises(ValueError, match="0 means writing synchronously"):
        ArtifactWriter(0)


def _fake_trainer(writer, step, num_rollout=3):
    """What Trainer.fit reads of a trainer, around a given step function."""
    from types import SimpleNamespace as NS

    metrics = NS(log=lambda k, m: None, console_line=lambda *a: "", close=lambda: None)
    return NS(cfg=NS(rollout=NS(num_rollout=num_rollout), colocate=NS(offload_train=False),
                     eval=NS(eval_base=False)), eval_sets=[],
              actor=NS(offloaded=False), start_rollout=0, _progress_bars=False, step=step, load_metrics={},
              install_adapter=lambda: None, share_fp8_weights=lambda: None,
              metrics=metrics, rank=1, components=[], stop_reason=None, artifact_writer=writer, _watch_pool=None)


def test_the_loop_still_writes_its_last_rollouts_when_it_fails(tmp_path):
    from trainer.loop import Trainer

    writer = ArtifactWriter(2)

    def step(k):
        writer.submit("t", k, [lambda: time.sleep(0.2), lambda: (tmp_path / f"r{k}").write_text("x")])
        if k == 1:
            raise RuntimeError("the reward server went away")
        return {}

    with pytest.raises(RuntimeError, match="the reward server went away"):
        Trainer.fit(_fake_trainer(writer, step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0", "r1"]  # both handed over, both written


def test_the_loop_ends_with_the_writers_error(tmp_path):
    from trainer.loop import Trainer

    writer = ArtifactWriter(2)

    def step(k):
        writer.submit("t", k, [lambda: (_ for _ in ()).throw(OSError(5, "Input/output error (injected)"))]
                      if k == 2 else [])
        return {}

    with pytest.raises(ArtifactWriteError, match=r"rollout 2 \(t\) failed .*Input/output error \(injected\)"):
        Trainer.fit(_fake_trainer(writer, step))


def _run(tmp: Path, model_dir, queue: int) -> tuple[subprocess.CompletedProcess, Path]:
    """A tiny one-process run whose PNG writes fail from rollout 1 on (injected in-process)."""
    tmp.mkdir()
    prompts = tmp / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a red ball {i}", "metadata": {"task": "t2i", "sample_id": f"p{i}"}}) + "\n"
                               for i in range(2)))
    recipe = tmp / "recipe.toml"
    recipe.write_text(f'actor-num-nodes = 1\nactor-num-gpus-per-node = 1\ngeneration-task = "t2i"\n'
                      f'model-path = "{model_dir}"\nprompt-data = "{prompts}"\n{TINY_GEOMETRY}'
                      f'reward-scorer-path = "color"\nnum-rollout = 3\nsave-interval = 1\n{TINY_SAMPLING}')
    args = ["--config", str(recipe), "--artifact-root", str(tmp / "art"), "--save", str(tmp / "ckpt"),
            "--tensorboard-dir", str(tmp / "tb"), "--artifact-writer-queue", str(queue)]
    script = f"""
import sys
from trainer import artifacts
real = artifacts.atomic_write_bytes
def failing(path, data, **kw):
    if "rollout_0000000" not in str(path) and str(path).endswith(".png"):
        raise PermissionError(13, "Permission denied (injected)", str(path))
    return real(path, data, **kw)
artifacts.atomic_write_bytes = failing
from trainer.train import main
sys.exit(main({args!r}))
"""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    return proc, tmp / "ckpt"


def test_a_write_failure_stops_the_run_where_the_synchronous_path_stops(tmp_path, tiny_model_dir):
    """Rollout 1's PNGs cannot be written: synchronously the rollout stage raises; with the
    writer the flush before checkpoint 1 does. Either way the run exits 1 with the error's
    message and checkpoint 0 is the last one committed."""
    from trainer import checkpoint as ck

    for queue in (0, 2):
        proc, save = _run(tmp_path / f"q{queue}", tiny_model_dir, queue)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Permission denied (injected)" in proc.stderr
        assert ("ArtifactWriteError: writing the artifacts of rollout 1 in" in proc.stderr) == (queue > 0)
        committed = [i for i in range(3) if (ck.iteration_dir(save, "t2i", i) / ck.COMMITTED).is_file()]
        assert committed == [0], (queue, committed)
        assert len(list(artifacts.iter_sidecars(tmp_path / f"q{queue}" / "art" / "t2i" / "rollout_0000000"))) == 2
