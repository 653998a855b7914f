"""Single-process tests of the actor, the FlowGRPO update bookkeeping, offload and weight sync.

FSDP2 runs here on a one-rank gloo group (created in this process, torn down after the module),
so the same sharded code paths run as under torchrun; the 2-process checks are in
tests/test_actor_dist.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.dist.tiny import (ADAPTER, LORA_TARGETS, ReceiverEngine, full_params, make_batch, make_cfg, merged_state, one_rank_mesh,
                             replay, replay_moments, tiny_transformer)
from trainer.actor import Actor, OffloadError, global_update_order, plan_updates
from trainer.train_model import _assert_trainable_boundary, full_tensor, local_shard
from trainer.core.checksum import weights_checksum
from trainer.core.manifest import WeightManifest, WeightSyncError, build_manifest, name_shape_hash, verify_manifest
from trainer.core.names import model_name, strip_wrapper_segments
from trainer.lr_schedule import lr_at_step
from trainer.models.qwen_image import never_trained_param_names
from trainer.weight_sync import WeightSyncer

ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
LIGHT = {"grpo__num_updates_per_batch": 1}  # one optimizer step: enough where only "weights moved" matters
# diffusers' Qwen-Image returns a view of its last projection; replay never modifies it in place
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


@pytest.fixture(scope="module")
def mesh():
    yield from one_rank_mesh()


def build(mesh, mode="full", **over):
    return Actor(tiny_transformer(), mesh, make_cfg(mode, **over), device=torch.device("cpu"),
                 adapter=ADAPTER)


# ---------------------------------------------------------------- pure helpers

def test_lr_schedule_shapes():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=10)
    assert [lr_at_step(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at_step(4, **kw, schedule="constant") == 1.0
    assert lr_at_step(100, **kw, schedule="constant") == 1.0
    assert lr_at_step(4, **kw, schedule="linear") == 1.0
    assert lr_at_step(9, **kw, schedule="linear") == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at_step(14, **kw, schedule="linear") == pytest.approx(0.1)
    assert lr_at_step(9, **kw, schedule="cosine") == pytest.approx(0.55)
    assert lr_at_step(50, **kw, schedule="cosine") == pytest.approx(0.1)
    assert lr_at_step(3, lr=2.0, schedule="cosine") == 2.0  # no decay length: stays at lr
    with pytest.raises(ValueError, match="fsdp-lr-scheduler"):
        lr_at_step(0, lr=1.0, schedule="step")


def test_plan_updates_disjoint_and_checked():
    plan = plan_updates(8, 2, 2)
    assert plan == [[(0, 2), (2, 4)], [(4, 6), (6, 8)]]
    covered = [i for part in plan for (s, e) in part for i in range(s, e)]
    assert covered == list(range(8))
    with pytest.raises(ValueError, match="num-updates-per-batch 3"):
        plan_updates(8, 3, 1)
    with pytest.raises(ValueError, match="micro-batch-size 3"):
        plan_updates(8, 2, 3)


def test_an_update_is_the_same_candidates_on_any_world_size():
    # 4 groups of 4, 2 updates: update u holds the ids = u mod 2 (slots u and u + 2 of every group)
    n, updates = 16, 2
    whole = [list(range(n))[i] for i in global_update_order(list(range(n)), updates)]
    per_update = [set(whole[:n // 2]), set(whole[n // 2:])]
    assert per_update == [set(range(0, n, 2)), set(range(1, n, 2))]
    for world in (2, 4, 8):
        block = n // world
        shares = [[list(range(r * block, (r + 1) * block))[i]
                   for i in global_update_order(list(range(r * block, (r + 1) * block)), updates)]
                  for r in range(world)]
        # every rank holds an equal share of every update, and the shares make up the same updates
        for u in range(updates):
            got = [set(s[u * block // updates:(u + 1) * block // updates]) for s in shares]
            assert all(len(g) == block // updates for g in got)
            assert set().union(*got) == per_update[u]
    with pytest.raises(ValueError, match="equal share of every update"):
        global_update_order([0, 1, 2], 2)


def test_strip_names_manifest_and_checksum():
    assert strip_wrapper_segments("transformer_blocks.0._checkpoint_wrapped_module.attn.to_q.base_layer.weight") \
        == "transformer_blocks.0.attn.to_q.weight"
    assert strip_wrapper_segments("base_model.model.transformer_blocks.1.attn.to_out.0.lora_B.default.weight") \
        == "transformer_blocks.1.attn.to_out.0.lora_B.weight"
    a, b = torch.randn(3, 4), torch.randn(5)
    assert name_shape_hash([("a", a.shape), ("b", b.shape)]) != name_shape_hash([("b", b.shape), ("a", a.shape)])
    m = build_manifest("full", [("a", a), ("b", b)], version=3)
    assert (m.tensor_count, m.total_bytes) == (2, 4 * 17)
    verify_manifest([("a", a), ("b", b)], m)
    for bad in ([("a", a)], [("a", a), ("b", b.to(torch.float64))], [("a", a), ("c", b)]):
        with pytest.raises(WeightSyncError, match="manifest"):
            verify_manifest(bad, m)
    c1 = weights_checksum([("a", a), ("b", b)])
    assert c1 == weights_checksum([("b", b), ("a", a.clone())])          # order-independent
    assert c1 != weights_checksum([("a", a.double()), ("b", b)])         # bits and dtype, not values
    assert c1 != weights_checksum([("a", a.flip(0)), ("b", b)])          # a permutation is caught
    assert c1 != weights_checksum([("a", a), ("b", b + 1e-6)])


def _bits_changed(t: torch.Tensor, i: int) -> torch.Tensor:
    """`t` with the lowest mantissa bit of flat element i flipped (the smallest possible change)."""
    out = t.clone()
    words = out.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    words[i] ^= 1
    return out


def test_checksum_reads_bits_and_catches_single_changes_and_swaps():
    from trainer.core.checksum import CHECKSUM_PERIOD, WeightsChecksum, column_sums, tensor_words

    g = torch.Generator().manual_seed(0)
    # column sums are the exact int64 sums modulo 2^32, whatever the reduction order
    w = torch.randint(-2**31, 2**31 - 1, (5 * CHECKSUM_PERIOD + 7,), dtype=torch.int32, generator=g)
    ref = torch.zeros(CHECKSUM_PERIOD, dtype=torch.int64)
    ref.index_add_(0, torch.arange(w.numel()) % CHECKSUM_PERIOD, w.long())
    assert torch.equal(column_sums(w).long() & 0xFFFFFFFF, ref & 0xFFFFFFFF)
    # the words are the raw bits: a bf16 pair is one int32 word, a view (odd offset) equals its copy
    x = torch.randn(2 * CHECKSUM_PERIOD + 3, generator=g).to(torch.bfloat16)
    assert tensor_words(x).numel() == x.numel()                # odd bf16 count: 16-bit words, widened
    assert tensor_words(x[1:]).numel() == (x.numel() - 1) // 2   # even count: bf16 pairs as int32 words
    assert torch.equal(tensor_words(x[1:]), tensor_words(x[1:].clone()))
    assert weights_checksum([("x", x[1:])]) == weights_checksum([("x", x[1:].clone())])
    assert weights_checksum([("e", torch.zeros(0))]) != weights_checksum([("e", torch.zeros(0, 2))])
    tensors = {"w": torch.randn(7, 300, generator=g),                      # fp32, with a tail
               "h": torch.randn(4, CHECKSUM_PERIOD, generator=g).to(torch.bfloat16),
               "o": torch.randn(13, generator=g).to(torch.bfloat16),       # odd bf16 count: 16-bit words
               "v": torch.randn(6, 300, generator=g)}
    base = weights_checksum(tensors.items())
    # every single one-bit change anywhere is caught, including tail positions and bf16 low halves
    for name, t in tensors.items():
        for i in sorted({0, 1, t.numel() // 2, t.numel() - 2, t.numel() - 1}):
            changed = dict(tensors, **{name: _bits_changed(t, i)})
            assert weights_checksum(changed.items()) != base, (name, i)
    # a swapped pair of same-shape tensors, swapped rows and a transpose-like reshuffle are caught
    same = {"p": torch.randn(8, 16, generator=g), "q": torch.randn(8, 16, generator=g)}
    c = weights_checksum(same.items())
    assert weights_checksum([("p", same["q"]), ("q", same["p"])]) != c
    assert weights_checksum([("p", same["p"][[1, 0, *range(2, 8)]]), ("q", same["q"])]) != c
    assert weights_checksum([("p", same["p"].t().contiguous().view(8, 16)), ("q", same["q"])]) != c
    # as_dtype: the sender checksums what a receiver of another dtype stores
    acc = WeightsChecksum()
    acc.update("p", same["p"], as_dtype=torch.bfloat16)
    assert acc.hexdigest() == weights_checksum([("p", same["p"].to(torch.bfloat16))])


def test_never_trained_params_are_the_last_blocks_text_outputs():
    names = never_trained_param_names(tiny_transformer())
    assert names and all(n.startswith("transformer_blocks.1.") for n in names)
    assert {n.split(".")[2] + "." + n.split(".")[3] for n in names} >= {"attn.to_add_out", "attn.add_q_proj"}
    assert any(".txt_mlp." in n for n in names)
    assert not any(".to_q." in n or ".add_k_proj." in n for n in names)


# ---------------------------------------------------------------- the update

def test_full_update_trains_every_trainable_param_and_ratio_anchor(mesh):
    actor = build(mesh, "full")
    assert actor.never_trained  # dead text-stream params exist and are frozen
    before = full_params(actor.model)
    m = actor.train_step(make_batch(4), ADV, replay)
    after = full_params(actor.model)
    trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all(not torch.equal(before[n], after[n]) for n in trainable)
    assert all(torch.equal(before[n], after[n]) for n in actor.never_trained)
    assert m["train/optimizer_steps"] == 2 and actor.optimizer_steps == 2 and m["train/num_microbatches"] == 4
    first, second = actor.last_update_stats
    assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
    assert (second["ratio_max"].item(), second["ratio_min"].item()) != (1.0, 1.0)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0
    assert m["train/ratio_min"] <= m["train/ratio_mean"] <= m["train/ratio_max"]
    assert m["perf/train_transitions_per_s"] > 0


def test_lora_update_changes_only_adapter(mesh):
    actor = build(mesh, "lora", fsdp__fsdp_master_dtype="fp32")
    before = full_params(actor.model)
    actor.train_step(make_batch(4), ADV, replay)
    after = full_params(actor.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    lora = {n for n in before if ".lora_" in n and n not in actor.never_trained}
    assert changed == lora
    _assert_trainable_boundary(actor.model, "lora", actor.never_trained)
    p = next(p for n, p in actor.model.named_parameters() if ".base_layer." in n)
    p.requires_grad_(True)
    with pytest.raises(RuntimeError, match="trainable boundary"):
        _assert_trainable_boundary(actor.model, "lora", actor.never_trained)


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_frozen_base_kept_out_of_fsdp2_trains_bit_for_bit_like_the_sharded_one(mesh, param_dtype):
    """--fsdp-frozen-params: 'auto' on one rank (and 'replicate') keeps the frozen base as plain
    tensors in the compute dtype, outside FSDP2, and the update is the sharded one's bit for bit
    (bf16: FSDP2's gather casts as .to() does); LoRA's tensors stay FSDP2's."""
    from torch.distributed.tensor import DTensor

    got = {}
    for placement in ("shard", "auto", "replicate"):
        actor = build(mesh, "lora", fsdp__fsdp_master_dtype="fp32", fsdp__fsdp_param_dtype=param_dtype,
                      fsdp__fsdp_frozen_params=placement)
        frozen = [p for p in actor.model.parameters() if not p.requires_grad]
        assert all(isinstance(p, DTensor) for p in actor.trainable)
        if placement == "shard":
            assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in frozen)
        else:
            assert not any(isinstance(p, DTensor) for p in frozen)
            assert {p.dtype for p in frozen} == {torch.float32 if param_dtype == "fp32" else torch.bfloat16}
        trained = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
        got[placement] = (replay(actor.model, make_batch(2, seed=5)), actor.train_step(make_batch(4), ADV, replay),
                          {n: t for n, t in full_params(actor.model).items() if n in trained})
    for placement in ("auto", "replicate"):
        assert torch.equal(got[placement][0], got["shard"][0])
        assert got[placement][1]["train/loss"] == got["shard"][1]["train/loss"]
        assert got["shard"][2] and all(torch.equal(got[placement][2][n], t) for n, t in got["shard"][2].items())
    with pytest.raises(ValueError, match="--fsdp-frozen-params replicate .*--fsdp-cpu-offload"):
        build(mesh, "full", fsdp__fsdp_frozen_params="replicate", fsdp__fsdp_cpu_offload=True, **LIGHT)


