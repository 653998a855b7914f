"""The FLUX.1 family on its tiny offline model: the directory loads as diffusers' FluxPipeline,
the adapter's math is FluxPipeline's (packing, RoPE ids, schedule, the DiT call, decode), and the
contracts the Qwen-Image path holds hold here too (replay == sampler, ratio 1 on the first
update, every trainable parameter trained, sync parity, export round trip)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tools.tiny_flux import FLUX_DEV_SCHEDULER_CONFIG, TINY_FLUX_TRANSFORMER_CONFIG, build_tiny_flux_pipeline
from trainer.models import flux as fx
from trainer.trajectory import Geometry, SamplerSettings

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")


@pytest.fixture(scope="module")
def pipe(tiny_flux_dir):
    from diffusers import FluxPipeline

    p = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


# ------------------------------------------------------------------------- the tiny model


def test_tiny_directory_has_flux_dev_layout(tiny_flux_dir):
    index = json.loads((tiny_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    cfg = json.loads((tiny_flux_dir / "transformer" / "config.json").read_text())
    assert cfg["guidance_embeds"] is True and cfg["in_channels"] == 16
    sched = json.loads((tiny_flux_dir / "scheduler" / "scheduler_config.json").read_text())
    for key, value in FLUX_DEV_SCHEDULER_CONFIG.items():
        assert sched[key] == value, key
    vae = json.loads((tiny_flux_dir / "vae" / "config.json").read_text())
    assert (vae["scaling_factor"], vae["shift_factor"], vae["latent_channels"]) == (0.3611, 0.1159, 4)
    size = sum(p.stat().st_size for p in tiny_flux_dir.rglob("*") if p.is_file())
    assert size < 8 * 1024 * 1024, f"tiny FLUX is {size / 1e6:.1f} MB"


def test_tiny_loads_with_flux_pipeline_offline_and_generates(pipe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert pipe.vae_scale_factor == 4 and pipe.transformer.config.guidance_embeds
    # the tokenizers are real: one token per byte / character of a word, plus the specials
    clip = pipe.tokenizer("a red ball").input_ids
    t5 = pipe.tokenizer_2("a red ball").input_ids
    # CLIP: <bos> + one per byte + <eos>; T5: the word marker fuses with a word's first character, then </s>
    assert len(clip) == 2 + len("aredball") and len(t5) == len("aredball") + 1
    out = pipe("a red ball", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
               output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()


def test_same_seed_same_weights_and_cli(tmp_path, tiny_flux_dir):
    from safetensors.torch import load_file

    from tools.make_tiny_model import main

    assert main(["--family", "flux", "--output-dir", str(tmp_path / "again"), "--seed", "0"]) == 0
    build_tiny_flux_pipeline(tmp_path / "seed1", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b, c = (load_file(d / name) for d in (tiny_flux_dir, tmp_path / "again", tmp_path / "seed1"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert json.loads((tmp_path / "again" / "TINY_RANDOM_MODEL.json").read_text())["family"] == "flux"


# ------------------------------------------------------------------------- FluxPipeline's math


@pytest.mark.parametrize("h, w", [(8, 8), (8, 12), (16, 4)])
def test_packing_and_ids_are_flux_pipelines(pipe, h, w):
    from diffusers import FluxPipeline

    x = torch.randn(3, 4, h, w)
    packed = fx.pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 3, 4, h, w))
    vsf = pipe.vae_scale_factor
    assert torch.equal(fx.unpack_latents(packed, h // 2, w // 2),
                       FluxPipeline._unpack_latents(packed, h * vsf, w * vsf, vsf))
    assert fx.packed_grid(h * vsf, w * vsf, vsf) == (h // 2, w // 2)
    assert torch.equal(fx.latent_image_ids(h // 2, w // 2),
                       FluxPipeline._prepare_latent_image_ids(3, h // 2, w // 2, "cpu", torch.float32))
    with pytest.raises(ValueError, match="expected 2 x 2"):
        fx.unpack_latents(packed, 2, 2)


@pytest.mark.parametrize("height, width, steps", [(32, 32, 4), (512, 512, 6), (1024, 1024, 28), (768, 1360, 10)])
def test_sigma_schedule_is_flux_pipelines(height, width, steps):
    """The driver's schedule for FLUX.1-dev's scheduler config is the scheduler's own, set as
    FluxPipeline sets it: sigmas = linspace(1, 1/N, N), mu = calculate_shift(image tokens)."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from trainer.sampling import image_seq_len, sigma_schedule

    sched = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG)
    seq = image_seq_len(height, width, 8)
    assert seq == (height // 16) * (width // 16)
    c = sched.config
    mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = sigma_schedule(FLUX_DEV_SCHEDULER_CONFIG, steps, seq)
    assert ours == [float(s) for s in sched.sigmas]
    assert ours[0] == 1.0 and ours[-1] == 0.0


def test_dit_call_is_flux_pipelines(pipe):
    """flux_velocity gives, bit for bit, the transformer output FluxPipeline's own denoising loop
    gets (guidance 3.5 through the guidance embedding, 2-D ids, timestep / 1000)."""
    seen = {}

    def hook(module, args, kwargs, out):
        if "kw" not in seen:
            seen["kw"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            seen["out"] = out[0].clone()

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        pipe("a blue cup", height=32, width=48, num_inference_steps=2, max_sequence_length=12, guidance_scale=3.5,
             output_type="latent", generator=torch.Generator().manual_seed(1))
    finally:
        handle.remove()
    kw = seen["kw"]
    assert kw["txt_ids"].dim() == 2 and kw["img_ids"].dim() == 2
    assert torch.equal(kw["guidance"], fx.guidance_tensor(3.5, 1))
    rows, cols = fx.packed_grid(32, 48, 4)
    v = fx.flux_velocity(pipe.transformer, kw["hidden_states"], kw["timestep"] * 1000, kw["encoder_hidden_states"],
                         kw["pooled_projections"], fx.guidance_tensor(3.5, 1), rows, cols)
    assert torch.equal(v, seen["out"])
    # the guidance input matters: the distilled model's output depends on it
    other = fx.flux_velocity(pipe.transformer, kw["hidden_states"], kw["timestep"] * 1000,
                             kw["encoder_hidden_states"], kw["pooled_projections"], fx.guidance_tensor(1.0, 1),
                             rows, cols)
    assert (other - v).abs().max() > 1e-4


def test_decode_is_flux_pipelines(pipe):
    """decode_latents = FluxPipeline's decode of the same packed latents (output_type 'pt')."""
    from diffusers import FluxPipeline

    torch.manual_seed(0)
    packed = torch.randn(2, 4 * 6, 16)
    ours = fx.decode_latents(pipe.vae, packed, 32, 48, 4)
    z = FluxPipeline._unpack_latents(packed, 32, 48, 4) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    with torch.no_grad():
        want = pipe.image_processor.postprocess(pipe.vae.decode(z, return_dict=False)[0], output_type="pt")
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)
    assert fx.vae_scale_factor_from_config(pipe.vae.config) == 4
    assert TINY_FLUX_TRANSFORMER_CONFIG["in_channels"] == 4 * pipe.vae.config.latent_channels


# ------------------------------------------------------------------------- engine, replay, update

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 3.5, "eta": 1.0,
            "sde_type": "sde", "sde_indices": [1, 2]}
