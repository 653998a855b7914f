"""Files a run reads or writes cannot be turned against it: a crafted checkpoint file runs no
code, a checkpoint's JSON never chooses what to import, a link planted in an output directory is
never followed, names from a recipe stay inside the artifact root, and a kill during cleanup never
leaves a checkpoint that resume would trust. Each case goes through the public interface (the
checkpoint API, the export tool, preflight, the writers) with the crafted input."""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_checkpoint import _model
from tests.test_faults import _commit_fake, _outputs, recipe  # noqa: F401 - recipe is a fixture
from tools import export_checkpoint as ex
from trainer import artifacts
from trainer import checkpoint as ck
from trainer.config import load_config
from trainer.core import files
from trainer.data import write_jsonl
from trainer.preflight import PreflightError, validate

FULL = {"mode": "full"}


def _save(root: Path, it: int, model, opt, contract=FULL, **kw) -> Path:
    assert ck.save_checkpoint(root, "t2i", it, model=model, optimizer=opt, trainer_state={"rollout_id": it},
                              weight_sync_manifest={}, adapter_contract=contract, trainable_only=False, **kw)
    return ck.iteration_dir(root, "t2i", it)


def _load(root: Path, model, opt, iteration=None):
    return ck.load_checkpoint(root, "t2i", model=model, optimizer=opt, adapter_contract=FULL, trainable_only=False,
                              iteration=iteration)


class _Payload:
    """Pickles to a call of os.system that creates a marker file: what a malicious file holds."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---------------------------------------------------------------------------- the RNG file


def test_a_pickle_payload_in_the_rng_file_is_refused_unrun(tmp_path):
    model, opt = _model()
    d = _save(tmp_path, 1, model, opt)
    marker = tmp_path / "PAYLOAD_RAN"
    torch.save({"python": _Payload(marker), "numpy": None, "torch": torch.get_rng_state()}, d / "rng_rank0.pt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ck.CheckpointError) as e:
        _load(tmp_path, model, opt)
    msg = str(e.value)
    assert f"{d / 'rng_rank0.pt'} holds Python objects other than RNG state" in msg
    assert "system" in msg and "could run code" in msg and "delete the rng_rank*.pt files" in msg
    assert not marker.exists()
    # refused before anything was loaded in place
    assert all(torch.equal(changed[k], v) for k, v in model.state_dict().items())
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the documented way out: without the file, resume goes on (weights restored, RNG not)
    (d / "rng_rank0.pt").unlink()
    assert _load(tmp_path, model, opt)["rollout_id"] == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not marker.exists()


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trips_exactly_and_older_files_still_load(tmp_path):
    model, opt = _model()
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    random.gauss(0, 1)  # a cached gaussian is part of python's state
    np.random.standard_normal()
    d = _save(tmp_path, 1, model, opt)
    want = _draws()
    # the file is plain data: tensors and numbers only
    state = torch.load(d / "rng_rank0.pt", weights_only=True)
    assert state["format"] == ck.RNG_FORMAT and isinstance(state["numpy"]["key"], torch.Tensor)
    _draws()
    _load(tmp_path, model, opt)
    assert _draws() == want

    # a file an earlier version wrote (python's tuple, numpy's ndarray) loads without unpickling code
    random.seed(8), np.random.seed(9), torch.manual_seed(10)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               d / "rng_rank0.pt")
    want = _draws()
    _load(tmp_path, model, opt)
    assert _draws() == want


def test_a_damaged_rng_file_is_named(tmp_path):
    model, opt = _model()
    d = _save(tmp_path, 1, model, opt)
    torch.save({"python": {"version": 3, "state": torch.zeros(3, dtype=torch.int64), "gauss_next": None},
                "numpy": {}, "torch": torch.zeros(2, dtype=torch.uint8), "format": ck.RNG_FORMAT}, d / "rng_rank0.pt")
    with pytest.raises(ck.CheckpointError, match=f"{d / 'rng_rank0.pt'} does not hold a usable RNG state"):
        _load(tmp_path, model, opt)


def test_missing_dcp_metadata_is_named(tmp_path):
    model, opt = _model()
    d = _save(tmp_path, 1, model, opt)
    (d / "fsdp" / ".metadata").unlink()
    with pytest.raises(ck.CheckpointError, match=rf"{d / 'fsdp' / '.metadata'} is missing although iter_0000001 is "
                                                 "COMMITTED"):
        _load(tmp_path, model, opt)


def test_a_fatal_error_reaches_torchruns_report(tmp_path, monkeypatch, capsys):
    """The launcher reads a failed rank's error file for its "Root Cause": the message is there too."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainer.train import report_fatal

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report_fatal(1, "error: /x/fsdp/.metadata is missing")
    assert capsys.readouterr().err == "[rank 1] error: /x/fsdp/.metadata is missing\n"
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == "[rank 1] error: /x/fsdp/.metadata is missing"