def test_zero_advantages_skip_round_and_invalid_rows_are_excluded(mesh):
    actor = build(mesh, "full")
    before = full_params(actor.model)
    m = actor.train_step(make_batch(4), torch.zeros(4), replay)
    assert m["train/optimizer_skips"] == m["train/num_microbatches"] == 4 and m["train/optimizer_steps"] == 0
    assert actor.skipped_rounds == 1 and actor.optimizer_steps == 0
    assert all(torch.equal(v, full_params(actor.model)[k]) for k, v in before.items())
    # the advantages of invalid candidates must not matter
    valid = torch.tensor([True, False, True, True])
    results = []
    for bad in (5.0, -5.0):
        a = build(mesh, "full")
        adv = ADV.clone()
        adv[1] = bad
        a.train_step(make_batch(4), adv, replay, valid=valid)
        results.append(full_params(a.model))
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_offload_onload_bit_exact_and_frees_storage(mesh):
    actor = build(mesh, "full")
    actor.train_step(make_batch(4), ADV, replay)  # creates AdamW state
    params = full_params(actor.model)
    state = {id(p): {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                     for k, v in s.items()} for p, s in actor.optimizer.state.items()}
    actor.offload()
    assert actor.offloaded
    assert all(local_shard(p).untyped_storage().nbytes() == 0 for p in actor.model.parameters())
    with pytest.raises(OffloadError):
        actor.offload()
    actor.onload()
    assert not actor.offloaded
    after = full_params(actor.model)
    assert all(torch.equal(params[k], after[k]) for k in params)
    for p, s in actor.optimizer.state.items():
        for k, v in s.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(state[id(p)][k], v)
    with pytest.raises(OffloadError):
        actor.onload()


