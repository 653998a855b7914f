"""The native engine on the tiny model (CPU, fp32): replay parity, batching, weights, memory."""

from __future__ import annotations

import pytest
import torch

from trainer.engine.base import RolloutEngine, WeightSyncError
from trainer.engine.native import NativeEngine
from trainer.models.qwen_image import QwenImageAdapter, dit_velocity, img_shapes_for
from trainer.sampling import parse_sampling_config
from trainer.core.checksum import weights_checksum
from trainer.core.manifest import build_manifest

SAMPLING = {"height": 64, "width": 64, "num_inference_steps": 6, "eta": 0.7, "sde_type": "sde",
            "sde_indices": [1, 2, 4]}
PROMPTS = ["a cat", "a considerably longer prompt about a red panda drinking tea", "dog"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=8)


@pytest.fixture(scope="module")
def adapter():
    return QwenImageAdapter()


@pytest.fixture(scope="module")
def sampling():
    return parse_sampling_config(SAMPLING)


def make_requests(adapter, engine, sampling, prompts=PROMPTS, group_size=2, seed=7):
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    return [
        adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"prompt:{g}:sample:{s}", sampling=sampling,
                                      sde_indices=list(sampling.sde_indices), sigmas=sigmas, generation_seed=seed)
        for g, p in enumerate(prompts) for s in range(group_size)
    ]


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)


def test_response_contents(engine, adapter, sampling):
    traj = engine.generate(make_requests(adapter, engine, sampling))
    assert len(traj) == 6
    adapter.validate_trajectory(traj)
    assert traj.images.shape == (6, 3, 64, 64) and traj.images.dtype == torch.float32
    assert traj.images.device.type == "cpu" and 0.0 <= traj.images.min() and traj.images.max() <= 1.0
    # 64 px / vae factor 4 / patch 2 -> 8 x 8 tokens of 4 * 4 channels
    assert traj.latents.shape == (6, 3, 64, 16) and traj.latents.dtype == torch.float32
    assert traj.log_probs.dtype == torch.float32 and torch.isfinite(traj.log_probs).all()
    assert traj.sde_indices == [1, 2, 4]
    sig = engine.sigma_schedule(64, 64, 6)
    assert traj.sigmas[0].tolist() == pytest.approx([sig[1], sig[2], sig[4]], abs=0)
    assert traj.sigmas_next[0].tolist() == pytest.approx([sig[2], sig[3], sig[5]], abs=0)
    assert traj.timesteps[0].tolist() == pytest.approx([1000 * s for s in traj.sigmas[0].tolist()], rel=1e-6)
    # the recorded "after" of trained step 1 is not the "before" of trained step 2 only because
    # there is nothing in between: steps 1 and 2 are adjacent, so they must chain exactly
    assert torch.equal(traj.next_latents[0, 0], traj.latents[0, 1])
    # candidates of one prompt differ (distinct sample ids), their conditioning is shared
    assert not torch.equal(traj.images[0], traj.images[1])
    assert torch.equal(traj.prompt_embeds[0], traj.prompt_embeds[1])
    mask = traj.prompt_embeds_mask
    assert mask[2].sum() > mask[0].sum() and mask[0, int(mask[0].sum()):].sum() == 0  # padded after its tokens
    assert traj.sample_ids == [f"prompt:{g}:sample:{s}" for g in range(3) for s in range(2)]
    assert traj.height == 64 and traj.width == 64 and (traj.policy_versions == engine.policy_version).all()


def test_replay_reproduces_engine_logprob(engine, adapter, sampling, tiny_model_dir):
    """Replay through a separately loaded actor transformer at the same weights == sampler log-prob."""
    batch = engine.generate(make_requests(adapter, engine, sampling))
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for col in range(batch.num_steps):
            full = adapter.replay_transition(actor, batch, col)
            assert full.dtype == torch.float32 and full.shape == (6,)
            torch.testing.assert_close(full, batch.log_probs[:, col], atol=1e-5, rtol=0)
            # micro-batches of 1 and of an uneven split reproduce it too
            parts = [adapter.replay_transition(actor, batch[idx], col)
                     for idx in ([0], [1, 2, 3], slice(4, 6))]
            torch.testing.assert_close(torch.cat(parts), batch.log_probs[:, col], atol=1e-5, rtol=0)


