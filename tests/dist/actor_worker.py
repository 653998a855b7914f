"""torchrun worker (2 ranks, CPU, gloo) for tests/test_actor_dist.py.

Runs every multi-process actor check in ONE launch (a launch costs ~10 s) and writes
<out_dir>/rank<r>.json: {"checks": {name: bool}, "figures": {...}} or {"error": traceback}.
Usage: python -m torch.distributed.run --nproc-per-node 2 tests/dist/actor_worker.py OUT_DIR [TINY_MODEL_DIR
[ADAPTER_DOTPATH SAMPLING_JSON]]
(with TINY_MODEL_DIR, the Qwen-Image adapter + native engine checks run too; with an adapter
dotpath and a sampling config, ONLY those checks run, for that family's tiny model)
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
warnings.filterwarnings("ignore", message="FSDP2-wrapped module.*returned a view tensor")

import torch  # noqa: E402

from tests.dist.tiny import (ADAPTER, LORA_TARGETS, ReceiverEngine, full_params, make_batch, make_cfg, merged_state,  # noqa: E402
                             replay, tiny_transformer)
from trainer.actor import Actor, MicroBatchMismatchError, apply_lora, reshard_all  # noqa: E402
from trainer.core.names import model_name  # noqa: E402
from trainer.distributed import build_mesh, init_distributed, shutdown_and_exit  # noqa: E402
from trainer.engine.base import WeightManifest, WeightSyncError  # noqa: E402
from trainer.weight_sync import WeightSyncer  # noqa: E402

ADV = {0: torch.tensor([1.0, -1.0, 0.5, -0.5]), 1: torch.tensor([-0.3, 0.8, -1.2, 0.7])}


def exact(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


class BadManifest(ReceiverEngine):
    """Receives a manifest that promises one tensor more than arrives."""

    def update_weights_from_tensors(self, named, manifest):
        bad = WeightManifest(manifest.kind, manifest.tensor_count + 1, manifest.total_bytes,
                             manifest.name_shape_hash, manifest.version)
        super().update_weights_from_tensors(named, bad)


def full_checks(rank: int, mesh, checks: dict, figures: dict) -> None:
    cfg = make_cfg("full", fsdp__fsdp_activation_checkpointing=True)
    actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    before = full_params(actor.model)
    batch = make_batch(4, seed=10 + rank)
    m = actor.train_step(batch, ADV[rank], replay)
    after = full_params(actor.model)
    trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
    checks["full_every_trainable_changed"] = bool(trainable) and all(not torch.equal(before[n], after[n]) for n in trainable)
    checks["full_never_trained_frozen"] = bool(actor.never_trained) and all(
        torch.equal(before[n], after[n]) for n in actor.never_trained)
    first, second = actor.last_update_stats
    checks["first_update_ratio_exactly_1"] = first["ratio_max"].item() == 1.0 and first["ratio_min"].item() == 1.0
    checks["second_update_ratio_not_1"] = (second["ratio_max"].item(), second["ratio_min"].item()) != (1.0, 1.0)
    checks["two_updates_two_optimizer_steps"] = m["train/optimizer_steps"] == 2 and actor.optimizer_steps == 2
    figures["full_train"] = m

    engine = ReceiverEngine(tiny_transformer(seed=5))
    syncer = WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.05)
    sm = syncer.sync(actor.model, engine)
    g = full_params(actor.model)
    checks["full_sync_engine_matches_gathered"] = exact({n: p.detach() for n, p in engine.transformer.named_parameters()}, g)
    probe = make_batch(2, seed=99)
    with torch.no_grad():
        checks["full_sync_engine_forward_matches_actor"] = torch.equal(replay(engine.transformer, probe),
                                                                       replay(actor.model, probe))
    checks["full_sync_version_committed"] = engine.policy_version == syncer.policy_version == 1
    figures["full_sync"] = sm

    # a manifest mismatch raises on every rank and leaves the version where it was
    try:
        syncer.sync(actor.model, BadManifest(copy.deepcopy(engine.transformer)))
        checks["bad_manifest_raises"] = False
    except WeightSyncError:
        checks["bad_manifest_raises"] = True
    checks["bad_manifest_version_unchanged"] = syncer.policy_version == 1 and syncer.failures == 1

    # offload / onload round trip, bit exact, storage really freed
    optim_before = [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in s.items()}
                    for s in actor.optimizer.state.values()]
    om = actor.offload()
    checks["offload_frees_storage"] = all(p._local_tensor.untyped_storage().nbytes() == 0
                                          for p in actor.model.parameters())
    actor.onload()
    optim_after = [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in s.items()}
                   for s in actor.optimizer.state.values()]
    checks["offload_roundtrip_params_bit_exact"] = exact(g, full_params(actor.model))
    checks["offload_roundtrip_optimizer_bit_exact"] = len(optim_before) == len(optim_after) and all(
        exact(a, b) for a, b in zip(optim_before, optim_after))
    figures["offload"] = om

    # ranks that disagree on the micro-batch count raise instead of deadlocking
    try:
        n = 4 if rank == 0 else 6
        actor.train_step(make_batch(n, seed=3), torch.linspace(-1, 1, n), replay)
        checks["microbatch_mismatch_raises"] = False
    except MicroBatchMismatchError:
        checks["microbatch_mismatch_raises"] = True


def lora_checks(rank: int, mesh, checks: dict, figures: dict) -> None:
    cfg = make_cfg("lora", fsdp__fsdp_master_dtype="fp32", fsdp__no_fsdp_reshard_after_forward=True)
    actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
    before = full_params(actor.model)
    m = actor.train_step(make_batch(4, seed=20 + rank), ADV[rank], replay)
    after = full_params(actor.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    lora = {n for n in before if ".lora_" in n and n not in actor.never_trained}
    checks["lora_only_adapter_changed"] = bool(lora) and changed == lora
    figures["lora_train"] = m

    engine = ReceiverEngine(tiny_transformer())
    ad = WeightSyncer("adapter", wire_dtype="fp32", lora_config=actor.lora_config, verify_checksum=False)
    am = ad.sync(actor.model, engine)
    eng_lora = {n.replace(".default.", "."): p.detach() for n, p in engine.transformer.named_parameters() if ".lora_" in n}
    act_lora = {n.replace(".default.", "."): t for n, t in after.items() if ".lora_" in n}
    checks["adapter_sync_engine_matches_gathered"] = exact(eng_lora, act_lora)
    probe = make_batch(2, seed=98)
    with torch.no_grad():
        checks["adapter_sync_engine_forward_matches_actor"] = torch.allclose(
            replay(engine.transformer, probe), replay(actor.model, probe), rtol=0, atol=1e-6)
    figures["adapter_sync"] = am

    merge = WeightSyncer("merged", wire_dtype="fp32", bucket_size_mb=0.05)
    try:
        merge.sync(actor.model, engine)  # the engine now holds LoRA layers
        checks["full_sync_into_lora_engine_raises"] = False
    except WeightSyncError:
        checks["full_sync_into_lora_engine_raises"] = True
    checks["full_sync_into_lora_engine_version_unchanged"] = merge.policy_version == 0 and engine.policy_version == 1

    plain = ReceiverEngine(tiny_transformer(seed=7))
    mm = merge.sync(actor.model, plain)
    ref_model = tiny_transformer()
    apply_lora(ref_model, LORA_TARGETS, actor.lora_config["rank"], actor.lora_config["alpha"])
    ref_model.load_state_dict({n: after[model_name(n)] for n, _ in ref_model.named_parameters()})
    ref = merged_state(ref_model)
    got = {n: p.detach() for n, p in plain.transformer.named_parameters()}
    checks["merge_sync_engine_matches_merged"] = set(got) == set(ref) and all(
        torch.allclose(got[k], ref[k], rtol=0, atol=1e-6) for k in ref)
    with torch.no_grad():
        checks["merge_sync_engine_forward_matches_actor"] = torch.allclose(
            replay(plain.transformer, probe), replay(actor.model, probe), rtol=0, atol=1e-5)
    figures["merge_sync"] = mm
    bucket_checks(actor.model, plain, mesh, checks)


def frozen_placement_checks(rank: int, mesh, checks: dict) -> None:
    """--fsdp-frozen-params replicate on 2 ranks: the frozen base whole on each rank, outside
    FSDP2, and the update bit for bit the sharded one's (auto shards on several ranks)."""
    from torch.distributed.tensor import DTensor

    trained = {}
    for placement in ("auto", "replicate"):
        cfg = make_cfg("lora", fsdp__fsdp_master_dtype="fp32", fsdp__fsdp_frozen_params=placement)
        actor = Actor(tiny_transformer(), mesh, cfg, device=torch.device("cpu"), adapter=ADAPTER)
        frozen = [p for p in actor.model.parameters() if not p.requires_grad]
        plain = [not isinstance(p, DTensor) for p in frozen]
        checks[f"frozen_{placement}_placement"] = all(plain) if placement == "replicate" else not any(plain)
        actor.train_step(make_batch(4, seed=30 + rank), ADV[rank], replay)
        trained[placement] = full_params(actor.model)
    checks["replicated_frozen_update_bit_identical_to_sharded"] = exact(trained["auto"], trained["replicate"])


