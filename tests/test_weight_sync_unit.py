"""One-process pieces of trainer/weight_sync.py's faster paths: the gather mode's size split."""

from __future__ import annotations

import pytest
import torch

import trainer.weight_sync as ws
from trainer.weight_sync import FLAT_GATHER_MAX_BYTES, WeightSyncer, gather_full_tensors, takes_flat_path


def test_flat_path_split_both_sides():
    below, at = FLAT_GATHER_MAX_BYTES - 1, FLAT_GATHER_MAX_BYTES
    assert takes_flat_path(below, "auto") and not takes_flat_path(at, "auto")
    assert takes_flat_path(at, "flat") and takes_flat_path(10 * at, "flat")
    assert not takes_flat_path(1, "per_tensor")
    # at Qwen-Image shape: a 3072 x 3072 bf16 weight gathers on its own, a rank-64 LoRA A (fp32 master
    # cast to bf16) and a bias go flat
    assert not takes_flat_path(3072 * 3072 * 2, "auto")
    assert takes_flat_path(64 * 3072 * 2, "auto") and takes_flat_path(3072 * 2, "auto")
    with pytest.raises(ValueError, match="gather mode"):
        takes_flat_path(1, "bucketed")


def test_gather_mode_is_checked_and_plain_tensors_pass_through():
    t = torch.randn(4, 3)
    for mode in ws.GATHER_MODES:
        assert gather_full_tensors([t], [None], mode)[0].data_ptr() == t.data_ptr()  # no copy
        assert torch.equal(gather_full_tensors([t], [torch.bfloat16], mode)[0], t.bfloat16())
    with pytest.raises(ValueError, match="gather mode"):
        gather_full_tensors([t], [None], "bucketed")
    with pytest.raises(ValueError, match="gather_mode"):
        WeightSyncer("full", gather_mode="bucketed")
    assert WeightSyncer("full", gather_mode="per_tensor").gather_mode == "per_tensor"
    assert ws.DEFAULT_GATHER_MODE == "auto"


# ---------------------------------------------------------------- the sync plan cached across syncs

import hashlib  # noqa: E402

import torch.nn as nn  # noqa: E402

from tests.dist.tiny import ADAPTER, LORA_TARGETS, ReceiverEngine, make_batch, make_cfg, one_rank_mesh, replay, tiny_transformer  # noqa: E402,E501
from trainer.actor import Actor  # noqa: E402
from trainer.engine.base import WeightSyncError  # noqa: E402
from trainer.core.manifest import name_shape_hash  # noqa: E402
from trainer.core.modules import ModuleTreeSnapshot  # noqa: E402
from trainer.weight_sync import iter_sync_buckets, plan_sync  # noqa: E402

ADV = torch.tensor([1.0, -1.0])


@pytest.fixture(scope="module")
def mesh():
    yield from one_rank_mesh()


def _actor(mesh, mode, **over):
    return Actor(tiny_transformer(), mesh, make_cfg(mode, **over), device=torch.device("cpu"),
                 adapter=ADAPTER)


def _flat(buckets):
    return [(n, t.clone()) for b in buckets for n, t in b]


def _same(a, b) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def test_name_shape_hash_is_the_line_by_line_digest():
    pairs = [("a.weight", (3, 4)), ("b", ()), ("c.bias", torch.Size([7])), ("d", (2, 0, 5))]
    h = hashlib.sha256()
    for n, s in pairs:
        h.update(f"{n}:{','.join(str(int(d)) for d in s)}\n".encode())
    assert name_shape_hash(pairs) == h.hexdigest()
    assert name_shape_hash(pairs[::-1]) != h.hexdigest()


def test_module_tree_snapshot_sees_structure_not_values():
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 2), nn.ReLU()))
    snap = ModuleTreeSnapshot(model)
    assert snap.unchanged(model) and len(snap) == 5
    assert not snap.unchanged(nn.Sequential(nn.Linear(3, 4)))  # another model object
    with torch.no_grad():
        model[0].weight.add_(1.0)
    model[0].weight.data = torch.zeros(4, 3)  # new values, even new storage: same objects
    assert snap.unchanged(model)
    changes = [
        lambda m: setattr(m[0], "weight", nn.Parameter(torch.zeros(4, 3))),            # setattr
        lambda m: m[1][0]._parameters.__setitem__("bias", nn.Parameter(torch.zeros(2))),  # a direct dict write
        lambda m: m[1].add_module("extra", nn.Linear(2, 2)),                           # a new submodule
        lambda m: setattr(m[1], "0", nn.Linear(4, 2)),                                 # a replaced submodule
        lambda m: m[0].register_parameter("bias", None),                               # a removed parameter
    ]
    for change in changes:
        model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 2), nn.ReLU()))
        snap = ModuleTreeSnapshot(model)
        change(model)
        assert not snap.unchanged(model)
    model = nn.Sequential(nn.Linear(3, 4))
    snap = ModuleTreeSnapshot(model)
    model[0].__class__ = type("Wrapped", (nn.Linear,), {})  # what fully_shard does to a module's class
    assert not snap.unchanged(model)


def _syncs(model, kind, wire, bucket_bytes, plan=None):
    return _flat(iter_sync_buckets(model, kind, wire_dtype=wire, bucket_bytes=bucket_bytes, plan=plan))