PROMPTS = ["a red ball", "a considerably longer prompt about a green cube on a table"]


@pytest.fixture(scope="module")
def adapter():
    return fx.FluxAdapter()


@pytest.fixture(scope="module")
def sampling():
    from trainer.sampling import parse_sampling_config

    return parse_sampling_config(SAMPLING)


@pytest.fixture(scope="module")
def engine(tiny_flux_dir, adapter):
    from trainer.engine.native import NativeEngine

    return NativeEngine(str(tiny_flux_dir), device="cpu", dtype=torch.float32, adapter=adapter,
                        max_sequence_length=32)


def make_requests(adapter, engine, sampling, prompts=PROMPTS, group_size=2, seed=7):
    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    return [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"p{g}:s{s}", sampling=sampling,
                                          sde_indices=list(sampling.sde_indices), sigmas=sigmas, generation_seed=seed)
            for g, p in enumerate(prompts) for s in range(group_size)]


@pytest.fixture(scope="module")
def batch(engine, adapter, sampling):
    return engine.generate(make_requests(adapter, engine, sampling))


def test_the_flux_adapter_implements_the_whole_protocol(adapter):
    from trainer.models.base import GenerativeModelAdapter

    members = [m for m in vars(GenerativeModelAdapter) if not m.startswith("_")]
    members += list(GenerativeModelAdapter.__annotations__)
    assert [m for m in members if not hasattr(adapter, m)] == []
    assert adapter.never_trained_param_names(torch.nn.Linear(2, 2)) == []