def test_replay_all_columns_in_one_forward(engine, adapter, sampling, tiny_model_dir):
    """replay_transitions (all trained columns in one forward of B*S rows) == the per-column
    replay == the sampler's log-probs; gradients agree with the per-column replay; the loop's
    replay_fn takes that path."""
    from trainer.loop import make_replay_fn

    batch = engine.generate(make_requests(adapter, engine, sampling))
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    n_cols = batch.num_steps
    assert n_cols >= 2
    one = adapter.replay_transitions(actor, batch)
    per_col = torch.stack([adapter.replay_transition(actor, batch, c) for c in range(n_cols)], 1)
    assert one.shape == (6, n_cols) and one.dtype == torch.float32
    torch.testing.assert_close(one.detach(), per_col.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(one.detach(), batch.log_probs, atol=1e-5, rtol=0)
    # a weighted loss gives the same gradient through either path
    w = torch.linspace(0.5, 2.0, one.numel()).view_as(one)
    (one * w).sum().backward()
    g_one = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad(set_to_none=True)
    (per_col * w).sum().backward()
    for n, p in actor.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(g_one[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
    # and a micro-batch slice through the loop's replay_fn (which uses it) still matches
    with torch.no_grad():
        rows = batch[[1, 2, 3]]
        torch.testing.assert_close(make_replay_fn(adapter)(actor, rows),
                                   make_replay_fn(adapter, one_forward=False)(actor, rows), atol=1e-6, rtol=0)


def test_a_sidecar_replays_with_its_own_recipe_whatever_the_run_says(engine, adapter, tiny_model_dir, tmp_path):
    """The trajectory carries the sampler settings that produced it: a sidecar written under one
    recipe (eta 0.5, "dance", sigma_max 0.9) replays to the sampler's log-probs through the
    loop's replay while the run's recipe in memory says something else (eta 0.9, "sde",
    sigma_max 0.99). Replayed under that recipe instead, the log-probs would be far off."""
    import dataclasses

    from trainer import artifacts
    from trainer.loop import make_replay_fn
    from trainer.trajectory import SamplerSettings

    written = parse_sampling_config({**SAMPLING, "eta": 0.5, "sde_type": "dance", "sigma_max": 0.9})
    in_memory = parse_sampling_config({**SAMPLING, "eta": 0.9, "sde_type": "sde", "sigma_max": 0.99})
    batch = engine.generate(make_requests(adapter, engine, written, prompts=PROMPTS[:1]))
    path = artifacts.write_group_sidecar(tmp_path / "g.safetensors", batch, task="t2i", rollout_id=0,
                                         sampling=written)
    back = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(path))
    assert (back.eta, back.sde_type, back.sigma_max) == (0.5, "dance", 0.9)
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    replay_fn = make_replay_fn(adapter)  # what the loop builds: no recipe in it
    with torch.no_grad():
        torch.testing.assert_close(replay_fn(actor, back), batch.log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(replay_fn.moments(actor, back).logp, batch.log_probs, atol=1e-5, rtol=0)
        recipe = SamplerSettings(in_memory.num_inference_steps, in_memory.eta, in_memory.sde_type,
                                 in_memory.sigma_max)
        misread = replay_fn(actor, dataclasses.replace(back, sampler=recipe))
    assert (misread - batch.log_probs).abs().max() > 100 * 1e-5


def test_replay_through_peft_wrapped_transformer(engine, adapter, sampling, tiny_model_dir):
    """A freshly injected LoRA (B = 0) leaves the function unchanged: replay still matches."""
    from peft import LoraConfig

    batch = engine.generate(make_requests(adapter, engine, sampling, prompts=PROMPTS[:2]))
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    actor.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(adapter.lora_target_modules)))
    logp = adapter.replay_transition(actor, batch, 1)
    torch.testing.assert_close(logp.detach(), batch.log_probs[:, 1], atol=1e-5, rtol=0)
    logp.sum().backward()  # differentiable through the adapter
    # lora_B gets a gradient everywhere except the last block's text queries and text output
    # projection, whose text-stream outputs Qwen-Image discards
    grads = {n: p.grad for n, p in actor.named_parameters() if "lora_B" in n}
    unused = {n for n in grads if n.startswith(("transformer_blocks.1.attn.to_add_out.",
                                                "transformer_blocks.1.attn.add_q_proj."))}
    assert len(unused) == 2 and all(grads[n] is None or grads[n].abs().sum() == 0 for n in unused)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n not in unused)


