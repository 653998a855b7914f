import json

import pytest
import torch
from torch import nn

from trainer import checkpoint as ck
from tests.workers.launch import torchrun


def _save_simple(tmp_path, iteration, model, opt, contract=None, **kw):
    return ck.save_checkpoint(tmp_path, "t2i", iteration, model=model, optimizer=opt,
                              trainer_state={"rollout_id": iteration, "policy_version": iteration},
                              weight_sync_manifest={"tensor_count": 2}, adapter_contract=contract or {"mode": "full"},
                              trainable_only=False, **kw)


def _model():
    """A Linear(4, 2) and its AdamW after one step (seed 0): a model and an optimizer with state."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_layout_and_write_order_markers(tmp_path):
    m, opt = _model()
    assert _save_simple(tmp_path, 3, m, opt)
    d = tmp_path / "t2i" / "iter_0000003"
    for name in ("fsdp", "rng_rank0.pt", "trainer_state.json", "weight_sync_manifest.json",
                 "adapter_contract.json", "COMMITTED"):
        assert (d / name).exists(), name
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (tmp_path / "t2i" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    state = json.loads((d / "trainer_state.json").read_text())
    assert state["rollout_id"] == 3 and state["iteration"] == 3
    assert not list(d.glob("*.tmp"))


def test_uncommitted_directory_is_never_trusted(tmp_path):
    m, opt = _model()
    assert _save_simple(tmp_path, 1, m, opt)
    assert _save_simple(tmp_path, 2, m, opt)
    (tmp_path / "t2i" / "iter_0000002" / "COMMITTED").unlink()  # a save that crashed before COMMITTED
    assert ck.latest_committed_iteration(tmp_path, "t2i") == 1
    with pytest.raises(ck.CheckpointError, match="no COMMITTED"):
        ck.load_checkpoint(tmp_path, "t2i", model=m, optimizer=opt, adapter_contract={"mode": "full"},
                           trainable_only=False, iteration=2)


def test_nothing_to_resume_returns_none(tmp_path):
    m, opt = _model()
    assert ck.load_checkpoint(tmp_path, "t2i", model=m, optimizer=opt, adapter_contract={}, trainable_only=False) is None


def test_contract_mismatch_names_each_difference(tmp_path):
    m, opt = _model()
    contract = {"mode": "lora", "lora_rank": 64, "lora_alpha": 128, "base_model_hash": "abc"}
    assert _save_simple(tmp_path, 1, m, opt, contract=contract)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_checkpoint(tmp_path, "t2i", model=m, optimizer=opt, trainable_only=False,
                           adapter_contract={**contract, "lora_rank": 32, "lora_alpha": 64})
    msg = str(e.value)
    assert "lora_rank: checkpoint has 64, this run has 32" in msg
    assert "lora_alpha: checkpoint has 128, this run has 64" in msg
    assert "base_model_hash" not in msg


def test_corrupt_sidecar_is_named(tmp_path):
    m, opt = _model()
    assert _save_simple(tmp_path, 1, m, opt)
    bad = tmp_path / "t2i" / "iter_0000001" / "trainer_state.json"
    bad.write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="trainer_state.json is not valid JSON"):
        ck.load_checkpoint(tmp_path, "t2i", model=m, optimizer=opt, adapter_contract={"mode": "full"},
                           trainable_only=False)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    m, opt = _model()
    assert _save_simple(tmp_path, 1, m, opt)
    other = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ck.CheckpointError, match="lacks"):
        ck.load_checkpoint(tmp_path, "t2i", model=other, optimizer=None, adapter_contract={"mode": "full"},
                           trainable_only=False)


def test_rotation_keeps_n(tmp_path):
    m, opt = _model()
    for it in range(1, 6):
        assert _save_simple(tmp_path, it, m, opt, max_to_keep=3)
    assert ck.committed_iterations(tmp_path, "t2i") == [3, 4, 5]


def test_distributed_save_crash_resume_rotation(tmp_path):
    """2 ranks: a rank failing mid-save leaves no COMMITTED and resume takes the previous
    iteration; the load restores weights, optimizer and RNG exactly; rotation keeps N committed
    ones, also through a failed write with N = 1; a committed iteration is never overwritten and
    a read-only checkpoint directory is a failure returned on every rank, not a crash."""
    save, results = tmp_path / "save", tmp_path / "results"
    results.mkdir()
    torchrun("tests/workers/checkpoint_worker.py", nproc=2, env={"SAVE_DIR": str(save), "RESULT_DIR": str(results)})
    outs = [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]
    for out in outs:
        assert out["ok1"] is True and out["ok2"] is False
        assert out["latest_after_crash"] == 1
        assert out["loaded_rollout_id"] == 1
        assert out["trainable_equal"] and out["rng_equal"] and out["optimizer_resumes"]
        assert out["after_rotation"] == [4, 5]
        assert out["dirs_after_rotation"] == ["iter_0000004", "iter_0000005", "latest_checkpointed_iteration.txt"]
        assert "lora_rank: checkpoint has 0, this run has 8" in out["mismatch_error"]
        assert out["overwrite_ok"] is False and out["iter5_state"]["rollout_id"] == 5
        assert out["keep1_failed_ok"] is False and out["after_keep1_failure"] == [4, 5]
        assert out["keep1_ok"] is True and out["after_keep1"] == [6]
        assert out["read_only_ok"] is False and out["after_read_only"] == [6]
    assert not (save / "t2i" / "iter_0000002").exists()