def test_rollout_records_flux_conditions_and_the_embedded_guidance(engine, adapter, batch):
    adapter.validate_trajectory(batch)
    assert len(batch) == 4 and batch.images.shape == (4, 3, 32, 32)
    # 32 px / VAE factor 4 / 2 x 2 packing -> 4 x 4 tokens of 4 x 4 channels
    assert batch.latents.shape == (4, 2, 16, 16)
    c = batch.conditions
    assert set(c) == {"prompt_embeds", "pooled_prompt_embeds", "guidance"}
    assert c["prompt_embeds"].shape == (4, 32, 32) and c["pooled_prompt_embeds"].shape == (4, 32)
    assert c["guidance"].dtype == torch.float32 and c["guidance"].tolist() == [3.5] * 4
    # no true CFG: one conditional row per candidate, whatever the embedded guidance
    assert not batch.guided and batch.guidance_scale == 1.0 and batch.negative_prompt is None
    assert torch.equal(c["pooled_prompt_embeds"][0], c["pooled_prompt_embeds"][1])
    assert not torch.equal(c["pooled_prompt_embeds"][0], c["pooled_prompt_embeds"][2])
    assert engine.sigma_schedule(32, 32, 4) == adapter.sigma_schedule(FLUX_DEV_SCHEDULER_CONFIG, 4, Geometry(32, 32, 4))
    assert not torch.equal(batch.images[0], batch.images[1])


def test_conditions_are_flux_pipelines_encode_prompt(engine, pipe):
    ours = engine.encode_prompt("a blue cup")
    with torch.no_grad():  # the engine encodes without grad, like the pipeline's __call__
        embeds, pooled, text_ids = pipe.encode_prompt("a blue cup", prompt_2=None, max_sequence_length=32)
    assert torch.equal(ours["prompt_embeds"], embeds[0]) and torch.equal(ours["pooled_prompt_embeds"], pooled[0])
    assert text_ids.shape == (32, 3) and not text_ids.any()


def test_replay_reproduces_the_sampler_logprob_fp32(engine, adapter, sampling, batch, tiny_flux_dir):
    """Replay through a separately loaded actor transformer at the same weights == the sampler's
    log-prob, all columns in one forward, per column, and in uneven micro-batches."""
    from trainer.loop import make_replay_fn

    actor = adapter.load_train_model(str(tiny_flux_dir), dtype=torch.float32)
    assert adapter.vae_scale_factor == 4
    with torch.no_grad():
        one = adapter.replay_transitions(actor, batch)
        torch.testing.assert_close(one, batch.log_probs, atol=1e-5, rtol=0)
        for col in range(batch.num_steps):
            parts = [adapter.replay_transition(actor, batch[idx], col) for idx in ([0], [1, 2], slice(3, 4))]
            torch.testing.assert_close(torch.cat(parts), batch.log_probs[:, col], atol=1e-5, rtol=0)
        torch.testing.assert_close(make_replay_fn(adapter)(actor, batch), batch.log_probs, atol=1e-5, rtol=0)
        # the recorded guidance is what the replay feeds the DiT: another value gives another log-prob
        other = dict(batch.conditions, guidance=torch.full((4,), 1.0))
        moved = adapter.replay_transitions(actor, dataclasses.replace(batch, conditions=other))
        assert (moved - batch.log_probs).abs().max() > 1e-4