def test_candidate_alone_equals_candidate_in_mixed_batch(tiny_model_dir, adapter, sampling):
    """Same candidate alone (batch 1) and inside a batch of 6 with prompts of 3 different text
    lengths: identical noise, trajectories equal to fp32 GEMM rounding (not bit-exact on MKL)."""
    alone_engine = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=1)
    batch_engine = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32, max_batch_size=8)
    reqs = make_requests(adapter, alone_engine, sampling)
    target = 3  # prompt 1 (the long one), slot 1
    alone = alone_engine.generate([reqs[target]])
    mixed = batch_engine.generate(list(reversed(reqs)))[len(reqs) - 1 - target]
    assert mixed.sample_ids == alone.sample_ids
    assert batch_engine.last_stats["dit_forwards"] == sampling.num_inference_steps  # one chunk of 6
    # the generation's split: each part timed, together no more than the whole call
    for eng in (alone_engine, batch_engine):
        split = [eng.last_stats[k] for k in ("encode_time", "denoise_time", "decode_time")]
        assert all(t > 0 for t in split) and sum(split) <= eng.last_stats["generate_time"], eng.last_stats
    diffs = {k: (getattr(alone, k).float() - getattr(mixed, k).float()).abs().max().item()
             for k in ("latents", "next_latents", "log_probs", "images")}
    assert diffs["latents"] <= 1e-5, diffs
    assert diffs["next_latents"] <= 1e-5, diffs
    assert diffs["log_probs"] <= 1e-5, diffs
    assert diffs["images"] <= 1e-4, diffs
    # and the same call twice is bit-identical
    again = batch_engine.generate(list(reversed(reqs)))[len(reqs) - 1 - target]
    assert torch.equal(again.next_latents, mixed.next_latents)
    assert torch.equal(again.images, mixed.images)


def test_prompts_encoded_once_and_batched(engine, adapter, sampling, monkeypatch):
    """A rollout's distinct prompts go through the text encoder once, in one call, and each
    comes back as encode_prompt gives it alone (cut to its own length, values up to summation
    order); the candidates are denoised in max_batch_size chunks."""
    calls = []
    original = engine.prompt_encoder
    monkeypatch.setattr(engine, "prompt_encoder", lambda prompts, *a: calls.append(list(prompts)) or original(prompts, *a))
    sizes = []
    handle = engine.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        engine.max_batch_size = 4
        engine.generate(make_requests(adapter, engine, sampling, group_size=3))  # 9 candidates
    finally:
        handle.remove()
        engine.max_batch_size = 8
    assert len(calls) == 1 and sorted(calls[0]) == sorted(PROMPTS)
    n = sampling.num_inference_steps
    assert sorted(sizes) == sorted([4] * n + [4] * n + [1] * n)
    together = engine.encode_prompts(PROMPTS)
    lengths = set()
    for prompt in PROMPTS:
        alone = original([prompt], engine.device, engine.max_sequence_length)
        got = together[prompt]
        assert got["prompt_embeds"].shape == alone["prompt_embeds"][0].shape
        assert torch.equal(got["prompt_embeds_mask"], alone["prompt_embeds_mask"][0])
        torch.testing.assert_close(got["prompt_embeds"], alone["prompt_embeds"][0].to(engine.dtype))
        lengths.add(got["prompt_embeds"].shape[0])
    assert len(lengths) > 1  # the prompts differ in length: the batch was padded, and cut back


