"""torchrun worker (2 ranks, CPU, gloo) for tests/test_weight_sync_dist.py: the gather paths of
trainer/weight_sync.py (flat, per-tensor, and "auto" on both sides of its size split) against the
per-parameter DTensor.full_tensor() reference, bit for bit.

Writes <out_dir>/rank<r>.json: {"checks": {name: bool}, "figures": {...}} or {"error": traceback}.
Usage: python -m torch.distributed.run --nproc-per-node 2 tests/dist/weight_sync_worker.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
warnings.filterwarnings("ignore", message="FSDP2-wrapped module.*returned a view tensor")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trainer.weight_sync as ws  # noqa: E402
from tests.dist.tiny import ADAPTER, LORA_TARGETS, ReceiverEngine, make_cfg, tiny_transformer  # noqa: E402
from trainer.actor import Actor, reshard_all  # noqa: E402
from trainer.distributed import build_mesh, init_distributed, shutdown_and_exit  # noqa: E402

MODES = ("auto", "flat", "per_tensor")


@contextlib.contextmanager
def counting_gathers():
    """Count the all-gathers gather_full_tensors issues (it looks the function up at call time)."""
    calls: list[int] = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def wrap(fn):
        def counted(out, inp, *args, **kwargs):
            calls.append(int(inp.numel()))
            return fn(out, inp, *args, **kwargs)
        return counted

    for n in names:
        setattr(dist, n, wrap(saved[n]))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


@contextlib.contextmanager
def flat_split(max_bytes: int):
    saved = ws.FLAT_GATHER_MAX_BYTES
    ws.FLAT_GATHER_MAX_BYTES = max_bytes
    try:
        yield
    finally:
        ws.FLAT_GATHER_MAX_BYTES = saved


def same(got, want) -> bool:
    return len(got) == len(want) and all(
        g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


def direct_checks(mesh, checks: dict, figures: dict) -> None:
    """gather_full_tensors on hand-made Shard(0) DTensors: uneven rows, a rank with no rows, 1-D,
    3-D, empty, mixed dtypes in one call, with and without a cast."""
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)  # the same full tensors on every rank
    full = [torch.randn(5, 3),                          # 3 + 2 rows
            torch.randn(1, 4).to(torch.bfloat16),       # 1 + 0 rows: rank 1 holds nothing
            torch.randn(7),                             # 1-D, 4 + 3
            torch.randn(4).to(torch.bfloat16),          # 1-D, even
            torch.randn(6, 2, 3),                       # 3-D
            torch.randn(3, 5).to(torch.float16),
            torch.randn(0, 3),                          # empty
            torch.randn(9, 4)]
    dts = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
    checks["direct_layout_is_fsdp_chunks"] = all(ws._shard0_rows(t) is not None for t in dts)
    checks["direct_a_rank_without_rows"] = [ws._shard0_rows(dts[1])[1] if dist.get_rank() == 1 else 0] == [0]
    plans = {"own": [None] * len(dts), "bf16": [torch.bfloat16] * len(dts),
             "mixed": [None, torch.float32, torch.bfloat16, None, torch.float16, None, torch.bfloat16, torch.float32]}
    counts: dict[str, int] = {}
    for plan, dtypes in plans.items():
        want = [t.full_tensor() if d is None else t.full_tensor().to(d) for t, d in zip(dts, dtypes)]
        gather_dtypes = {(d or t.dtype) for t, d in zip(dts, dtypes) if t.numel()}
        for mode in MODES:
            with counting_gathers() as calls:
                got = ws.gather_full_tensors(dts, dtypes, mode)
            checks[f"direct_{plan}_{mode}_bit_identical"] = same(got, want)
            counts[f"{plan}_{mode}"] = len(calls)
            if mode == "per_tensor":
                checks[f"direct_{plan}_{mode}_one_gather_per_tensor"] = len(calls) == len(dts)
            else:  # every tensor here is small: "auto" takes the flat path too; one gather per gather dtype
                # with data (a dtype whose only tensor is empty has nothing to gather)
                checks[f"direct_{plan}_{mode}_one_gather_per_dtype"] = len(calls) == len(gather_dtypes)
        # "auto" on both sides of its split: tensors of >= 40 bytes gather on their own
        with flat_split(40), counting_gathers() as calls:
            got = ws.gather_full_tensors(dts, dtypes, "auto")
        sizes = [t.numel() * (d or t.dtype).itemsize for t, d in zip(dts, dtypes)]
        big = sum(1 for s, t in zip(sizes, dts) if s >= 40 and t.numel())
        small_dtypes = {(d or t.dtype) for s, t, d in zip(sizes, dts, dtypes) if s < 40 and t.numel()}
        checks[f"direct_{plan}_auto_split_bit_identical"] = same(got, want)
        checks[f"direct_{plan}_auto_split_takes_both_paths"] = (
            big > 0 and len(small_dtypes) > 0 and len(calls) == big + len(small_dtypes))
        counts[f"{plan}_auto_split"] = len(calls)
    figures["direct_gather_calls"] = counts
    # plain tensors and a one-rank mesh are not gathered at all
    with counting_gathers() as calls:
        got = ws.gather_full_tensors([full[0]], [torch.bfloat16], "flat")
    checks["plain_tensor_cast_without_gather"] = not calls and torch.equal(got[0], full[0].to(torch.bfloat16))
    # a plain tensor after a per-tensor gather in the same call (the local one is still cast, not gathered)
    try:
        got = ws.gather_full_tensors([dts[0], full[2]], [None, torch.bfloat16], "per_tensor")
        checks["plain_tensor_after_per_tensor_gather"] = same(got, [full[0], full[2].to(torch.bfloat16)])
    except Exception:
        traceback.print_exc()
        checks["plain_tensor_after_per_tensor_gather"] = False


def _reference(model, kind, wire):
    return [(n, t.clone()) for n, t in ws.iter_sync_tensors(model, kind, wire_dtype=wire)]


def _identical(a, b) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and same([t for _, t in a], [t for _, t in b])


def _randomise_lora(model, rank: int) -> None:
    """Non-zero A and B (B starts at zero), different on each rank's shard, so a merge moves bits."""
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                local = p._local_tensor
                local.copy_(torch.randn(local.shape, generator=g).to(local.dtype))