def test_sidecar_round_trip_keeps_the_flux_conditions(batch, adapter, sampling, tiny_flux_dir, tmp_path):
    from trainer import artifacts

    rows = batch.rows_of_group(1)
    path = artifacts.write_group_sidecar(tmp_path / "g.safetensors", batch[rows], task="t2i", rollout_id=0,
                                         sampling=sampling)
    back = artifacts.sidecar_to_trajectory(*artifacts.read_sidecar(path))
    for k, v in batch[rows].conditions.items():
        assert torch.equal(back.conditions[k], v), k
    adapter.validate_trajectory(back)
    actor = adapter.load_train_model(str(tiny_flux_dir), dtype=torch.float32)
    with torch.no_grad():  # what the actor replays from the sidecar is what it replays from the rollout
        torch.testing.assert_close(adapter.replay_transitions(actor, back), batch.log_probs[rows],
                                   atol=1e-5, rtol=0)


def test_first_update_is_ratio_one_and_trains_every_parameter(tiny_flux_dir, adapter, batch, sampling):
    """The actor's FlowGRPO update on a FLUX rollout (full fine-tune, one rank): the first
    update's ratio is exactly 1, every parameter changes (so FLUX has no never-trained one), and
    LoRA trains exactly its adapter tensors."""
    from tests.dist.tiny import full_params, make_cfg, one_rank_mesh
    from trainer.actor import Actor
    from trainer.core.names import model_name
    from trainer.loop import make_replay_fn

    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        for mode in ("full", "lora"):
            over = {"optim__lr": 1e-2, "fsdp__fsdp_master_dtype": "fp32"} if mode == "lora" else {"optim__lr": 1e-3}
            actor = Actor.from_adapter(adapter, str(tiny_flux_dir), mesh, make_cfg(mode, **over),
                                       device=torch.device("cpu"))
            assert actor.never_trained == []
            before = full_params(actor.model)
            m = actor.train_step(batch.without_images(), torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                 make_replay_fn(adapter))
            after = full_params(actor.model)
            first = actor.last_update_stats[0]
            assert first["ratio_max"].item() == 1.0 == first["ratio_min"].item()
            assert m["train/optimizer_steps"] >= 1 and torch.isfinite(torch.tensor(m["train/loss"]))
            trainable = {model_name(n) for n, p in actor.model.named_parameters() if p.requires_grad}
            unchanged = sorted(n for n in trainable if torch.equal(before[n], after[n]))
            assert trainable and unchanged == [], unchanged
            assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
            if mode == "full":
                assert trainable == set(before)
            else:
                assert trainable and all(".lora_" in n for n in trainable)
                # every attention projection of both block kinds carries LoRA
                assert any(n.startswith("single_transformer_blocks.1.attn.to_v.lora_B") for n in trainable)
                assert any(n.startswith("transformer_blocks.1.attn.to_add_out.lora_B") for n in trainable)
    finally:
        next(gen, None)