def test_cfg_and_empty_trained_steps_fail_clearly(engine, adapter, sampling):
    sigmas = engine.sigma_schedule(64, 64, 6)
    kwargs = dict(group_index=0, slot=0, sample_id="s", sigmas=sigmas, generation_seed=1)
    cfg = parse_sampling_config(SAMPLING)
    cfg.guidance_scale = 0.5  # bypasses the parser on purpose: the adapter must still refuse
    with pytest.raises(ValueError, match="guidance_scale is 0.5, but must be a number >= 1.0"):
        adapter.build_rollout_request("p", sampling=cfg, sde_indices=[1], **kwargs)
    with pytest.raises(ValueError, match="trained SDE step set is empty"):
        adapter.build_rollout_request("p", sampling=sampling, sde_indices=[], **kwargs)
    with pytest.raises(ValueError, match="step 0 under sde_type 'sde'"):
        adapter.build_rollout_request("p", sampling=sampling, sde_indices=[0, 2], **kwargs)
    req = adapter.build_rollout_request("p", sampling=sampling, sde_indices=[1], **kwargs)
    req.guidance_scale = 0.5
    with pytest.raises(ValueError, match="guidance_scale"):
        engine.generate([req])
    req.guidance_scale, req.sde_indices = 1.0, []
    with pytest.raises(ValueError, match="empty sde_indices"):
        engine.generate([req])


@pytest.mark.parametrize("renorm", [True, False])
def test_true_cfg_rollout_replays_to_the_sampler_logprob(engine, adapter, tiny_model_dir, tmp_path, renorm):
    """guidance_scale 4: both rows of a candidate in one forward; the trajectory carries the
    negative prompt's conditioning; the replay (per column, all columns, a sidecar round trip)
    reproduces the sampler's log-prob, and gradients flow; the guidance changes the policy."""
    import dataclasses

    from trainer import artifacts

    cfg = parse_sampling_config({**SAMPLING, "guidance_scale": 4.0, "cfg_renorm": renorm})
    sizes = []
    handle = engine.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: sizes.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        batch = engine.generate(make_requests(adapter, engine, cfg, prompts=PROMPTS[:2]))
    finally:
        handle.remove()
    assert sizes == [8] * cfg.num_inference_steps  # 4 candidates, conditional + unconditional rows, one forward
    assert batch.guided and batch.negative_prompt == " " and batch.cfg_renorm is renorm
    neg = batch.conditions["negative_prompt_embeds"]
    assert neg.shape[0] == 4 and torch.equal(neg[0], neg[3])  # one negative prompt, encoded once
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    one = adapter.replay_transitions(actor, batch)
    torch.testing.assert_close(one.detach(), batch.log_probs, atol=1e-5, rtol=0)
    with torch.no_grad():
        per_col = torch.stack([adapter.replay_transition(actor, batch, c) for c in range(batch.num_steps)], 1)
        torch.testing.assert_close(per_col, batch.log_probs, atol=1e-5, rtol=0)
        # the replay uses the guidance the trajectory was sampled at: without it, another policy
        unguided = adapter.replay_transitions(actor, dataclasses.replace(
            batch, sampler=dataclasses.replace(batch.sampler, guidance_scale=1.0)))
        assert (unguided - batch.log_probs).abs().max() > 10 * 1e-5  # well above the replay tolerance
    one.sum().backward()
    assert sum(float(p.grad.abs().sum()) for p in actor.parameters() if p.grad is not None) > 0
    path = artifacts.write_group_sidecar(tmp_path / "g.safetensors", batch[batch.rows_of_group(1)], task="t2i",
                                         rollout_id=0, sampling=cfg)
    back = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(path))
    assert (back.guidance_scale, back.negative_prompt, back.cfg_renorm) == (4.0, " ", renorm)
    with torch.no_grad():
        torch.testing.assert_close(adapter.replay_transitions(actor, back), batch.log_probs[2:], atol=1e-5,
                                   rtol=0)