# ---------------------------------------------------------------------------- rotation


class _Killed(BaseException):
    """What a SIGKILL looks like from inside: nothing after it runs."""


def test_a_kill_inside_rotation_never_leaves_a_committed_iteration_with_shards_missing(tmp_path, monkeypatch):
    model, opt = _model()
    for it in (1, 2):
        _save(tmp_path, it, model, opt)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *a, **kw):
        shard = sorted(Path(path, "fsdp").glob("*.distcp"))[0]
        shard.unlink()  # the first file went, then the process died
        raise _Killed()

    monkeypatch.setattr(ck.shutil, "rmtree", killed_midway)
    with pytest.raises(_Killed):
        ck.rotate_checkpoints(tmp_path, "t2i", keep=1)
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    # the half-deleted iteration 1 is not committed: resume never picks it, even on request
    assert ck.committed_iterations(tmp_path, "t2i") == [2]
    with pytest.raises(ck.CheckpointError, match="no COMMITTED marker"):
        _load(tmp_path, model, opt, iteration=1)
    assert _load(tmp_path, model, opt)["rollout_id"] == 2
    # the next rotation removes the leftover
    _save(tmp_path, 3, model, opt, max_to_keep=1)
    assert sorted(p.name for p in (tmp_path / "t2i").iterdir() if p.is_dir()) == ["iter_0000003"]


def test_failed_cleanup_is_logged_and_the_run_goes_on_for_artifacts_and_checkpoints(tmp_path, monkeypatch, caplog):
    """One rule for both: an old directory that cannot be removed is an error in the log, stays
    on disk, and the next cleanup tries again; the new outputs are what matters."""
    for k in range(3):
        artifacts.prepare_rollout_dir(tmp_path / "art", "t2i", k)
    model, opt = _model()
    _save(tmp_path / "ckpt", 1, model, opt)

    def refuse(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(artifacts.shutil, "rmtree", refuse)
    with caplog.at_level(logging.ERROR):
        assert artifacts.prune_stale_artifacts(tmp_path / "art", "t2i", keep=1) == []
        assert _save(tmp_path / "ckpt", 2, model, opt, max_to_keep=1).is_dir()  # committed all the same
    assert "artifact retention could not remove" in caplog.text and "rollout_0000000" in caplog.text
    assert "checkpoint rotation under" in caplog.text
    assert len(artifacts.list_rollout_dirs(tmp_path / "art", "t2i")) == 3
    monkeypatch.undo()
    assert len(artifacts.prune_stale_artifacts(tmp_path / "art", "t2i", keep=1)) == 2


# ---------------------------------------------------------------------------- export


def test_a_recorded_adapter_outside_the_registry_is_never_imported(tmp_path, monkeypatch):
    marker = tmp_path / "IMPORTED"
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "evil_adapter.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Adapter:\n    pass\n")
    monkeypatch.syspath_prepend(str(pkg))
    model, opt = _model()
    d = _save(tmp_path / "save", 1, model, opt, contract={"mode": "full", "model_adapter_path": "evil_adapter.Adapter"})
    with pytest.raises(ex.ExportError) as e:
        ex.export_checkpoint(tmp_path / "save", "t2i", 1, tmp_path / "out", form="merged")
    msg = str(e.value)
    assert f"{d / 'adapter_contract.json'} records the model adapter 'evil_adapter.Adapter'" in msg
    assert "trainer.models.qwen_image.QwenImageAdapter" in msg and "Pass --model-adapter-path explicitly" in msg
    assert not marker.exists() and "evil_adapter" not in sys.modules
    assert not (tmp_path / "out").exists()
    # the CLI: one line, exit 2
    assert ex.main(["--save-dir", str(tmp_path / "save"), "--output-dir", str(tmp_path / "out")]) == 2
    assert not marker.exists()
    # an explicit flag is the user's own choice, and a registered family needs none
    with pytest.raises(ex.ExportError, match="--form adapter needs a LoRA checkpoint"):
        ex.export_checkpoint(tmp_path / "save", "t2i", 1, tmp_path / "out", form="adapter",
                             model_adapter_path="trainer.models.sd3.SD3Adapter")
    contract = d / "adapter_contract.json"
    contract.write_text(json.dumps({"mode": "full", "model_adapter_path": "trainer.models.flux.FluxAdapter"}))
    assert ex.resolve_adapter_path(tmp_path / "save", "t2i", 1) == "trainer.models.flux.FluxAdapter"


# ---------------------------------------------------------------------------- atomic writes