def test_true_cfg_and_bad_requests_are_refused(engine, adapter, sampling):
    from trainer.sampling import parse_sampling_config

    with pytest.raises(ValueError, match="embedded guidance .* not true CFG"):
        adapter.velocity(None, None, None, {}, Geometry(32, 32, 4), SamplerSettings(6, 0.9, guidance_scale=3.0, cfg_renorm=True))
    with pytest.raises(ValueError, match="guidance_scale is 0.5"):
        adapter.build_rollout_request("p", group_index=0, slot=0, sample_id="x",
                                      sampling=parse_sampling_config({**SAMPLING, "sde_indices": [1]}).__class__(
                                          **{**parse_sampling_config(SAMPLING).__dict__, "guidance_scale": 0.5}),
                                      sde_indices=[1], sigmas=[1, 0.5, 0.3, 0.1, 0], generation_seed=0)
    with pytest.raises(ValueError, match="step 0 under sde_type 'sde'"):
        adapter.build_rollout_request("p", group_index=0, slot=0, sample_id="x", sampling=sampling, sde_indices=[0],
                                      sigmas=[1, 0.5, 0.3, 0.1, 0], generation_seed=0)
    req = make_requests(adapter, engine, sampling, prompts=["p"], group_size=1)[0]
    assert req.guidance_scale == 1.0 and req.embedded_guidance == 3.5


# ------------------------------------------------------------------------- preflight and tools


def test_preflight_refuses_the_sglang_engine_for_flux_naming_the_family(tiny_flux_dir, tmp_path):
    from trainer.config import load_config
    from trainer.preflight import PreflightError, validate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red ball", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    argv = ["--model-path", str(tiny_flux_dir), "--model-adapter-path", "trainer.models.flux.FluxAdapter",
            "--prompt-data", str(prompts), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "1",
            "--n-samples-per-prompt", "2", "--global-batch-size", "2", "--micro-batch-size", "1",
            "--sampling-config", json.dumps(SAMPLING), "--generation-task", "t2i", "--num-rollout", "1",
            "--reward-scorer-path", "color", "--reward-runtime", "cpu", "--artifact-root", str(tmp_path / "a")]
    validate(load_config(argv + ["--rollout-engine-class-path", "native"]), 1)  # raises on any problem
    with pytest.raises(PreflightError) as e:
        validate(load_config(argv + ["--rollout-engine-class-path", "sglang"]), 1)
    assert "--model-adapter-path trainer.models.flux.FluxAdapter: the SGLang engine bridges SGLang's Qwen-Image " \
           "pipeline only; this family runs on --rollout-engine-class-path native" in str(e.value)


# ------------------------------------------------------------------------- the speed options


@pytest.fixture
def eager_compile(monkeypatch):
    """torch.compile with the "eager" backend (tests/test_rollout_speed.py's): dynamo traces and
    guards the blocks as with inductor, without inductor's codegen time."""
    from trainer.core import modules

    monkeypatch.setitem(modules.REGIONAL_COMPILE_KWARGS, "backend", "eager")
    yield
    torch._dynamo.reset()


def test_engine_speedups_compile_and_quantize_both_flux_block_kinds(tiny_flux_dir, adapter, sampling, eager_compile):
    """--rollout-compile and --rollout-precision fp8 reach FLUX's two block lists: every
    double-stream and every single-stream block is compiled and has only FP8 linears (the
    embedders and the output projection stay), and the rollout runs on them."""
    from trainer.core.fp8 import FP8Linear
    from trainer.core.modules import repeated_blocks
    from trainer.engine.native import NativeEngine

    eng = NativeEngine(str(tiny_flux_dir), device="cpu", dtype=torch.float32, adapter=adapter, max_sequence_length=32)
    reqs = make_requests(adapter, eng, sampling)
    eager = eng.generate(reqs)
    eng.enable_speedups(compile_blocks=True, precision="fp8")
    dit = eng.transformer
    blocks = repeated_blocks(dit)
    assert blocks == list(dit.transformer_blocks) + list(dit.single_transformer_blocks)
    assert {type(b).__name__ for b in blocks} == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    for block in blocks:
        assert block._compiled_call_impl is not None
        linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is FP8Linear for m in linears)
    assert type(dit.proj_out) is torch.nn.Linear and type(dit.context_embedder) is torch.nn.Linear
    fast = eng.generate(reqs)
    assert eng.last_stats["new_graphs"] >= 2  # a graph per block kind at least
    assert torch.isfinite(fast.log_probs).all() and not torch.equal(fast.latents, eager.latents)
    assert ((fast.images - eager.images).abs().mean() < 0.05).item()  # the same images, up to FP8 rounding
    eng.generate(reqs)
    assert eng.last_stats["new_graphs"] == 0  # fixed shapes: no recompile