def test_offload_host_copies_use_one_exact_reused_buffer(mesh):
    """The host side of an offload is one buffer of the storages' own bytes (plus alignment), not
    one allocation per storage, and a second offload reuses it."""
    from trainer.host_arena import layout

    actor = build(mesh, "full")
    actor.train_step(make_batch(4), ADV, replay)
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in actor._param_tensors()}
    m = actor.offload()
    want = layout([n for n in sizes.values() if n])[1]
    assert actor._params_off.host_bytes == want
    assert m["perf/actor_offload_host_gb"] * 1e9 == pytest.approx(want + actor._optim_off.host_bytes)
    first = {host.data_ptr() for _, _, host in actor._params_off._saved}
    buf = actor._params_off._arena._chunks[0].data_ptr()
    assert all(buf <= ptr < buf + want for ptr in first)
    actor.onload()
    actor.offload()
    assert {host.data_ptr() for _, _, host in actor._params_off._saved} == first
    actor.onload()
    m = actor.train_step(make_batch(4, seed=1), ADV, replay)  # still trains after the round trip
    assert m["train/optimizer_steps"] == 2 and math.isfinite(m["train/loss"])


# ---------------------------------------------------------------- weight sync

def engine_params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in engine.transformer.named_parameters()}


def test_full_sync_matches_and_failures_roll_back(mesh):
    actor = build(mesh, "full", fsdp__fsdp_activation_checkpointing=True, **LIGHT)
    assert any("_checkpoint_wrapped_module" in n for n, _ in actor.model.named_parameters())
    # --fsdp-activation-checkpointing-every 2 reaches the build: of the 2 blocks only block 0 is wrapped
    every2 = build(mesh, "full", fsdp__fsdp_activation_checkpointing=True,
                   fsdp__fsdp_activation_checkpointing_every=2, **LIGHT)
    wrapped = {n.split("._checkpoint_wrapped_module")[0] for n, _ in every2.model.named_parameters()
               if "_checkpoint_wrapped_module" in n}
    assert wrapped == {"transformer_blocks.0"}, wrapped
    del every2
    engine = ReceiverEngine(tiny_transformer(seed=1))
    actor.train_step(make_batch(2), ADV[:2], replay)
    syncer = WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.05)
    m = syncer.sync(actor.model, engine)
    gathered = full_params(actor.model)
    ep = engine_params(engine)
    assert set(ep) == set(gathered) and all(torch.equal(ep[k], gathered[k]) for k in ep)
    assert engine.policy_version == syncer.policy_version == 1 and m["train/policy_version"] == 1
    assert m["train/weight_sync_tensors"] == len(gathered)
    b = make_batch(2, seed=3)
    with torch.no_grad():
        assert torch.equal(replay(engine.transformer, b), replay(actor.model, b))
    # a receiver that silently loses a tensor: caught by the checksum, version not committed
    lossy = ReceiverEngine(copy.deepcopy(engine.transformer), drop_one=True)
    lossy.policy_version = 1
    actor.train_step(make_batch(2, seed=1), ADV[:2], replay)
    with pytest.raises(WeightSyncError, match="checksum"):
        syncer.sync(actor.model, lossy)
    assert syncer.policy_version == 1 and lossy.policy_version == 1 and syncer.failures == 1
    # a receiver whose manifest check fails
    class Strict(ReceiverEngine):
        def update_weights_from_tensors(self, named, manifest):
            bad = WeightManifest(manifest.kind, manifest.tensor_count + 1, manifest.total_bytes,
                                 manifest.name_shape_hash, manifest.version)
            super().update_weights_from_tensors(named, bad)
    with pytest.raises(WeightSyncError, match="manifest"):
        syncer.sync(actor.model, Strict(copy.deepcopy(engine.transformer)))
    assert syncer.policy_version == 1 and syncer.failures == 2
    m2 = syncer.sync(actor.model, engine)  # a retry rebuilds version 2
    assert m2["train/policy_version"] == 2 and m2["train/weight_sync_failures"] == 2


