"""What the families' end-to-end tests share: a tiny LoRA recipe for the real loop under
torchrun (2 gloo processes, the colour reward, a high learning rate and a wide clip so a few
rollouts move the reward), the long run plus a run resumed from its first checkpoint, the
resume-identity checks and the reward's rise."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.test_e2e import _model_tensors, _state, _train, _write_prompts


def lora_recipe(tmp: Path, model_dir: Path, adapter_path: str, *, candidates: int, rollouts: int, lr: float,
                sampling: str, name: str) -> Path:
    """A LoRA recipe file (rank 4, fp32 everywhere, a checkpoint every rollout) for one prompt,
    "a red ball", with `candidates` candidates; `sampling` is its [sampling-config] table."""
    train = _write_prompts(tmp / "train.jsonl", ["a red ball"], "t")
    text = f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 2
generation-task = "t2i"
model-path = "{model_dir}"
model-adapter-path = "{adapter_path}"
prompt-data = "{train}"
rollout-batch-size = 1
n-samples-per-prompt = {candidates}
micro-batch-size = 2
num-updates-per-batch = 2
fsdp-param-dtype = "fp32"
fsdp-reduce-dtype = "fp32"
weight-sync-wire-dtype = "fp32"
fsdp-trainable-mode = "lora"
lora-rank = 4
lora-alpha = 8
lora-adapter-mode = true
fsdp-master-dtype = "fp32"
eps-clip = 0.2
lr = {lr}
weight-decay = 0.0
clip-grad = 10.0
reward-runtime = "cpu"
reward-scorer-path = "color"
save-interval = 1
artifact-retention-rollouts = {rollouts}
{sampling}"""
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


def train_and_resume(recipe: Path, tmp: Path, rollouts: int) -> tuple[Path, Path]:
    """(a, b): `rollouts` rollouts uninterrupted, and a run resumed from a's first checkpoint
    for rollout 1 (what a run stopped after rollout 0 would load)."""
    a, b = tmp / "a", tmp / "b"
    _train(recipe, a, "--num-rollout", str(rollouts))
    log = _train(recipe, b, "--num-rollout", "2", "--load", str(a / "ckpt"), "--ckpt-step", "0")
    assert "continuing at rollout 1" in log
    return a, b


def assert_lora_resume_is_exact(a: Path, b: Path, adapter_path: str, candidates: int) -> dict[str, torch.Tensor]:
    """Iteration 1 of the uninterrupted run and of the resumed one: the same checkpoint tensors
    (some LoRA tensor trained by rollout 1), policy version 2 and lr step 4, the family's adapter
    in the contract, and byte-identical images in the rollout after the resume. Returns a's
    iteration-1 tensors for the family's own checks."""
    ta, tb = _model_tensors(a / "ckpt", 1), _model_tensors(b / "ckpt", 1)
    assert ta and ta.keys() == tb.keys() and any("lora_" in n for n in ta)
    t0 = _model_tensors(a / "ckpt", 0)
    assert any(not torch.equal(tb[n], t0[n]) for n in tb if "lora_" in n), "rollout 1 trained"
    assert not (b / "ckpt" / "t2i" / "iter_0000000").exists()  # b started from a's iteration 0
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    sa, sb = _state(a / "ckpt", 1), _state(b / "ckpt", 1)
    for key in ("policy_version", "lr_scheduler_steps", "rollout_id"):
        assert sa[key] == sb[key], key
    assert sa["policy_version"] == 2 and sa["lr_scheduler_steps"] == 4
    contract = json.loads((a / "ckpt" / "t2i" / "iter_0000001" / "adapter_contract.json").read_text())
    assert contract["model_adapter_path"] == adapter_path
    da, db = (r / "artifacts" / "t2i" / "rollout_0000001" for r in (a, b))
    pngs = sorted(p.name for p in da.glob("*.png"))
    assert len(pngs) == candidates and pngs == sorted(p.name for p in db.glob("*.png"))
    for name in pngs:
        assert (da / name).read_bytes() == (db / name).read_bytes(), name
    return ta


def color_rewards(run: Path, rollouts: int) -> list[float]:
    """The run's per-rollout colour reward (the loop's TensorBoard series), one per rollout."""
    from trainer.metrics import read_scalars

    rewards = [v for _, v in read_scalars(run / "tb")["reward/color_mean"]]
    assert len(rewards) == rollouts
    return rewards
