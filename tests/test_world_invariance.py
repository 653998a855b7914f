"""The world size decides who computes, never what: one recipe of the tiny model, trained for 3
rollouts by `python -m trainer.train` under torchrun on 1, 2 and 4 gloo ranks, logs the same
per-rollout rewards, advantages, losses and grad norms and ends on the same weights.

The recipe names 4 ranks (16 candidates, 2 updates, micro-batches of 2): on 1 and 2 ranks it is
the same training with more micro-batches per rank (gradient accumulation), as preflight reports.
What may differ is only the order of fp32 reductions (gloo's all-reduce and reduce-scatter, the
sums over micro-batches); FIRST_RTOL, SERIES_RTOL and WEIGHTS_RTOL state what that amounts to.
The rollout forwards are pinned to the same rows at every world size (--engine-batch-size 4,
prompts of one token length): on these CPUs a GEMM's rounding depends on its row count and the
attention's on the padded text length, which is a kernel choice, not the training.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.workers.launch import ROOT, free_port
from tests.workers.recipes import TINY_SAMPLING

WORLDS = (1, 2, 4)
ROLLOUTS = 3

#: the per-rollout series compared across world sizes, each with the scale its difference is
#: measured against: its own largest value, or 1 where it is a mean of unit-std advantages
#: (advantage_mean and the loss cancel to ~1e-6, so their own size is no scale)
SERIES = {"reward/color_mean": None, "reward/color_std": None, "reward/weighted_total_mean": None,
          "reward/advantage_mean": 1.0, "reward/advantage_std": None, "train/loss": 1.0,
          "train/grad_norm": None, "train/lr": None, "train/optimizer_steps": None}
GRPO_SERIES = {"train/ratio_mean": None, "train/ratio_max": None, "train/ratio_min": None}

#: What fp32 reduction order (gloo's sums, the micro-batch accumulation) may change, measured on a
#: 2-core CPU (docs/training.md, "The world size decides who computes"). Rollout 0 is the same
#: computation at every world size: its rewards and advantages are equal to the bit, its update
#: within FIRST_RTOL. The difference then grows through the rollouts (the next images are sampled
#: with weights that differ in the last bits, group-normalised advantages magnify it): measured
#: after 3 rollouts, at most 5e-5 of a series and 6e-4 of a trained tensor at these learning rates.
FIRST_RTOL = 1e-6
SERIES_RTOL = 5e-4
WEIGHTS_RTOL = 5e-3

MODES = {
    # FlowGRPO, LoRA on the attention projections
    "lora": """
fsdp-trainable-mode = "lora"
lora-rank = 4
lora-alpha = 8
lora-target-modules = ["attn.to_q", "attn.to_v", "attn.add_v_proj"]
fsdp-master-dtype = "fp32"
lr = 1e-2
""",
    # FlowGRPO, every weight trained
    "full": """
fsdp-trainable-mode = "full"
lr = 1e-3
""",
    # DiffusionNFT (ODE rollouts, per-candidate noise draws), LoRA
    "nft-lora": """
fsdp-trainable-mode = "lora"
lora-rank = 4
lora-alpha = 8
lora-target-modules = ["attn.to_q", "attn.to_v", "attn.add_v_proj"]
fsdp-master-dtype = "fp32"
lr = 1e-2
algorithm = "nft"
nft-beta = 1.0
nft-timestep-fraction = 0.5
adv-clip-max = 5.0
""",
}


def _recipe(tmp: Path, model_dir: Path, mode: str) -> Path:
    prompts = tmp / "train.jsonl"
    with open(prompts, "w") as f:
        for i, p in enumerate(["a red ball", "a blue cup", "a red cube", "a blue box"]):
            f.write(json.dumps({"prompt": p, "metadata": {"task": "t2i", "sample_id": f"p{i}"}}) + "\n")
    path = tmp / f"{mode}.toml"
    path.write_text(f"""
actor-num-nodes = 1
actor-num-gpus-per-node = 4
generation-task = "t2i"
model-path = "{model_dir}"
prompt-data = "{prompts}"
rollout-batch-size = 4
n-samples-per-prompt = 4
num-updates-per-batch = 2
micro-batch-size = 2
engine-batch-size = 4
num-rollout = {ROLLOUTS}
fsdp-param-dtype = "fp32"
fsdp-reduce-dtype = "fp32"
weight-sync-wire-dtype = "fp32"
eps-clip = 0.2
weight-decay = 0.0
clip-grad = 1.0
reward-runtime = "cpu"
reward-scorer-path = "color"
no-hacking-watch = true
save-interval = {ROLLOUTS}
{MODES[mode]}
{TINY_SAMPLING}""")
    return path


def _train(recipe: Path, out: Path, world: int) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "trainer.train",
           "--config", str(recipe), "--artifact-root", str(out / "artifacts"), "--save", str(out / "ckpt"),
           "--tensorboard-dir", str(out / "tb")]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{world} ranks exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stderr


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """max |a - b| over `scale` (None: max |a|, the quantity's own size)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / (a.abs().max().clamp_min(1e-30) if scale is None else scale))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_recipe_on_1_2_and_4_ranks_trains_the_same(tmp_path, tiny_model_dir, mode):
    from tools.export_checkpoint import load_checkpoint
    from trainer.metrics import read_scalars

    recipe = _recipe(tmp_path, tiny_model_dir, mode)
    series, weights = {}, {}
    for world in WORLDS:
        out = tmp_path / f"w{world}"
        err = _train(recipe, out, world)
        if world != 4:
            assert f"the recipe names 4 ranks and this run has {world}: the same training" in err
        scalars = read_scalars(out / "tb")
        names = {**SERIES, **({} if mode.startswith("nft") else GRPO_SERIES)}
        series[world] = {n: torch.tensor([v for _, v in scalars[n]]) for n in names}
        assert all(len(v) == ROLLOUTS for v in series[world].values())
        tensors = load_checkpoint(out / "ckpt", "t2i", None).tensors
        weights[world] = {n: t.float() for n, t in tensors.items()}

    ref = series[1]
    assert float(ref["train/optimizer_steps"].sum()) == 2 * ROLLOUTS and float(ref["train/grad_norm"].min()) > 0
    report = {}
    for world in WORLDS[1:]:
        got = series[world]
        for name in ("reward/color_mean", "reward/advantage_mean", "reward/advantage_std"):
            assert got[name][0] == ref[name][0], (world, name)  # rollout 0: the same images, bit for bit
        for name in ("train/loss", "train/grad_norm"):
            assert _rel(ref[name][:1], got[name][:1], names[name]) <= FIRST_RTOL, (world, name)
        for name, values in got.items():
            report[(world, name)] = _rel(ref[name], values, names[name])
        assert weights[world].keys() == weights[1].keys()
        report[(world, "weights")] = max(_rel(weights[1][n], weights[world][n]) for n in weights[1])
    print(f"\n{mode}: " + ", ".join(f"{w} ranks {n}: {r:.1e}" for (w, n), r in report.items() if r))
    bad = {k: r for k, r in report.items() if r > (WEIGHTS_RTOL if k[1] == "weights" else SERIES_RTOL)}
    assert not bad, bad
