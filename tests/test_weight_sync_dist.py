"""The flat and per-tensor gather paths of trainer/weight_sync.py on 2 ranks (CPU, gloo): one
torchrun launch of tests/dist/weight_sync_worker.py; every named check must hold on every rank.
The same launch syncs a sharded FLUX.1 actor (full and adapter) into the native engine, and the
FLUX checks run once more on a one-rank group in this process."""

from __future__ import annotations

import json

import pytest

from tests.workers.launch import torchrun

MODES = ("auto", "flat", "per_tensor")
PLANS = ("own", "bf16", "mixed")
WIRES = ("None", "float32", "bfloat16")
EXPECTED = (
    {"direct_layout_is_fsdp_chunks", "direct_a_rank_without_rows", "plain_tensor_cast_without_gather",
     "plain_tensor_after_per_tensor_gather",
     "lora_model_mixes_dtypes", "model_split_has_both_sides"}
    | {f"direct_{p}_{m}_bit_identical" for p in PLANS for m in MODES}
    | {f"direct_{p}_per_tensor_one_gather_per_tensor" for p in PLANS}
    | {f"direct_{p}_{m}_one_gather_per_dtype" for p in PLANS for m in ("auto", "flat")}
    | {f"direct_{p}_auto_split_{c}" for p in PLANS for c in ("bit_identical", "takes_both_paths")}
    | {f"buckets_{k}_{w}_{m}_bit_identical" for k in ("full", "merged", "adapter") for w in WIRES
       for m in ("auto", "auto_split", "flat", "per_tensor")}
    | {f"full_sync_{m}_engine_bit_identical" for m in MODES}
)
#: the sync of the tiny FLUX.1 actor into the native engine: engine == gathered actor, bit for bit
FLUX_EXPECTED = (
    {"flux_full_engine_differs_before_sync", "flux_adapter_engine_without_lora_before_sync",
     "flux_adapter_lora_on_both_block_kinds"}
    | {f"flux_{k}_engine_{c}" for k in ("full", "adapter")
       for c in ("names_are_actor_names", "equals_gathered_actor", "version_committed")}
)


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_flux_dir):
    out = tmp_path_factory.mktemp("weight_sync_dist")
    torchrun("tests/dist/weight_sync_worker.py", nproc=2, args=[str(out), str(tiny_flux_dir)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_gather_check_holds_on_every_rank(results):
    for r in results:
        assert "error" not in r, r["error"]
        assert r["world_size"] == 2
        assert set(r["checks"]) == EXPECTED | FLUX_EXPECTED, set(r["checks"]) ^ (EXPECTED | FLUX_EXPECTED)
        failed = sorted(k for k, v in r["checks"].items() if v is not True)
        assert not failed, f"rank {r['rank']} failed: {failed}"


def test_flat_path_uses_fewer_gathers_than_per_tensor(results):
    calls = results[0]["figures"]["direct_gather_calls"]
    assert calls == results[1]["figures"]["direct_gather_calls"]
    for plan in PLANS:
        assert calls[f"{plan}_flat"] < calls[f"{plan}_auto_split"] < calls[f"{plan}_per_tensor"] == 8
    assert calls["bf16_flat"] == 1  # one dtype: a single all-gather for all eight tensors


def test_flux_sync_on_one_rank_leaves_the_engine_equal_to_the_actor(tiny_flux_dir):
    """World size 1: the actor is sharded over one rank, the gather is local; the same checks."""
    from tests.dist.tiny import one_rank_mesh
    from tests.dist.weight_sync_worker import flux_sync_checks

    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        checks: dict = {}
        flux_sync_checks(0, mesh, str(tiny_flux_dir), checks)
    finally:
        next(gen, None)
    assert set(checks) == FLUX_EXPECTED, set(checks) ^ FLUX_EXPECTED
    failed = sorted(k for k, v in checks.items() if v is not True)
    assert not failed, failed
