"""The flat and per-tensor gather paths of trainer/weight_sync.py on 2 ranks (CPU, gloo): one
torchrun launch of tests/dist/weight_sync_worker.py; every named check must hold on every rank."""

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


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("weight_sync_dist")
    torchrun("tests/dist/weight_sync_worker.py", nproc=2, args=[str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_gather_check_holds_on_every_rank(results):
    for r in results:
        assert "error" not in r, r["error"]
        assert r["world_size"] == 2
        assert set(r["checks"]) == EXPECTED, set(r["checks"]) ^ EXPECTED
        failed = sorted(k for k, v in r["checks"].items() if v is not True)
        assert not failed, f"rank {r['rank']} failed: {failed}"


def test_flat_path_uses_fewer_gathers_than_per_tensor(results):
    calls = results[0]["figures"]["direct_gather_calls"]
    assert calls == results[1]["figures"]["direct_gather_calls"]
    for plan in PLANS:
        assert calls[f"{plan}_flat"] < calls[f"{plan}_auto_split"] < calls[f"{plan}_per_tensor"] == 8
    assert calls["bf16_flat"] == 1  # one dtype: a single all-gather for all eight tensors