def _reference_and_buckets(model, kind, wire, bucket_bytes):
    from trainer.weight_sync import iter_sync_buckets, iter_sync_tensors

    ref = [(n, t.clone()) for n, t in iter_sync_tensors(model, kind, wire_dtype=wire)]
    buckets = [[(n, t.clone()) for n, t in b]
               for b in iter_sync_buckets(model, kind, wire_dtype=wire, bucket_bytes=bucket_bytes)]
    return ref, buckets


def test_bucketed_sync_is_bit_identical_to_per_parameter_gather(mesh):
    """One rank: the buckets hand over the local tensors (no gather); names, order, dtypes and bits
    equal the per-parameter full_tensor() reference for full, merged and adapter kinds."""
    full = build(mesh, "full", **LIGHT)
    lora = build(mesh, "lora", fsdp__fsdp_master_dtype="fp32", **LIGHT)
    lora.train_step(make_batch(2), ADV[:2], replay)  # non-zero lora_B, so the merge is not the base
    for model, kind in ((full.model, "full"), (lora.model, "merged"), (lora.model, "adapter")):
        for wire in (None, torch.float32, torch.bfloat16):
            ref, buckets = _reference_and_buckets(model, kind, wire, 1_000 if kind == "adapter" else 20_000)
            flat = [pair for b in buckets for pair in b]
            assert len(buckets) > 2 and all(b for b in buckets)
            assert [n for n, _ in flat] == [n for n, _ in ref]
            assert all(t.dtype == r.dtype and torch.equal(t, r) for (_, t), (_, r) in zip(flat, ref)), (kind, wire)
    # world 1, same dtype: the full-sync tensors ARE the actor's local shards (no copy)
    from torch.distributed.tensor import DTensor
    from trainer.weight_sync import iter_sync_buckets

    locals_ = {local_shard(p).data_ptr() for p in full.model.parameters()}
    sent = [t for b in iter_sync_buckets(full.model, "full", wire_dtype=torch.float32, bucket_bytes=1 << 30)
            for _, t in b]
    assert sent and all(t.data_ptr() in locals_ for t in sent)