def model_checks(rank: int, mesh, checks: dict, figures: dict) -> None:
    """iter_sync_buckets for every kind, wire dtype and gather mode equals the per-parameter
    reference; the merged path gathers a bf16 base with fp32 LoRA masters in one bucket."""
    full_model = Actor(tiny_transformer(seed=3), mesh, make_cfg("full"), device=torch.device("cpu"),
                       adapter=ADAPTER).model
    lcfg = make_cfg("lora", fsdp__fsdp_master_dtype="fp32", fsdp__fsdp_param_dtype="bf16")
    lora_model = Actor(tiny_transformer(seed=4, dtype=torch.bfloat16), mesh, lcfg, device=torch.device("cpu"),
                       adapter=ADAPTER).model
    _randomise_lora(lora_model, rank)
    reshard_all(lora_model)
    dtypes = {p.dtype for p in lora_model.parameters()}
    checks["lora_model_mixes_dtypes"] = dtypes == {torch.bfloat16, torch.float32}
    n_buckets = {}
    sizes = [t.numel() * t.element_size() for m in (full_model, lora_model) for _, t in _reference(m, "full" if m is
             full_model else "merged", None)]
    checks["model_split_has_both_sides"] = min(sizes) < 4096 <= max(sizes)
    for model, kind in ((full_model, "full"), (lora_model, "merged"), (lora_model, "adapter")):
        for wire in (None, torch.float32, torch.bfloat16):
            ref = _reference(model, kind, wire)
            for mode, split in (("auto", None), ("auto", 4096), ("flat", None), ("per_tensor", None)):
                with flat_split(split) if split else contextlib.nullcontext():
                    buckets = [[(n, t.clone()) for n, t in b] for b in ws.iter_sync_buckets(
                        model, kind, wire_dtype=wire, bucket_bytes=20_000 if kind != "adapter" else 2_000,
                        gather_mode=mode)]
                label = f"{kind}_{wire}_{mode}{'_split' if split else ''}".replace("torch.", "")
                checks[f"buckets_{label}_bit_identical"] = len(buckets) > 2 and _identical(
                    [p for b in buckets for p in b], ref)
                n_buckets[label] = len(buckets)
    figures["buckets"] = n_buckets
    # a whole sync in each mode leaves the engine with the reference bits
    ref = dict(_reference(full_model, "full", torch.float32))
    for mode in MODES:
        eng = ReceiverEngine(tiny_transformer(seed=9))
        ws.WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.02, gather_mode=mode).sync(full_model, eng)
        got = {n: p.detach() for n, p in eng.transformer.named_parameters()}
        checks[f"full_sync_{mode}_engine_bit_identical"] = set(ref) == set(got) and all(
            torch.equal(ref[k], got[k]) for k in ref)


def main() -> None:
    out_dir = sys.argv[1]
    info = init_distributed("cpu")
    result: dict = {"rank": info.rank, "world_size": info.world_size, "checks": {}, "figures": {}}
    code = 0
    try:
        mesh = build_mesh("cpu")
        direct_checks(mesh, result["checks"], result["figures"])
        model_checks(info.rank, mesh, result["checks"], result["figures"])
    except Exception:
        result["error"] = traceback.format_exc()
        code = 1
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