def test_cached_plan_gives_bit_identical_syncs_across_train_steps_offload_and_onload(mesh):
    """The plan of each kind, built once, is reused after a train step (the optimizer moves the
    values), an offload / onload round trip and a forward that leaves the units unsharded; its
    buckets stay bit-identical to an uncached walk's, so values are read afresh every time."""
    full = _actor(mesh, "full")
    lora = _actor(mesh, "lora", fsdp__no_fsdp_reshard_after_forward=True)
    cases = [(full, "full", torch.bfloat16, 20_000), (lora, "merged", None, 20_000),
             (lora, "adapter", torch.float32, 1_000)]
    plans = {kind: plan_sync(a.model, kind, wire_dtype=w, bucket_bytes=b) for a, kind, w, b in cases}
    assert all(len(p.buckets) > 2 and p.fsdp_modules for p in plans.values())
    assert plans["merged"].has_lora and not plans["full"].has_lora
    ids_before = {a: [id(p) for p in a.model.parameters()] for a in (full, lora)}
    for round_ in range(3):
        for a, kind, wire, b in cases:
            got = plan_sync(a.model, kind, wire_dtype=wire, bucket_bytes=b, cached=plans[kind])
            assert got is plans[kind] and got.builds == 1, (round_, kind)
            assert _same(_syncs(a.model, kind, wire, b, got), _syncs(a.model, kind, wire, b)), (round_, kind)
        if round_ == 0:
            for a in (full, lora):
                a.train_step(make_batch(2, seed=round_), ADV, replay)
        elif round_ == 1:
            for a in (full, lora):
                a.offload()
                a.onload()
            # the LoRA actor keeps its units unsharded after a forward: other parameter objects
            # sit in the modules until plan_sync reshards the plan's units
            with torch.no_grad():
                replay(lora.model, make_batch(2, seed=5))
    # FSDP2 keeps the sharded nn.Parameter objects through all of it
    assert {a: [id(p) for p in a.model.parameters()] for a in (full, lora)} == ids_before


def test_plan_is_rebuilt_when_the_model_or_its_structure_changes(mesh):
    full = _actor(mesh, "full")
    kw = dict(wire_dtype=torch.float32, bucket_bytes=20_000)
    plan = plan_sync(full.model, "full", **kw)
    other = _actor(mesh, "full")
    rebuilt = plan_sync(other.model, "full", **kw, cached=plan)
    assert rebuilt is not plan and rebuilt.builds == 2
    assert _same(_syncs(other.model, "full", torch.float32, 20_000, rebuilt),
                 _syncs(other.model, "full", torch.float32, 20_000))
    # other settings: another plan
    assert plan_sync(full.model, "full", wire_dtype=torch.bfloat16, bucket_bytes=20_000, cached=plan) is not plan
    assert plan_sync(full.model, "full", wire_dtype=torch.float32, bucket_bytes=10_000, cached=plan) is not plan
    # LoRA injected into the model after a first plan: the cached plan is not reused, the kind check
    # sees the LoRA layers
    from peft import LoraConfig, inject_adapter_in_model

    model = tiny_transformer()
    plan = plan_sync(model, "full", **kw)
    assert plan_sync(model, "full", **kw, cached=plan) is plan
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=list(LORA_TARGETS)), model)
    with pytest.raises(WeightSyncError, match="full sync of a LoRA model"):
        plan_sync(model, "full", **kw, cached=plan)
    merged = plan_sync(model, "merged", **kw, cached=plan)
    assert merged is not plan and merged.has_lora
    # a parameter object replaced (e.g. load_state_dict(assign=True)): rebuilt, the new object is read
    name = next(n for n, _ in model.named_parameters() if "base_layer" in n)
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    owner.weight = nn.Parameter(torch.randn_like(owner.weight))
    again = plan_sync(model, "merged", **kw, cached=merged)
    assert again is not merged
    assert _same(_syncs(model, "merged", torch.float32, 20_000, again), _syncs(model, "merged", torch.float32, 20_000))


def test_weight_syncer_keeps_its_plan_and_matches_an_uncached_sync(mesh):
    """Three adapter syncs and three merged syncs with training in between: one plan each, and the
    engine ends with the bits a fresh syncer (a fresh walk) hands over."""
    lora = _actor(mesh, "lora")
    for kind in ("adapter", "merged"):
        syncer = WeightSyncer(kind, wire_dtype="fp32", bucket_size_mb=0.02, lora_config=lora.lora_config)
        engine = ReceiverEngine(tiny_transformer())
        plans = []
        for step in range(3):
            syncer.sync(lora.model, engine)
            plans.append(syncer.plan)
            lora.train_step(make_batch(2, seed=10 + step), ADV, replay)
        syncer.sync(lora.model, engine)
        assert all(p is plans[0] for p in plans) and syncer.plan is plans[0] and plans[0].builds == 1
        fresh_engine = ReceiverEngine(tiny_transformer())
        WeightSyncer(kind, wire_dtype="fp32", bucket_size_mb=0.02, lora_config=lora.lora_config).sync(
            lora.model, fresh_engine)
        got = dict(engine.transformer.named_parameters())
        want = dict(fresh_engine.transformer.named_parameters())
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