def test_parallelize_checkpoints_compiles_and_shards_both_flux_block_lists(tiny_flux_dir, adapter, sampling, batch,
                                                                          eager_compile):
    """The actor's activation checkpointing, --fsdp-compile and per-block FSDP2 cover FLUX's
    double-stream AND single-stream blocks; "every k-th block" counts along both lists; the
    wrapped model replays the plain one's log-prob and trains the single-stream blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from tests.dist.tiny import one_rank_mesh
    from trainer.actor import parallelize
    from trainer.core.modules import repeated_block_lists, repeated_blocks
    from trainer.loop import make_replay_fn

    def load():
        return adapter.load_train_model(str(tiny_flux_dir), dtype=torch.float32)

    plain = load()
    lists = repeated_block_lists(plain)
    assert len(lists) == 2 and lists[0] is plain.transformer_blocks and lists[1] is plain.single_transformer_blocks
    assert [type(b).__name__ for b in repeated_blocks(plain)] == ["FluxTransformerBlock"] * 2 + \
        ["FluxSingleTransformerBlock"] * 2
    replay_fn = make_replay_fn(adapter)
    rows = batch.without_images()[:2]
    with torch.no_grad():
        want = replay_fn(plain, rows)
    gen = one_rank_mesh()
    mesh = next(gen)
    try:
        model = parallelize(load(), mesh, activation_checkpointing=True, compile_blocks=True)
        wrapped = list(model.transformer_blocks) + list(model.single_transformer_blocks)
        for block in wrapped:
            assert isinstance(block, torch._dynamo.eval_frame.OptimizedModule)
            assert isinstance(block._orig_mod, CheckpointWrapper) and isinstance(block, FSDPModule)
        assert repeated_blocks(model) == wrapped  # still found once wrapped
        logp = replay_fn(model, rows)
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-6)
        logp.sum().backward()
        grads = [p.grad for p in model.single_transformer_blocks.parameters()]
        assert grads and all(g is not None and bool(g.abs().sum() > 0) for g in grads)
        every3 = parallelize(load(), mesh, activation_checkpointing=True, activation_checkpointing_every=3)
        assert [isinstance(b, CheckpointWrapper) for b in repeated_blocks(every3)] == [True, False, False, True]
    finally:
        next(gen, None)


# ------------------------------------------------------------------------- the bench


@pytest.mark.parametrize("shape", ["tiny", "real"])
def test_flux_bench_parameter_split_is_the_modules(shape):
    """The FLOP model's parameter split sums to the module's own count (the real FLUX.1-dev DiT,
    11.90 B, built on the meta device); --shape real is FLUX.1-dev's published config."""
    from diffusers import FluxTransformer2DModel

    from tools.bench_flux import flux_forward_flops, flux_param_counts, flux_shape_configs

    cfg = flux_shape_configs(shape)[0]
    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    counts = flux_param_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    if shape == "real":
        assert (cfg["num_layers"], cfg["num_single_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"],
                cfg["joint_attention_dim"], cfg["pooled_projection_dim"], cfg["guidance_embeds"]) == \
            (19, 38, 24, 128, 4096, 768, True)
        assert counts["total"] == pytest.approx(11.90e9, rel=1e-3)
        # 512x512 (1024 image tokens) with FLUX.1-dev's 512 text tokens
        assert flux_forward_flops(cfg, 1024, 512) == pytest.approx(2.150e13, rel=1e-3)