def _reference(model, kind, wire):
    """The per-parameter reference: one DTensor.full_tensor() per parameter (iter_sync_tensors)."""
    from trainer.weight_sync import iter_sync_tensors

    return [(n, t.clone()) for n, t in iter_sync_tensors(model, kind, wire_dtype=wire)]


def _identical(a, b) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def bucket_checks(lora_model, plain: ReceiverEngine, mesh, checks: dict) -> None:
    """The bucketed all-gather path (2 ranks) hands over exactly the per-parameter full_tensor()
    values, names and order, for every kind and wire dtype, and the engine ends up with those bits."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from trainer.weight_sync import gather_full_tensors, iter_sync_buckets

    full_model = Actor(tiny_transformer(seed=3), mesh, make_cfg("full"),
                       device=torch.device("cpu"), adapter=ADAPTER).model
    from trainer.weight_sync import _shard0_rows

    reshard_all(lora_model)
    # every parameter takes the grouped all-gather path (none falls back to full_tensor())
    checks["bucketed_path_gathers_every_param"] = all(
        _shard0_rows(p) is not None for m in (full_model, lora_model) for p in m.parameters())
    for model, kind in ((full_model, "full"), (lora_model, "merged"), (lora_model, "adapter")):
        ok = True
        for wire in (None, torch.float32, torch.bfloat16):
            ref = _reference(model, kind, wire)
            buckets = [[(n, t.clone()) for n, t in b] for b in iter_sync_buckets(
                model, kind, wire_dtype=wire, bucket_bytes=1_000 if kind == "adapter" else 20_000)]
            ok = ok and len(buckets) > 2 and _identical([p for b in buckets for p in b], ref)
        checks[f"bucketed_{kind}_bit_identical_to_full_tensor"] = ok
    # what the engine holds after a merged sync is bit-identical to the per-parameter merge
    ref = dict(_reference(lora_model, "merged", torch.float32))
    got = {n: p.detach() for n, p in plain.transformer.named_parameters()}
    checks["merged_sync_engine_bit_identical"] = set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    eng = ReceiverEngine(tiny_transformer(seed=9))
    WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=0.02).sync(full_model, eng)
    ref = dict(_reference(full_model, "full", torch.float32))
    got = {n: p.detach() for n, p in eng.transformer.named_parameters()}
    checks["full_sync_engine_bit_identical"] = set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    # uneven shards (5 rows over 2 ranks: 3 + 2) and a cast on the way
    torch.manual_seed(1)
    odd = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 7))
    fully_shard(odd, mesh=mesh)
    params = [p for p in odd.parameters()]
    ok = True
    for wire in (None, torch.bfloat16):
        got = gather_full_tensors(params, [wire] * len(params))
        want = [p.full_tensor() if wire is None else p.full_tensor().to(wire) for p in params]
        ok = ok and all(g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
    checks["gather_uneven_shards_exact"] = ok


SAMPLING = {"height": 64, "width": 64, "num_inference_steps": 6, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 3]}


def real_model_checks(rank: int, mesh, model_dir: str, checks: dict, figures: dict, adapter=None,
                      sampling_dict: dict | None = None) -> None:
    """A family's adapter (default Qwen-Image) + native engine on its tiny pipeline: rollout ->
    replay parity -> update -> sync -> the engine's DiT is the actor's gathered weights, and it
    samples with them."""
    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.sampling import parse_sampling_config

    adapter = adapter or QwenImageAdapter()
    sampling = parse_sampling_config(sampling_dict or SAMPLING)
    engine = NativeEngine(model_dir, device="cpu", dtype=torch.float32, adapter=adapter)
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)

    def rollout(eng, seed):
        reqs = [adapter.build_rollout_request(p, group_index=2 * rank + g, slot=s, sample_id=f"r{rank}:{g}:{s}",
                                              sampling=sampling, sde_indices=list(sampling.sde_indices),
                                              sigmas=sigmas, generation_seed=seed)
                for g, p in enumerate(["a red cube", "two cats on a sofa"]) for s in range(2)]
        return eng.generate(reqs)

    def replay_fn(model, rows):
        return torch.stack([adapter.replay_transition(model, rows, c)
                            for c in range(rows.num_steps)], dim=1)

    batch = rollout(engine, 11)
    adv = ADV[rank]
    cfg = make_cfg("full")
    actor = Actor.from_adapter(adapter, model_dir, mesh, cfg, device=torch.device("cpu"))
    with torch.no_grad():
        anchor = replay_fn(actor.model, batch)
    figures["real_replay_vs_sampler_max_abs"] = float((anchor - batch.log_probs).abs().max())
    checks["real_replay_matches_sampler_logprob"] = figures["real_replay_vs_sampler_max_abs"] <= 1e-5
    before = full_params(actor.model)
    m = actor.train_step(batch, adv, replay_fn)  # default slicing, as trainer/loop.py
    after = full_params(actor.model)
    trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
    checks["real_full_every_trainable_changed"] = all(not torch.equal(before[n], after[n]) for n in trainable)
    checks["real_first_update_ratio_exactly_1"] = actor.last_update_stats[0]["ratio_max"].item() == 1.0 == \
        actor.last_update_stats[0]["ratio_min"].item()
    figures["real_full_train"] = m
    syncer = WeightSyncer("full", wire_dtype="fp32", bucket_size_mb=1, name_map=adapter.weight_name_map)
    figures["real_full_sync"] = syncer.sync(actor.model, engine)
    dit = {n: p.detach() for n, p in engine.transformer.named_parameters()}
    checks["real_full_sync_engine_dit_matches_gathered"] = exact(dit, after)
    again = rollout(engine, 11)
    checks["real_engine_samples_new_version"] = bool((again.policy_versions == 1).all()) and not torch.equal(
        again.images[0], batch.images[0])
    with torch.no_grad():
        checks["real_replay_after_sync_matches_sampler"] = float(
            (replay_fn(actor.model, again) - again.log_probs).abs().max()) <= 1e-5

    # LoRA: adapter sync into a fresh engine, then a merged sync into it must be refused by both sides
    lcfg = make_cfg("lora", fsdp__fsdp_master_dtype="fp32")
    lactor = Actor.from_adapter(adapter, model_dir, mesh, lcfg, device=torch.device("cpu"))
    lactor.train_step(batch, adv, replay_fn)
    leng = NativeEngine(model_dir, device="cpu", dtype=torch.float32, adapter=adapter)
    WeightSyncer("adapter", wire_dtype="fp32", lora_config=lactor.lora_config,
                 name_map=adapter.weight_name_map).sync(lactor.model, leng)
    lg = full_params(lactor.model)
    eng_lora = {n.replace(".default.", "."): p.detach() for n, p in leng.transformer.named_parameters() if ".lora_" in n}
    checks["real_adapter_sync_engine_matches"] = exact(eng_lora, {n.replace(".default.", "."): t for n, t in lg.items()
                                                                  if ".lora_" in n})
    merged = WeightSyncer("merged", wire_dtype="fp32", name_map=adapter.weight_name_map)
    try:
        merged.sync(lactor.model, leng)
        checks["real_merged_sync_into_lora_engine_raises"] = False
    except WeightSyncError:
        checks["real_merged_sync_into_lora_engine_raises"] = leng.policy_version == 1
    # merged sync into the (LoRA-free) engine of the full run: its DiT becomes base + B @ A * alpha / rank
    ref_model = adapter.load_train_model(model_dir, dtype=torch.float32)
    apply_lora(ref_model, adapter.lora_target_modules, lactor.lora_config["rank"], lactor.lora_config["alpha"])
    # parameters only: the model's own buffers (SD3's persistent pos_embed table) stay as loaded
    missing, unexpected = ref_model.load_state_dict({n: lg[model_name(n)] for n, _ in ref_model.named_parameters()},
                                                    strict=False)
    assert not unexpected and set(missing) <= {n for n, _ in ref_model.named_buffers()}, (missing, unexpected)
    ref = merged_state(ref_model)
    merged.policy_version = engine.policy_version
    merged.sync(lactor.model, engine)
    dit = {n: p.detach() for n, p in engine.transformer.named_parameters()}
    checks["real_merged_sync_engine_matches"] = set(dit) == set(ref) and all(
        torch.allclose(dit[k], ref[k], rtol=0, atol=1e-6) for k in ref) and engine.policy_version == 2


def wave_checks(rank: int, checks: dict) -> None:
    """--fsdp-load-wave-size 1 on 2 ranks: rank 1 starts loading only after rank 0 finished."""
    import time

    import torch.distributed as dist

    from trainer.actor import load_in_waves

    def load():
        t0 = time.time()
        time.sleep(0.3)
        return torch.tensor([t0, time.time()], dtype=torch.float64)

    span = load_in_waves(load, 1)
    spans = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(spans, span)
    checks["load_waves_sequential"] = bool(spans[1][0] >= spans[0][1])


def main() -> None:
    out_dir = sys.argv[1]
    model_dir = sys.argv[2] if len(sys.argv) > 2 else None
    family = sys.argv[3:5] if len(sys.argv) > 4 else None  # [adapter dotpath, sampling JSON]
    info = init_distributed("cpu")
    result: dict = {"rank": info.rank, "world_size": info.world_size, "checks": {}, "figures": {}}
    code = 0
    try:
        mesh = build_mesh("cpu")
        if family:
            from trainer.dotpath import import_dotpath

            real_model_checks(info.rank, mesh, model_dir, result["checks"], result["figures"],
                              adapter=import_dotpath(family[0], "adapter")(), sampling_dict=json.loads(family[1]))
        else:
            full_checks(info.rank, mesh, result["checks"], result["figures"])
            lora_checks(info.rank, mesh, result["checks"], result["figures"])
            frozen_placement_checks(info.rank, mesh, result["checks"])
            wave_checks(info.rank, result["checks"])
            if model_dir:
                real_model_checks(info.rank, mesh, model_dir, result["checks"], result["figures"])
    except Exception:
        result["error"] = traceback.format_exc()
        code = 1
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
