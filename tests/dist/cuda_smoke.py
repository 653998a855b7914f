"""One FlowGRPO update + weight sync of the tiny transformer on the accelerator, with figures.

Not part of pytest (CI has no GPU). Run on a GPU machine, 1 or 2 processes:
    python -m torch.distributed.run --nproc-per-node 1 tests/dist/cuda_smoke.py --out /tmp/smoke
    python -m torch.distributed.run --nproc-per-node 2 tests/dist/cuda_smoke.py --out /tmp/smoke
(--device cpu runs the same steps on CPU/gloo.) Each rank writes <out>/rank<r>.json with its
checks and figures; the exit code is non-zero when a check fails.
Covers, in bf16 with an fp32 master: full FT (activation checkpointing) update -> offload/onload
bit-exact -> full sync (bf16 wire) matching the gathered weights; LoRA update -> adapter sync ->
merged sync into a second engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
warnings.filterwarnings("ignore", message="FSDP2-wrapped module.*returned a view tensor")

import torch  # noqa: E402

from tests.dist.tiny import (ADAPTER, LORA_TARGETS, ReceiverEngine, full_params, make_batch, make_cfg, replay,  # noqa: E402
                             tiny_transformer)
from trainer.actor import Actor  # noqa: E402
from trainer.core.names import model_name  # noqa: E402
from trainer.distributed import build_mesh, init_distributed, shutdown_and_exit  # noqa: E402
from trainer.weight_sync import WeightSyncer  # noqa: E402


def run(device: torch.device, mesh, rank: int, n: int, checks: dict, figures: dict) -> None:
    bf16 = torch.bfloat16
    batch = make_batch(n, seed=rank, device=device)
    for k in ("latents", "next_latents", "prompt_embeds"):
        batch[k] = batch[k].to(bf16)  # rollout and replay in the same dtype
    adv = torch.linspace(-1, 1, n, device=device) * (1 if rank % 2 == 0 else -1)

    cfg = make_cfg("full", fsdp__fsdp_param_dtype="bf16", fsdp__fsdp_master_dtype="fp32",
                   fsdp__fsdp_activation_checkpointing=True, grpo__micro_batch_size=n // 2)
    actor = Actor(tiny_transformer(dtype=bf16).to(device), mesh, cfg, device=device, adapter=ADAPTER)
    before = full_params(actor.model)
    m = actor.train_step(batch, adv, replay)  # includes warm-up effects
    first = actor.last_update_stats[0]
    m = actor.train_step(batch, adv, replay)
    # the anchor (no_grad) and the first update (grad, checkpointed) must pick the same kernels
    checks["first_update_ratio_exactly_1"] = all(
        st["ratio_max"].item() == 1.0 == st["ratio_min"].item() for st in (first, actor.last_update_stats[0]))
    checks["second_update_ratio_not_1"] = actor.last_update_stats[1]["ratio_max"].item() != 1.0 or \
        actor.last_update_stats[1]["ratio_min"].item() != 1.0
    after = full_params(actor.model)
    trainable = {model_name(p_n) for p_n, p in actor.model.named_parameters() if p.requires_grad}
    checks["full_every_trainable_changed"] = all(not torch.equal(before[k], after[k]) for k in trainable)
    checks["full_optimizer_steps"] = m["train/optimizer_steps"] == 2
    figures["full_train"] = m
    figures["offload"] = actor.offload()
    figures["onload"] = actor.onload()
    checks["offload_roundtrip_bit_exact"] = all(torch.equal(after[k], v) for k, v in full_params(actor.model).items())
    engine = ReceiverEngine(tiny_transformer(seed=3, dtype=bf16).to(device))
    figures["full_sync"] = WeightSyncer("full", wire_dtype="bf16", bucket_size_mb=1).sync(actor.model, engine)
    checks["full_sync_engine_matches_gathered_bf16"] = all(
        torch.equal(p.detach(), after[k].to(bf16)) for k, p in engine.transformer.named_parameters())

    lcfg = make_cfg("lora", fsdp__fsdp_param_dtype="bf16", fsdp__fsdp_master_dtype="fp32",
                    fsdp__fsdp_activation_checkpointing=True, grpo__micro_batch_size=n // 2, optim__lr=1e-3)
    lactor = Actor(tiny_transformer(dtype=bf16).to(device), mesh, lcfg, device=device,
                   adapter=ADAPTER)
    figures["lora_train"] = lactor.train_step(batch, adv, replay)
    leng = ReceiverEngine(tiny_transformer(dtype=bf16).to(device))
    figures["adapter_sync"] = WeightSyncer("adapter", wire_dtype="bf16", lora_config=lactor.lora_config,
                                           verify_checksum=False).sync(lactor.model, leng)
    lg = full_params(lactor.model)
    eng_lora = {k.replace(".default.", "."): p.detach() for k, p in leng.transformer.named_parameters() if ".lora_" in k}
    checks["adapter_sync_matches_bf16"] = all(torch.equal(v, lg[k.replace(".lora_A.", ".lora_A.default.").replace(
        ".lora_B.", ".lora_B.default.")].to(bf16)) for k, v in eng_lora.items())
    meng = ReceiverEngine(tiny_transformer(seed=4, dtype=bf16).to(device))
    figures["merged_sync"] = WeightSyncer("merged", wire_dtype="bf16").sync(lactor.model, meng)
    checks["merged_sync_committed"] = meng.policy_version == 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--candidates", type=int, default=8, help="candidates per rank (even)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = init_distributed(args.device)
    result: dict = {"rank": info.rank, "world_size": info.world_size, "device": str(info.device),
                    "torch": torch.__version__, "checks": {}, "figures": {}}
    code = 0
    try:
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name(info.device)
        run(info.device, build_mesh(args.device), info.rank, args.candidates, result["checks"], result["figures"])
        code = 0 if all(result["checks"].values()) else 2
    except Exception:
        result["error"] = traceback.format_exc()
        code = 1
    with open(os.path.join(args.out, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    if info.rank == 0:
        print(json.dumps(result, indent=1, default=float))
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