def _planted(target: Path, victim: Path, monkeypatch) -> list[Path]:
    """Plant symlinks to `victim` at the legacy temporary name and at the first random name the
    writer will try (the random source is pinned so the test can predict it)."""
    names = itertools.chain(["aaaaaaaaaaaa"], (f"{i:012x}" for i in itertools.count(1)))
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    links = [target.with_name(target.name + ".tmp"), target.with_name(target.name + ".aaaaaaaaaaaa.tmp")]
    for link in links:
        link.symlink_to(victim)
    return links


@pytest.mark.parametrize("writer", ["artifact", "jsonl"])
def test_a_symlink_planted_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch, writer):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    target = out / ("group_00000000.safetensors" if writer == "artifact" else "prompts.jsonl")
    links = _planted(target, victim, monkeypatch)
    if writer == "artifact":
        artifacts.atomic_write_bytes(target, b"new data")
        assert target.read_bytes() == b"new data"
    else:
        assert write_jsonl(target, [{"prompt": "a"}]) == 1
        assert target.read_text() == '{"prompt":"a"}\n'
    assert victim.read_text() == "precious"
    assert all(link.is_symlink() for link in links)
    assert sorted(p.name for p in out.iterdir()) == sorted([target.name, *(link.name for link in links)])
    assert oct(target.stat().st_mode & 0o777) == oct(files.file_mode())  # the umask, as open() gives


def test_the_rng_file_goes_through_the_exclusive_writer(tmp_path, monkeypatch):
    """Links planted in the new iteration directory (right after the shards, before the RNG file)
    are not followed either."""
    import torch.distributed.checkpoint as dcp

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    model, opt = _model()
    target = ck.iteration_dir(tmp_path / "save", "t2i", 1) / "rng_rank0.pt"
    real_save = dcp.save

    def save_then_plant(state, *a, **kw):
        out = real_save(state, *a, **kw)
        _planted(target, victim, monkeypatch)
        return out

    monkeypatch.setattr(dcp, "save", save_then_plant)
    _save(tmp_path / "save", 1, model, opt)
    assert victim.read_text() == "precious"
    assert torch.load(target, weights_only=True)["format"] == ck.RNG_FORMAT


# ---------------------------------------------------------------------------- names and earlier runs


def test_eval_set_names_cannot_leave_the_artifact_root(recipe, tmp_path):  # noqa: F811
    evalf = tmp_path / "eval.jsonl"
    evalf.write_text(json.dumps({"prompt": "a red ball", "metadata": {"task": "t2i", "sample_id": "e0"}}) + "\n")
    for bad in ("../x", "a/b", "..", "/abs", ""):
        with pytest.raises(PreflightError) as e:
            validate(load_config([*recipe, *_outputs(tmp_path), "--eval-prompt-data", bad, str(evalf),
                                  "other", str(evalf), "--eval-interval", "1"]), 2)
        assert f"--eval-prompt-data name {bad!r} must be 1-64 letters, digits" in str(e.value), bad
    validate(load_config([*recipe, *_outputs(tmp_path), "--eval-prompt-data", "pick.score-v2_1", str(evalf),
                          "--eval-interval", "1"]), 2)
    # and below preflight, the layout itself refuses a path that leaves the root
    with pytest.raises(ValueError, match="would leave the artifact root"):
        artifacts.prepare_rollout_dir(tmp_path / "art", "t2i/../../x", 0, eval=True)
    assert not (tmp_path / "x").exists()


def test_a_fresh_run_refuses_an_earlier_runs_rollouts(recipe, tmp_path):  # noqa: F811
    root = tmp_path / "run" / "artifacts"
    artifacts.prepare_rollout_dir(root, "t2i", 3)
    with pytest.raises(PreflightError) as e:
        validate(load_config([*recipe, *_outputs(tmp_path)]), 2)
    msg = str(e.value)
    assert f"--artifact-root {root} already holds rollouts of an earlier run (t2i/rollout_0000003)" in msg
    assert "choose a new --artifact-root" in msg and "its run left no committed checkpoint" in msg
    # eval rollouts of a multi-set run count too
    shutil.rmtree(root / "t2i")
    artifacts.prepare_rollout_dir(root, "t2i/pickscore", 0, eval=True)
    with pytest.raises(PreflightError, match="eval/t2i/pickscore/rollout_0000000"):
        validate(load_config([*recipe, *_outputs(tmp_path)]), 2)
    # resuming continues them (the run's own artifacts), and another root is a fresh start
    _commit_fake(tmp_path / "run" / "ckpt", 0)
    validate(load_config([*recipe, *_outputs(tmp_path), "--load", str(tmp_path / "run" / "ckpt")]), 2)
    validate(load_config([*recipe, *_outputs(tmp_path, "run2")]), 2)
    assert (root / "eval" / "t2i" / "pickscore" / "rollout_0000000").is_dir()