def test_lora_adapter_and_merge_sync(mesh):
    actor = build(mesh, "lora", fsdp__fsdp_master_dtype="fp32")
    actor.train_step(make_batch(4), ADV, replay)
    # adapter sync: only LoRA tensors move; the engine then samples like the actor
    engine = ReceiverEngine(tiny_transformer())
    ad = WeightSyncer("adapter", wire_dtype="fp32", lora_config=actor.lora_config, verify_checksum=False)
    m = ad.sync(actor.model, engine)
    n_lora = sum(1 for n, _ in actor.model.named_parameters() if ".lora_" in n)
    assert m["train/weight_sync_tensors"] == n_lora and engine.policy_version == 1
    b = make_batch(2, seed=3)
    with torch.no_grad():
        assert torch.allclose(replay(engine.transformer, b), replay(actor.model, b), rtol=0, atol=1e-6)
    # a full/merged sync into that LoRA-converted engine is an explicit error
    merge = WeightSyncer("merged", wire_dtype="fp32")
    with pytest.raises(WeightSyncError, match="LoRA"):
        merge.sync(actor.model, engine)
    assert merge.policy_version == 0 and merge.failures == 1
    # merged sync into a plain engine: base + B @ A * alpha / rank, exactly peft's merge
    plain = ReceiverEngine(tiny_transformer(seed=2))
    merge.sync(actor.model, plain)
    unsharded = tiny_transformer()
    from trainer.actor import apply_lora
    apply_lora(unsharded, LORA_TARGETS, 4, 8)
    gathered = {n: full_tensor(p) for n, p in actor.model.named_parameters()}
    unsharded.load_state_dict({n: gathered[n] for n, _ in unsharded.named_parameters()}, strict=False)
    ref = merged_state(unsharded)
    ep = engine_params(plain)
    assert set(ep) == set(ref) and all(torch.allclose(ep[k], ref[k], rtol=0, atol=1e-6) for k in ref)
    with pytest.raises(WeightSyncError, match="LoRA model"):
        WeightSyncer("full", wire_dtype="fp32").sync(actor.model, plain)