def test_flux_bench_tiny_run_writes_finite_figures(tmp_path):
    import math
    import os
    import subprocess
    import sys

    from tests.workers.launch import ROOT

    out = tmp_path / "figures.jsonl"
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--family", "flux", "--shape", "tiny", "--device", "cpu",
           "--height", "32", "--width", "32", "--steps", "3", "--sde-pool", "1", "2", "--trained-steps", "2",
           "--prompts", "2", "--group-size", "2", "--micro-batch", "1", "--num-updates", "2", "--dit-batches", "2",
           "--iters", "1", "--text-tokens", "8", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    figures = {line["figure"]: line for line in lines}
    assert all(isinstance(l["value"], float) and math.isfinite(l["value"]) for l in lines)
    assert {"rollout_images_per_s", "replay_transitions_per_s_lora", "replay_mfu_lora", "rollout_mfu", "dit_mfu",
            "merged_sync_s", "adapter_sync_s", "update_s_lora", "step_s"} <= set(figures)
    assert figures["step_s"]["geometry"]["family"] == "flux" and figures["step_s"]["geometry"]["text_tokens"] == 8
    assert figures["replay_logp_max_abs_err_lora"]["value"] < 1e-4


def test_flux_bench_with_the_speed_flags_writes_finite_speed_figures(tmp_path, monkeypatch, eager_compile):
    """--rollout-compile --fsdp-compile --rollout-precision fp8 run for FLUX through the shared
    main: the eager rollout, then the FP8 + compiled one (its speedup and rollout-to-replay gap),
    the compiled actor's replay, update and the whole step, every figure finite; the attention
    policy is applied before the first rollout, and the actor compiled both block lists. In
    process, for the eager compile backend (inductor's CPU codegen takes minutes here)."""
    import math

    import tools.bench as bench
    import trainer.models.base as base
    from tests.dist.tiny import one_rank_mesh
    from trainer.engine.native import NativeEngine

    events, actors = [], []
    policy, generate, build_actor = base.apply_attention_policy, NativeEngine.generate, bench.build_actor

    def spy_policy(adapter, device):
        events.append(("policy", type(adapter).__name__))
        return policy(adapter, device)

    def spy_generate(self, requests):
        events.append(("generate", None))
        return generate(self, requests)

    def spy_actor(*args, **kwargs):
        actors.append(build_actor(*args, **kwargs))
        return actors[-1]

    monkeypatch.setattr(base, "apply_attention_policy", spy_policy)
    monkeypatch.setattr(NativeEngine, "generate", spy_generate)
    monkeypatch.setattr(bench, "build_actor", spy_actor)
    out = tmp_path / "figures.jsonl"
    gen = one_rank_mesh()
    next(gen)
    try:
        rc = bench.main(["--family", "flux", "--shape", "tiny", "--device", "cpu", "--height", "32", "--width", "32",
                         "--steps", "2", "--sde-pool", "1", "--trained-steps", "1", "--prompts", "1", "--group-size",
                         "2", "--micro-batch", "1", "--num-updates", "2", "--dit-batches", "1", "--iters", "1",
                         "--text-tokens", "8", "--rollout-compile", "--fsdp-compile", "--rollout-precision", "fp8",
                         "--out", str(out)])
    finally:
        next(gen, None)
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(isinstance(l["value"], float) and math.isfinite(l["value"]) for l in lines)
    by = {(l["figure"], l.get("variant")): l["value"] for l in lines}
    fast = "fp8+compile"
    for figure in ("rollout_images_per_s", "rollout_mfu", "dit_mfu"):
        assert by[(figure, "eager")] > 0 and by[(figure, fast)] > 0
    assert by[("enable_speedups_s", fast)] > 0 and by[("rollout_speedup", fast)] > 0
    assert by[("rollout_speedup", fast)] == pytest.approx(by[("rollout_images_per_s", fast)]
                                                          / by[("rollout_images_per_s", "eager")])
    assert by[("rollout_new_graphs", fast)] == 0  # compiled by the warm-up rollout, then reused
    assert 0 < by[("rollout_replay_kl", fast)] < 1e-3  # the FP8 rollout is off the actor by its rounding
    assert ("rollout_logp_gap_mean", fast) in by
    assert {"replay_transitions_per_s_lora", "update_s_lora", "adapter_sync_s", "step_first_s", "step_s"} <= \
        {figure for figure, _ in by}
    assert lines[-1]["geometry"]["family"] == "flux" and lines[-1]["geometry"]["dit_single_layers"] == 2
    assert events[0] == ("policy", "FluxAdapter") and ("generate", None) in events
    (actor,) = actors
    for blocks in (actor.model.transformer_blocks, actor.model.single_transformer_blocks):
        assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks)