def test_validate_trajectory_names_the_bad_field(engine, adapter, sampling):
    import dataclasses

    traj = engine.generate(make_requests(adapter, engine, sampling, prompts=["x"], group_size=2))
    adapter.validate_trajectory(traj)
    broken = {"latents": traj.latents[:, :2], "timesteps": traj.timesteps[:1], "sde_indices": [],
              "geometry": dataclasses.replace(traj.geometry, height=32), "prompts": ["only one"]}
    for key, value in broken.items():
        with pytest.raises(ValueError, match=key if key != "geometry" else "height x width"):
            adapter.validate_trajectory(dataclasses.replace(traj, **{key: value}))
    with pytest.raises(ValueError, match="prompt_embeds_mask"):
        adapter.validate_trajectory(dataclasses.replace(traj, conditions={"prompt_embeds": traj.prompt_embeds}))


def test_one_generate_call_samples_one_geometry(engine, adapter, sampling):
    other = parse_sampling_config({**SAMPLING, "sde_indices": [1, 3]})
    reqs = make_requests(adapter, engine, sampling, prompts=["x"], group_size=1) + \
        make_requests(adapter, engine, other, prompts=["y"], group_size=1)
    with pytest.raises(ValueError, match="differ in geometry.*once per geometry"):
        engine.generate(reqs)


def _dit_out(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 64, 16, generator=g)
    emb = torch.randn(2, 5, 16, generator=g)
    with torch.no_grad():
        return dit_velocity(model, x, torch.tensor([700.0, 300.0]), emb, torch.ones(2, 5, dtype=torch.long),
                            img_shapes_for(2, 64, 64, 4))


def lora_actor(adapter, model_dir, rank: int, alpha: float):
    """The tiny actor transformer with a peft LoRA on the adapter's targets and lora_B ~ N(0, 0.1),
    so the adapter changes the function."""
    from peft import LoraConfig

    actor = adapter.load_train_model(str(model_dir), dtype=torch.float32)
    actor.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(adapter.lora_target_modules)))
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return actor


def test_full_weight_sync(tiny_model_dir, adapter):
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.01 * torch.randn_like(p))
    named = [(n, p.detach().clone()) for n, p in actor.named_parameters()]
    before = eng.get_weights_checksum()
    assert not torch.equal(_dit_out(eng.transformer), _dit_out(actor))

    # a bad name, a bad shape or a manifest mismatch raises and copies nothing
    bad_name = named[:3] + [("transformer_blocks.0.attn.nonexistent.weight", named[3][1])]
    with pytest.raises(WeightSyncError, match="does not have"):
        eng.update_weights_from_tensors(bad_name, build_manifest("full", bad_name, 1))
    bad_shape = named[:3] + [(named[3][0], torch.zeros(3, 3))]
    with pytest.raises(WeightSyncError, match="shape mismatch"):
        eng.update_weights_from_tensors(bad_shape, build_manifest("full", bad_shape, 1))
    manifest = build_manifest("full", named, 1)
    manifest.tensor_count += 1
    with pytest.raises(WeightSyncError, match="manifest"):
        eng.update_weights_from_tensors(named, manifest)
    assert eng.get_weights_checksum() == before

    # in two buckets, as weight_sync sends them
    half = len(named) // 2
    for bucket in (named[:half], named[half:]):
        eng.update_weights_from_tensors(bucket, build_manifest("full", bucket, 1))
    assert eng.get_weights_checksum() == weights_checksum(named) != before
    assert torch.equal(_dit_out(eng.transformer), _dit_out(actor))
    assert eng.policy_version == 0
    eng.commit_weight_version(1)
    assert eng.policy_version == 1