def test_bf16_master_fp32_and_wire_dtype(mesh):
    actor = Actor(tiny_transformer(dtype=torch.bfloat16), mesh,
                  make_cfg("full", fsdp__fsdp_param_dtype="bf16", fsdp__fsdp_master_dtype="fp32"),
                  device=torch.device("cpu"), adapter=ADAPTER)
    dtypes = {p.requires_grad: p.dtype for p in actor.model.parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    m = actor.train_step(make_batch(4), ADV, replay)
    assert m["train/optimizer_steps"] == 2
    engine = ReceiverEngine(tiny_transformer(dtype=torch.bfloat16))
    s = WeightSyncer("full", wire_dtype="bf16")
    s.sync(actor.model, engine)
    g = full_params(actor.model)
    assert all(torch.equal(p, g[n].to(torch.bfloat16)) for n, p in engine_params(engine).items())
    assert s.last_manifest.total_bytes == sum(t.numel() * 2 for t in g.values())


def test_nonfinite_valid_advantage_raises_but_invalid_is_ignored(mesh):
    actor = build(mesh, "full")
    adv = ADV.clone()
    adv[2] = float("nan")
    with pytest.raises(ValueError, match="non-finite advantage"):
        actor.train_step(make_batch(4), adv, replay)
    m = actor.train_step(make_batch(4), adv, replay, valid=torch.tensor([True, True, False, True]))
    assert m["train/optimizer_steps"] == 2 and math.isfinite(m["train/loss"])


def test_fsdp_cpu_offload_full_and_rejected_with_lora(mesh):
    actor = build(mesh, "full", fsdp__fsdp_cpu_offload=True, **LIGHT)
    assert actor.train_step(make_batch(2), ADV[:2], replay)["train/optimizer_steps"] == 1
    with pytest.raises(ValueError, match="fsdp-cpu-offload"):
        build(mesh, "lora", fsdp__fsdp_cpu_offload=True)
    with pytest.raises(ValueError, match="lora-dropout"):
        build(mesh, "lora", lora__lora_dropout=0.1)


def test_colocate_handover_order(mesh):
    from trainer.colocation import begin_update, end_update, sync_engine

    actor = build(mesh, "full", **LIGHT)
    engine = ReceiverEngine(tiny_transformer(seed=1))
    syncer = WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=64)
    actor.offload()  # before the first rollout
    begin_update(actor, engine, offload_train=True, offload_rollout=True)
    assert not actor.offloaded and engine.calls == ["release:all"]
    actor.train_step(make_batch(2), ADV[:2], replay)
    m = sync_engine(actor, syncer, engine, offload_rollout=True)
    assert not actor.offloaded  # still resident: a due checkpoint is written here
    m.update(end_update(actor, engine, offload_train=True, offload_rollout=True))
    assert engine.calls == ["release:all", "resume:weights", "update", "commit:1", "resume:all"]
    assert actor.offloaded and m["train/policy_version"] == 1 and m["perf/actor_offload_gb"] > 0
    begin_update(actor, engine, offload_train=True, offload_rollout=False)
    assert not actor.offloaded


# ---------------------------------------------------------------- the native engine's construction and DiT call

TINY_SAMPLING = {"height": 64, "width": 64, "num_inference_steps": 4, "eta": 0.7, "sde_type": "sde",
                 "sde_indices": [1, 2]}