def test_flux_bench_takes_the_speed_flags_and_refuses_compare(capsys):
    """The speed flags parse for --family flux (they run: the test above); --compare stays
    Qwen-Image's and is refused naming the family."""
    from tools.bench import parse_args

    args = parse_args(["--family", "flux", "--rollout-compile", "--fsdp-compile", "--rollout-precision", "fp8"])
    assert args.rollout_compile and args.fsdp_compile and args.rollout_precision == "fp8"
    with pytest.raises(SystemExit):
        parse_args(["--family", "flux", "--compare", "diffusers"])
    assert "--compare times Qwen-Image pipelines, not --family flux's" in capsys.readouterr().err


def test_bench_counts_one_dit_row_per_candidate_under_the_embedded_guidance(engine, adapter, sampling):
    """FLUX's guidance_scale 3.5 is its embedded guidance, not true CFG: the bench's FLOPs (and so
    its MFU figures) count one DiT row per candidate, where Qwen-Image's CFG 4 counts two."""
    from types import SimpleNamespace

    from tests.dist.tiny import ADAPTER as QWEN
    from tools.bench import cfg_rows
    from trainer.sampling import parse_sampling_config

    ctx = SimpleNamespace(engine=engine, adapter=adapter, sampling=sampling, prompts=PROMPTS, sde_indices=[1, 2], media=None,
                          args=SimpleNamespace(seed=0))
    assert sampling.guidance_scale == 3.5 and cfg_rows(ctx) == 1
    qwen_sampling = parse_sampling_config(dict(SAMPLING, guidance_scale=4.0))
    assert cfg_rows(SimpleNamespace(**{**vars(ctx), "adapter": QWEN, "sampling": qwen_sampling})) == 2


def test_flux_turns_cudnn_attention_off_on_cuda_only():
    """FLUX's adapter asks for cuDNN attention off (its replay backward failed there on an H200);
    the policy touches the process-wide flag on CUDA only, and families that do not ask keep it."""
    from tests.dist.tiny import ADAPTER as QWEN
    from trainer.models.base import apply_attention_policy

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert not apply_attention_policy(fx.FluxAdapter(), torch.device("cpu"))
        assert not apply_attention_policy(QWEN, torch.device("cuda"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert apply_attention_policy(fx.FluxAdapter(), torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_max_sequence_length_sets_the_t5_window_every_prompt_is_padded_to(tiny_flux_dir, adapter):
    """--max-sequence-length reaches the engine (the loop's engine_options), and FLUX pads every
    prompt to it: FlowGRPO's 128 in the recipe, FluxPipeline's 512 when unset."""
    from types import SimpleNamespace

    from trainer.engine.native import NativeEngine
    from trainer.loop import engine_options

    flags = SimpleNamespace(rollout_compile=False, rollout_precision="default", max_sequence_length=None,
                            sglang_attention_backend=None)
    assert engine_options(flags) == {}
    options = engine_options(SimpleNamespace(**{**vars(flags), "max_sequence_length": 24}))
    assert options == {"max_sequence_length": 24}
    engine = NativeEngine(str(tiny_flux_dir), device="cpu", dtype=torch.float32, adapter=adapter, **options)
    assert engine.encode_prompt("a red ball")["prompt_embeds"].shape[0] == 24
    assert NativeEngine(str(tiny_flux_dir), device="cpu", dtype=torch.float32,
                        adapter=adapter).max_sequence_length == adapter.max_sequence_length == 512