def test_lora_tensors(tiny_model_dir, adapter, sampling):
    from trainer.weight_sync import iter_sync_tensors

    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    actor = lora_actor(adapter, tiny_model_dir, rank=4, alpha=8)
    lora_cfg = {"rank": 4, "alpha": 8, "target_modules": list(adapter.lora_target_modules)}
    named = list(iter_sync_tensors(actor, "adapter", wire_dtype=None))
    assert named and all(".lora_" in n and ".default." not in n for n, _ in named)
    assert not eng.holds_lora()
    eng.set_lora_tensors(named, build_manifest("adapter", named, 1), lora_cfg)
    assert eng.holds_lora()
    assert torch.equal(_dit_out(eng.transformer), _dit_out(actor))

    # replace: new values land, missing tensors / another config / a full sync are refused
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.mul_(-1)
    named2 = list(iter_sync_tensors(actor, "adapter", wire_dtype=None))
    eng.set_lora_tensors(named2, build_manifest("adapter", named2, 2), lora_cfg)
    assert torch.equal(_dit_out(eng.transformer), _dit_out(actor))
    with pytest.raises(WeightSyncError, match="lacks"):
        eng.set_lora_tensors(named2[1:], build_manifest("adapter", named2[1:], 3), lora_cfg)
    with pytest.raises(WeightSyncError, match="differs"):
        eng.set_lora_tensors(named2, build_manifest("adapter", named2, 3), {**lora_cfg, "rank": 8})
    base = [(n, p.detach()) for n, p in adapter.load_train_model(str(tiny_model_dir)).named_parameters()]
    with pytest.raises(WeightSyncError, match="holds LoRA layers"):
        eng.update_weights_from_tensors(base, build_manifest("full", base, 3))
    # and it samples with the adapter
    out = eng.generate(make_requests(adapter, eng, sampling, prompts=["x"], group_size=1))
    assert torch.isfinite(out.log_probs).all()


def test_release_and_resume_memory_on_cpu(tiny_model_dir, adapter, sampling):
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    reqs = make_requests(adapter, eng, sampling, prompts=["x"], group_size=1)
    eng.release_memory()
    assert eng.memory_state() == {"transformer": False, "text_encoder": False, "vae": False}
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate(reqs)
    eng.resume_memory(("weights",))
    assert eng.memory_state() == {"transformer": True, "text_encoder": False, "vae": False}
    eng.get_weights_checksum()  # the sync path works with only the weights onloaded
    with pytest.raises(RuntimeError, match=r"\['text_encoder', 'vae'\]"):
        eng.generate(reqs)
    eng.resume_memory()
    assert all(eng.memory_state().values())
    assert torch.isfinite(eng.generate(reqs).images).all()
    with pytest.raises(ValueError, match="unknown memory tag"):
        eng.release_memory(("optimizer",))


def test_bf16_rollout_replays_in_bf16_and_fp32(tiny_model_dir, adapter):
    """The CUDA dtype path, on CPU: a bf16 engine records bf16 latents; a bf16 actor replays
    them to the recorded log-prob; an fp32 actor accepts them too (inputs upcast losslessly,
    timestep rounded through bf16 as the sampler did) and lands close."""
    cfg = parse_sampling_config({**SAMPLING, "height": 32, "width": 32})
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.bfloat16)
    batch = eng.generate(make_requests(adapter, eng, cfg, prompts=PROMPTS[:2], group_size=1))
    assert batch.latents.dtype == torch.bfloat16 and batch.prompt_embeds.dtype == torch.bfloat16
    assert batch.log_probs.dtype == torch.float32
    with torch.no_grad():
        bf16 = adapter.replay_transition(adapter.load_train_model(str(tiny_model_dir), dtype=torch.bfloat16),
                                         batch, 1)
        fp32 = adapter.replay_transition(adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32),
                                         batch, 1)
    torch.testing.assert_close(bf16, batch.log_probs[:, 1], atol=1e-5, rtol=0)
    assert 0 < (fp32 - batch.log_probs[:, 1]).abs().max() < 5e-3  # measured ~1e-4..6e-4