def _rollout(engine, prompts, seed=5):
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    adapter, sampling = QwenImageAdapter(), parse_sampling_config(TINY_SAMPLING)
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    reqs = [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"{g}:{s}", sampling=sampling,
                                          sde_indices=list(sampling.sde_indices), sigmas=sigmas, generation_seed=seed)
            for g, p in enumerate(prompts) for s in range(2)]
    return engine.generate(reqs)


def _same_responses(a, b) -> bool:
    keys = ("images", "latents", "next_latents", "log_probs", "prompt_embeds", "prompt_embeds_mask")
    return len(a) == len(b) and all(torch.equal(getattr(a, k), getattr(b, k)) for k in keys)


def test_engine_from_modules_equals_loaded_engine_and_drops_an_all_ones_mask(tiny_model_dir):
    from trainer.engine.native import NativeEngine

    loaded = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    built = NativeEngine.from_modules(copy.deepcopy(loaded.transformer), copy.deepcopy(loaded.vae),
                                      copy.deepcopy(loaded.text_encoder), loaded.tokenizer,
                                      dict(loaded.scheduler_config), device="cpu", dtype=torch.float32)
    assert built.transformer is not loaded.transformer and built.dtype == torch.float32
    assert built.vae_scale_factor == loaded.vae_scale_factor and built.policy_version == 0

    seen: list = []
    forward = built.transformer.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("encoder_hidden_states_mask"))
        return forward(*args, **kwargs)

    built.transformer.forward = spy
    one = ["a red cube"]  # one prompt: every row of the chunk has all its tokens
    ref = _rollout(loaded, one)
    got = _rollout(built, one)
    assert seen and all(m is None for m in seen)  # the all-ones mask was not passed to the DiT
    # ... and the result is bit-identical to the engine that passed it (fp32): nothing changed
    with_mask = []

    def keep_mask(*args, **kwargs):
        if kwargs.get("encoder_hidden_states_mask") is None:
            b, t = kwargs["encoder_hidden_states"].shape[:2]
            kwargs["encoder_hidden_states_mask"] = torch.ones(b, t, dtype=torch.int64)
        with_mask.append(True)
        return forward(*args, **kwargs)

    assert _same_responses(ref, got)
    built.transformer.forward = keep_mask
    assert _same_responses(_rollout(built, one), got) and with_mask
    # prompts of different lengths keep their padding mask
    seen.clear()
    built.transformer.forward = spy
    _rollout(built, ["a red cube", "a considerably longer prompt about two cats on a sofa"])
    assert seen and all(m is not None and not bool(m.all()) for m in seen)
    built.transformer.forward = forward

    # the engine's cached weight index follows a LoRA injection; full syncs then stay refused
    syncer = WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.05)
    src = copy.deepcopy(loaded.transformer)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)
    syncer.sync(src, built)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), built.transformer.parameters()))
    assert built.get_weights_checksum() == weights_checksum(src.named_parameters())
    # wire fp32 into a bf16 engine: the sender checksums what the engine stores (engine.dtype)
    half = NativeEngine.from_modules(copy.deepcopy(loaded.transformer), copy.deepcopy(loaded.vae),
                                     copy.deepcopy(loaded.text_encoder),
                                     loaded.tokenizer, dict(loaded.scheduler_config), device="cpu",
                                     dtype=torch.bfloat16)
    WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.05).sync(src, half)
    assert half.policy_version == 1
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(src.parameters(), half.transformer.parameters()))
    from trainer.weight_sync import iter_sync_tensors

    lora_src = copy.deepcopy(loaded.transformer)
    from trainer.actor import apply_lora
    cfg = apply_lora(lora_src, LORA_TARGETS, 4, 8)
    named = list(iter_sync_tensors(lora_src, "adapter", wire_dtype=None))
    built.set_lora_tensors(named, build_manifest("adapter", named, 2), cfg)
    assert built.holds_lora()
    with pytest.raises(WeightSyncError, match="LoRA"):
        syncer.sync(src, built)


# ---------------------------------------------------------------- --old-logprob-source rollout