def test_weight_syncer_round_trip(tiny_model_dir, adapter):
    """The actor side's WeightSyncer drives this engine end to end: full (bf16 wire, two
    buckets, checksum verified) and adapter syncs commit their versions."""
    from trainer.weight_sync import WeightSyncer

    actor = adapter.load_train_model(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.01 * torch.randn_like(p))
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    syncer = WeightSyncer("full", wire_dtype="bf16", bucket_size_mb=0.5, name_map=adapter.weight_name_map)
    stats = syncer.sync(actor, eng)
    assert eng.policy_version == 1 and stats["train/weight_sync_tensors"] == len(list(actor.parameters()))
    for (name, p), (_, q) in zip(actor.named_parameters(), eng.transformer.named_parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16).float(), q), name

    lora_engine = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    actor_with_lora = lora_actor(adapter, tiny_model_dir, rank=2, alpha=4)
    lsync = WeightSyncer("adapter", wire_dtype="fp32", name_map=adapter.weight_name_map,
                         lora_config={"rank": 2, "alpha": 4, "target_modules": list(adapter.lora_target_modules)})
    lsync.sync(actor_with_lora, lora_engine)
    assert lora_engine.policy_version == 1 and lora_engine.holds_lora()
    assert torch.equal(_dit_out(lora_engine.transformer), _dit_out(actor_with_lora))
    with pytest.raises(WeightSyncError):
        syncer.sync(actor, lora_engine)  # full into a LoRA engine: refused, version kept
    assert lora_engine.policy_version == 1


def test_dance_sde_replays(tiny_model_dir, adapter):
    cfg = parse_sampling_config({"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.5,
                                 "sde_type": "dance", "sde_indices": [0, 2]})
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    batch = eng.generate(make_requests(adapter, eng, cfg, prompts=PROMPTS[:2], group_size=2))
    with torch.no_grad():
        for col in range(2):
            torch.testing.assert_close(adapter.replay_transition(eng.transformer, batch, col),
                                       batch.log_probs[:, col], atol=1e-5, rtol=0)


def test_weight_index_is_kept_while_the_dit_structure_holds(tiny_model_dir, adapter):
    """The name -> parameter index survives new versions and a release / resume round trip; LoRA
    injected after a first full sync (by set_lora_tensors or by anyone) rebuilds it, and a full
    sync is then refused; the adapter name checks keep their errors on the cached path."""
    from peft import LoraConfig, inject_adapter_in_model

    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    base = [(n, p.detach().clone()) for n, p in adapter.load_train_model(str(tiny_model_dir)).named_parameters()]
    eng.update_weights_from_tensors(base, build_manifest("full", base, 1))
    index = eng._weights_index
    eng.release_memory()
    eng.resume_memory()
    eng.update_weights_from_tensors(base, build_manifest("full", base, 2))
    assert eng._weights_index is index and not eng.holds_lora() and eng._weights_index is index
    assert eng.get_weights_checksum() == weights_checksum(base)
    # LoRA through the engine's own path: a new index, full syncs refused
    actor = lora_actor(adapter, tiny_model_dir, rank=2, alpha=4)
    from trainer.weight_sync import iter_sync_tensors

    named = list(iter_sync_tensors(actor, "adapter", wire_dtype=None))
    cfg = {"rank": 2, "alpha": 4, "target_modules": list(adapter.lora_target_modules)}
    eng.set_lora_tensors(named, build_manifest("adapter", named, 3), cfg)
    assert eng._weights_index is not index and eng.holds_lora()
    with pytest.raises(WeightSyncError, match="holds LoRA layers"):
        eng.update_weights_from_tensors(base, build_manifest("full", base, 2))  # the same version as before
    # the cached name check: same names accepted again; a shape, a missing and an unknown name refused
    lora_index = eng._weights_index
    eng.set_lora_tensors(named, build_manifest("adapter", named, 4), cfg)
    assert eng._weights_index is lora_index and lora_index.lora_names_checked == tuple(n for n, _ in named)
    bad = [(n, t[:1] if i == 0 else t) for i, (n, t) in enumerate(named)]
    with pytest.raises(WeightSyncError, match="shape mismatch for 1 tensor"):
        eng.set_lora_tensors(bad, build_manifest("adapter", bad, 5), cfg)
    with pytest.raises(WeightSyncError, match="lacks 1 of the engine's"):
        eng.set_lora_tensors(named[1:], build_manifest("adapter", named[1:], 5), cfg)
    unknown = [("nope.lora_A.weight", named[0][1])] + named[1:]
    with pytest.raises(WeightSyncError, match="does not have"):
        eng.set_lora_tensors(unknown, build_manifest("adapter", unknown, 5), cfg)
    # LoRA injected behind the engine's back after a full sync: seen at the next look
    other = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    other.update_weights_from_tensors(base, build_manifest("full", base, 1))
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=list(adapter.lora_target_modules)),
                            other.transformer)
    assert other.holds_lora()
    with pytest.raises(WeightSyncError, match="holds LoRA layers"):
        other.update_weights_from_tensors(base, build_manifest("full", base, 2))


def test_the_qwen_image_adapter_implements_the_whole_protocol():
    """The engine, the actor and the loop call the adapter only through the protocol: every member
    it declares must exist on the shipped adapter."""
    from trainer.models.base import GenerativeModelAdapter

    members = [m for m in vars(GenerativeModelAdapter) if not m.startswith("_")]
    members += list(GenerativeModelAdapter.__annotations__)
    assert [m for m in members if not hasattr(QwenImageAdapter(), m)] == []


def test_true_cfg_update_starts_at_ratio_one_and_trains_every_parameter(tiny_model_dir, adapter):
    """The actor's update on a CFG rollout, through the loop's replay_fn: the first update's
    ratio is exactly 1 (its own two-row forward is pi_old), the loss is finite, every trainable
    parameter changes and the frozen ones do not."""
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name
    from trainer.loop import make_replay_fn

    cfg = parse_sampling_config({**SAMPLING, "height": 32, "width": 32, "guidance_scale": 3.0})
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    batch = eng.generate(make_requests(adapter, eng, cfg, prompts=PROMPTS[:2], group_size=2)).without_images()
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        actor = Actor.from_adapter(adapter, str(tiny_model_dir), mesh, make_cfg("full", optim__lr=1e-3),
                                   device=torch.device("cpu"))
        before = full_params(actor.model)
        m = actor.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), make_replay_fn(adapter))
        after = full_params(actor.model)
        first = actor.last_update_stats[0]
        assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
        assert m["train/optimizer_steps"] >= 1 and torch.isfinite(torch.tensor(m["train/loss"]))
        trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
        assert trainable and all(not torch.equal(before[n], after[n]) for n in trainable)
        assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    finally:
        next(gen, None)


def test_kl_to_the_reference_is_zero_until_the_adapter_moves(tiny_model_dir, adapter):
    """--use-kl-loss on a LoRA actor: the reference is the base (adapter disabled). Before any
    optimizer step the adapter is zero, so the KL is exactly 0; after one it is > 0; the loss
    carries it, and the frozen LoRA tensors stay frozen through the reference forward."""
    from tests.dist.tiny import make_cfg, one_rank_mesh
    from trainer.actor import Actor, lora_disabled
    from trainer.loop import make_replay_fn

    cfg = parse_sampling_config({**SAMPLING, "height": 32, "width": 32})
    eng = NativeEngine(str(tiny_model_dir), device="cpu", dtype=torch.float32)
    batch = eng.generate(make_requests(adapter, eng, cfg, prompts=PROMPTS[:2], group_size=2)).without_images()
    replay_fn = make_replay_fn(adapter)
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        actor = Actor.from_adapter(adapter, str(tiny_model_dir), mesh,
                                   make_cfg("lora", optim__lr=1e-2, fsdp__fsdp_master_dtype="fp32",
                                            grpo__num_updates_per_batch=2, grpo__kl_coef=0.5, grpo__use_kl_loss=True),
                                   device=torch.device("cpu"))
        frozen = {n for n, p in actor.model.named_parameters() if not p.requires_grad}
        m = actor.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), replay_fn)
        first, second = actor.last_update_stats
        assert first["kl_ref_max"].item() == 0.0 and first["ratio_max"].item() == 1.0
        assert second["kl_ref_max"].item() > 0.0
        assert 0.0 < m["train/kl_ref"] and m["train/approx_kl"] >= 0.0
        assert {n for n, p in actor.model.named_parameters() if not p.requires_grad} == frozen
        with torch.no_grad():  # the context restores the adapter: the policy differs from its reference again
            with lora_disabled(actor.model):
                ref = replay_fn(actor.model, batch)
            live = replay_fn(actor.model, batch)
        assert (ref - live).abs().max() > 0
    finally:
        next(gen, None)