class _CountingReplay:
    """The tiny replay as a ReplayFn with .moments (the KL path), counting the no_grad calls of
    each: a no_grad __call__ is an anchor pass, a no_grad .moments the KL reference."""

    def __init__(self) -> None:
        self.calls = {"anchor": 0, "grad": 0, "reference": 0}

    def __call__(self, model, rows):
        self.calls["grad" if torch.is_grad_enabled() else "anchor"] += 1
        return replay(model, rows)

    def moments(self, model, rows):
        self.calls["grad" if torch.is_grad_enabled() else "reference"] += 1
        return replay_moments(model, rows)


def _recorded_batch(mesh, n: int, mode: str, over: dict):
    """A batch whose log_probs are what an fp32 eager sampler records: the replay of the
    untrained model, micro-batch by micro-batch at the update's own micro-batch size (so every
    row goes through the same kernels as the update's forward and is equal to the bit)."""
    batch = make_batch(n)
    mb = int(over.get("grpo__micro_batch_size", 1))
    with torch.no_grad():
        model = build(mesh, mode, **over).model
        batch.log_probs = torch.cat([replay(model, batch[s:s + mb]) for s in range(0, n, mb)]).float()
    return batch


@pytest.mark.parametrize("mode, over, valid", [
    # 2 updates x 2 micro-batches of 1
    ("full", {}, None),
    # micro-batches of 2 with an invalid row, LoRA, the KL to the reference on
    ("lora", {"grpo__micro_batch_size": 2, "fsdp__fsdp_master_dtype": "fp32", "grpo__use_kl_loss": True,
              "grpo__kl_coef": 0.04}, torch.tensor([True, False, True, True])),
])
def test_old_logprobs_from_rollout_equal_the_anchor_replay_bitwise_without_anchor_passes(mesh, mode, over, valid):
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = _recorded_batch(mesh, 4, mode, over)
    results = {}
    for source in ("replay", "rollout"):
        actor = build(mesh, mode, grpo__old_logprob_source=source, **over)
        fn = _CountingReplay()
        m = actor.train_step(batch, adv, fn, valid=valid)
        results[source] = (actor, fn.calls, m)
    (ref, ref_calls, ref_m), (new, new_calls, new_m) = results["replay"], results["rollout"]
    # the same updated weights, bit for bit
    p_ref, p_new = full_params(ref.model), full_params(new.model)
    assert all(torch.equal(p_ref[k], p_new[k]) for k in p_ref), [k for k in p_ref if not torch.equal(p_ref[k], p_new[k])]
    # the anchor replay ran for the second update only under replay, never under rollout; the
    # gradient passes and the KL reference passes are the same
    assert ref_calls["anchor"] == ref.last_anchor_passes == 4 // int(over.get("grpo__micro_batch_size", 1)) // 2
    assert new_calls["anchor"] == new.last_anchor_passes == 0
    assert new_calls["grad"] == ref_calls["grad"] and new_calls["reference"] == ref_calls["reference"]
    assert (new_calls["reference"] > 0) == bool(over.get("grpo__use_kl_loss"))
    # the first update's ratio is exactly 1, and the measured rollout-to-replay gap is 0
    first = new.last_update_stats[0]
    assert first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
    assert new_m.pop("train/rollout_logprob_gap_max") == 0.0 and "train/rollout_logprob_gap_max" not in ref_m
    timing = {"perf/train_time", "perf/train_transitions_per_s", "perf/train_samples_per_s"}
    assert {k: v for k, v in ref_m.items() if k not in timing} == {k: v for k, v in new_m.items() if k not in timing}


def test_old_logprobs_from_rollout_report_the_gap_and_refuse_the_guard(mesh):
    """Recorded log-probs off by a known amount (an inexact sampler): the gap is reported and the
    first update's ratio is exp(-offset), no longer 1; GRPO-Guard is refused in the actor too."""
    batch = _recorded_batch(mesh, 4, "full", {})
    batch.log_probs = batch.log_probs + 0.125
    actor = build(mesh, grpo__old_logprob_source="rollout", grpo__eps_clip=10.0)
    m = actor.train_step(batch, ADV, _CountingReplay())
    assert m["train/rollout_logprob_gap_max"] == pytest.approx(0.125, abs=1e-5)
    assert actor.last_update_stats[0]["ratio_max"].item() == pytest.approx(math.exp(-0.125), rel=1e-4)
    guarded = build(mesh, grpo__old_logprob_source="rollout", grpo__grpo_guard=True)
    with pytest.raises(ValueError, match="--old-logprob-source rollout with --grpo-guard"):
        guarded.train_step(batch, ADV, _CountingReplay())
