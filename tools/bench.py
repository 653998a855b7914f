"""Time the project's own engine, actor and weight sync at Qwen-Image shape, with random weights.

    torchrun --nproc-per-node 1 tools/bench.py --shape real --output bench/results/h200x1.jsonl
    torchrun --nproc-per-node 2 tools/bench.py --shape real --full --output bench/results/h200x2.jsonl
    python tools/bench.py                                  (smoke test: the tiny shape, on CPU here)

--shape defaults to tiny, the family's test model: the real shape is a deliberate choice of a GPU
machine, and it is refused before anything is allocated when its parameters alone cannot fit in the
device's free memory (host RAM on CPU) -- a 20 B model built on a shared CPU host would otherwise
grow until the kernel's OOM killer ends it and disturbs everything else running there.

Optional: --replay-variants (LoRA replay without reshard after forward, with checkpointing on every
other block, without checkpointing), --profile-replay PATH (an op table of one replay micro-batch),
--profile-rollout PATH (an op table of one DiT forward at the rollout's batch, with the speed options,
and the kernels' shares in GEMMs, attention, the FP8 activation quantization and the rest), --gemms
(each of the blocks' linear GEMMs at the rollout's batch in bf16, FP8 rowwise with and without its
activation quantization, and FP8 with one scale per tensor: how far the FP8 rollout's GEMMs are
from the tensor cores; and the activation quantization alone at each GEMM input, beside a copy),
--replay-precision fp8 / fp8-dgrad (the LoRA actor's frozen base GEMMs in FP8, with fp8-dgrad
their input gradient too, as the trainer's flag: every replay, update and step figure then times
it, and replay_fp8_grad_rel_diff compares its LoRA gradient with the compute dtype's on one
micro-batch).

The step (step_s, split into rollout / reward / update / sync) is timed top to bottom as
trainer/loop.py runs it, for each of --algorithms (flowgrpo: the SDE rollout and Actor.train_step,
once per --old-logprob-source, with the on-policy figures beside it in step_onpolicy; nft: the ODE
rollout and Actor.nft_train_step on an actor of its own), each with the speed options. The figures
of both algorithms and both pi_old sources at the full 60-block shape, one H200, in one process:

    torchrun --nproc-per-node 1 tools/bench.py --shape real --rollout-compile --rollout-precision fp8 \
        --fsdp-compile --algorithms flowgrpo nft --old-logprob-source replay rollout --iters 1 \
        --skip dit checksum merged replay update offload --output bench/results/h200x1_steps.jsonl

--family sd3 times the Stable Diffusion 3.5 family instead (tools/bench_sd3.py: SD3.5-Medium's
2.24 B MMDiT-X, CLIP-L + CLIP-G + T5-XXL, its FLOP model); with --flowgrpo-path DIR it also times
FlowGRPO's own SD3 rollout function, imported from that checkout, on the same modules:

    torchrun --nproc-per-node 1 tools/bench.py --family sd3 --shape real --height 512 --width 512 \
        --steps 10 --guidance-scale 4.5 --flowgrpo-path runs/flow_grpo --output bench/results/sd3.jsonl

--family flux times FLUX.1-dev (tools/bench_flux.py: its 11.9 B DiT, CLIP-L + T5-XXL, its FLOP model;
--text-tokens is its T5 window). --family qwen_image_edit times Qwen-Image-Edit-2511 editing
(tools/bench_edit.py's modules: Qwen-Image's DiT with zero_cond_t, Qwen2.5-VL with its vision tower):
one random source per prompt at the output size, so the DiT's sequence is twice the target's
tokens (image_tokens counts both) and the text holds the source's vision tokens; its comparison
with diffusers' QwenImageEditPlusPipeline is tools/bench_edit.py's. --family flux_kontext times
FLUX.1-Kontext editing the same way on FLUX.1-dev's modules (Kontext-dev's architecture), the
source's packed tokens after the target's. Every family runs the same
phases below (family_parts says what differs), the speed options included; --compare is
Qwen-Image's only.

--family wan times Wan2.1 text-to-video (tools/bench_wan.py's modules: the 1.3B or, with --wan-size
14b, the 14B WanTransformer3DModel, Wan2.1's fp32 VAE, random prompt embeddings of --text-tokens
(512, the UMT5 window) in place of UMT5-XXL) at --frames x --height x --width (4k+1 frames,
multiples of 16; real default FlowGRPO's 33 x 240 x 416), FlowGRPO's Wan SDE (sde_type "wan");
the reward scores 8 evenly spaced frames of each decoded video with the colour scorer (the
trainer's framewise route), and every figure's geometry carries frames. The image families
refuse --frames other than 1. The step of a video is minutes at real shape: keep --prompts x
--group-size and --trained-steps small (docs/video.md gives commands that fit a few minutes).

--skip eager leaves out the eager DiT forward and rollout timed before the speed options
(--rollout-compile / --rollout-precision fp8) are switched on; the rollout with them still runs.

Nothing is read from disk: every module (the 20.4 B DiT, the VAE, the Qwen2.5-VL-7B text
encoder) is built on the meta device from its config, materialised on the rank's device with
`to_empty`, then given cheap random values there (`materialise`). The code being timed is the
project's: `NativeEngine` (trainer/engine/native.py) generates, `Actor` (trainer/actor.py)
replays and updates through the adapter's `replay_transition`, `WeightSyncer`
(trainer/weight_sync.py) hands weights over, `ColorScorer` + `compute_advantages` score.

Every figure is one JSON line, printed by rank 0 and appended to --output:

    {"figure": name, "value": v, "unit": u, "device": ..., "world_size": n, "geometry": {...}, ...}

Times are the MAX over ranks (a step waits for its slowest rank), each phase is warmed up
before it is timed, and CUDA is synchronised around every timer. docs/PERFORMANCE.md describes
the figures, the FLOP model and the method.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

if __package__ in (None, ""):  # run as a script (torchrun tools/bench.py): this checkout's trainer and tools
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.cli import tool_parser  # noqa: E402

# ----------------------------------------------------------------------------------------------
# shapes

#: QwenImageTransformer2DModel of Qwen-Image (20.43 B parameters); equal to diffusers' defaults
REAL_TRANSFORMER_CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                               num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                               axes_dims_rope=(16, 56, 56))
#: AutoencoderKLQwenImage defaults are Qwen-Image's VAE (base_dim 96, z_dim 16, 8x spatial)
REAL_VAE_CONFIG: dict[str, Any] = {}
#: Qwen2.5-VL-7B-Instruct, the Qwen-Image text encoder (text model + vision tower)
REAL_TEXT_CONFIG = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                        rms_norm_eps=1e-6, rope_theta=1000000.0, mrope_section=[16, 24, 24])
REAL_VISION_CONFIG = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
#: the tiny test model's text encoder (tools/make_tiny_model.py builds the same sizes)
TINY_TEXT_CONFIG = dict(vocab_size=None, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                        rms_norm_eps=1e-6, rope_theta=1000000.0, mrope_section=[1, 1, 2])
TINY_VISION_CONFIG = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          fullatt_block_indexes=[1])

SHAPES = ("real", "tiny")
#: --compare: other code timed on the engine's own modules
COMPARE_PATHS = ("diffusers", "flowgrpo")
#: --family: the DiT families the bench builds
FAMILIES = ("qwen_image", "sd3", "flux", "qwen_image_edit", "flux_kontext", "wan")
#: --family wan --shape real: the published Wan2.1 text-to-video sizes (tools/bench_wan.py's SIZES)
WAN_SIZES = ("1.3b", "14b")
#: phases --skip can leave out ("eager": the eager rollout timed before the speed options; "fp8_grad":
#: the --replay-precision fp8 / fp8-dgrad gradient comparison)
SKIPPABLE = ("dit", "checksum", "merged", "replay", "update", "adapter", "offload", "step", "eager", "fp8_grad")
#: --replay-variants: figure suffix -> (reshard after forward, activation checkpointing, checkpoint every k-th block)
REPLAY_VARIANTS = {"noreshard": (False, None, 1), "ac_every2": (True, True, 2), "ac_none": (True, False, 1)}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def shape_configs(shape: str) -> tuple[dict, dict, dict, dict]:
    """(transformer, vae, text, vision) configs of `shape` ("real" | "tiny")."""
    from tools.make_tiny_model import TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG

    if shape == "real":
        return dict(REAL_TRANSFORMER_CONFIG), dict(REAL_VAE_CONFIG), dict(REAL_TEXT_CONFIG), dict(REAL_VISION_CONFIG)
    if shape == "tiny":
        return dict(TINY_TRANSFORMER_CONFIG), dict(TINY_VAE_CONFIG), dict(TINY_TEXT_CONFIG), dict(TINY_VISION_CONFIG)
    raise ValueError(f"--shape must be one of {SHAPES}, got {shape!r}")


# ----------------------------------------------------------------------------------------------
# the FLOP model (pure; docs/PERFORMANCE.md derives it)

def dit_param_counts(cfg: dict) -> dict[str, int]:
    """Parameters of a Qwen-Image DiT config, split by what each one multiplies.

    d = heads * head_dim, f = 4d (diffusers FeedForward), L = num_layers, p = patch_size.
    image   weights every image token meets: per block to_q/k/v, to_out.0 (4 d^2) and img_mlp
            (2 d f); plus img_in (in_channels * d) and proj_out (d * p^2 * out_channels);
    text    weights every text token meets: per block add_q/k/v_proj, to_add_out, txt_mlp; plus
            txt_in (joint_attention_dim * d);
    sample  weights applied once per sample (to the timestep embedding): per block img_mod and
            txt_mod (2 * 6 d^2), the timestep MLP (256 d + d^2) and norm_out (2 d^2);
    bias, norm  bias vectors and RMSNorm weights (elementwise work; not in the FLOP count);
    total   everything (20.43 B at the real shape).
    """
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    f = 4 * d
    n_layers = int(cfg["num_layers"])
    p2_out = int(cfg["patch_size"]) ** 2 * int(cfg.get("out_channels") or cfg["in_channels"])
    stream_block = 4 * d * d + 2 * d * f
    image = n_layers * stream_block + int(cfg["in_channels"]) * d + d * p2_out
    text = n_layers * stream_block + int(cfg["joint_attention_dim"]) * d
    sample = n_layers * 2 * 6 * d * d + 256 * d + d * d + 2 * d * d
    bias = (2 * n_layers * (4 * d + f + d) + d + p2_out + d  # streams: projections, mlp, img_in, proj_out, txt_in
            + n_layers * 2 * 6 * d + 2 * d + 2 * d)           # mods, timestep MLP, norm_out
    norm = n_layers * 4 * int(cfg["attention_head_dim"]) + int(cfg["joint_attention_dim"])
    return {"image": image, "text": text, "sample": sample, "bias": bias, "norm": norm,
            "total": image + text + sample + bias + norm}


def dit_forward_flops(cfg: dict, image_tokens: int, text_tokens: int, batch: int = 1) -> float:
    """FLOPs of one DiT forward over `batch` samples (matmuls only, multiply-add = 2 FLOPs).

        F = batch * [ 2 * (P_image * N_img + P_text * N_txt + P_sample)
                      + 4 * (N_img + N_txt)^2 * d * L ]

    The dual-stream MMDiT sends an image token only through image-stream weights and a text
    token only through text-stream weights; the AdaLN *_mod linears run once per sample; joint
    attention costs 2 * L_tot^2 * d for Q K^T and as much for P V per layer. Real shape, 384x384
    (576 image + 128 text tokens), batch 1: 9.95e12.
    """
    c = dit_param_counts(cfg)
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    seq = int(image_tokens) + int(text_tokens)
    linear = 2.0 * (c["image"] * image_tokens + c["text"] * text_tokens + c["sample"])
    attention = 4.0 * seq * seq * d * int(cfg["num_layers"])
    return float(batch) * (linear + attention)


def replay_flops(cfg: dict, image_tokens: int, text_tokens: int, transitions: int = 1,
                 checkpointing: bool | float = True, forward_flops: Callable[..., float] | None = None
                 ) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of replaying `transitions` transitions with a backward.

    Model FLOPs = 3 F (forward + a backward counted as 2 forwards); hardware FLOPs add the
    forward that activation checkpointing recomputes (4 F; a float is the fraction of the blocks
    checkpointed: 3 F + fraction * F). LoRA's backward skips the frozen base weights' gradients,
    so for LoRA this convention over-counts the true work by ~F. forward_flops: the family's F
    (default dit_forward_flops, Qwen-Image's).
    """
    f = (forward_flops or dit_forward_flops)(cfg, image_tokens, text_tokens, transitions)
    return 3.0 * f, (3.0 + float(checkpointing)) * f


def image_tokens_for(height: int, width: int, vae_scale_factor: int, patch_size: int = 2) -> int:
    """Packed image tokens of a height x width image: (H / (vsf * p)) * (W / (vsf * p))."""
    f = vae_scale_factor * patch_size
    return (int(height) // f) * (int(width) // f)


# ----------------------------------------------------------------------------------------------
# building random modules without files

def _meta_build(factory: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    """factory() on the meta device (no memory, no init), floating parameters cast to `dtype`."""
    with torch.device("meta"):
        module = factory()
    for p in module.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return module


def _fill_random(module: torch.nn.Module) -> None:
    """Cheap random values for every parameter, on its device: torch's own reset_parameters()
    where a module has one (Linear, Conv, Embedding, LayerNorm: the default init), else ones for
    1-D norm weights / gains, zeros for biases, N(0, 1/fan_in) for matrices. Finite and O(1)
    activations are all that matters: timings do not depend on the values."""
    done: set[int] = set()
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if own and callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
            done.update(id(p) for p in own)
    for name, p in module.named_parameters():
        if id(p) in done:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("bias"):
            p.zero_()
        elif p.dim() <= 1 or leaf == "gamma":  # norm gains (the VAE's RMS_norm keeps [C, 1, 1(, 1)] gammas)
            p.fill_(1.0)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(max(p[0].numel(), 1)))


def _recompute_plain_tables(module: torch.nn.Module) -> None:
    """Recompute tensors that to_empty cannot restore.

    diffusers' Qwen-Image rope keeps its frequency tables as plain attributes (not buffers: a
    buffer would lose the complex dtype's imaginary part on .to()), so after a meta build they
    are meta tensors: rebuild them on CPU exactly as a normal construction does (the module
    moves them to the device once, lru-cached). transformers' rotary embeddings keep inv_freq as
    non-persistent buffers, which to_empty leaves uninitialised: the model's own _init_weights
    recomputes them."""
    from diffusers.models.transformers import transformer_qwenimage as tq

    rope_types = tuple(t for t in (getattr(tq, "QwenEmbedRope", None), getattr(tq, "QwenEmbedLayer3DRope", None)) if t)
    owner = module if hasattr(module, "_init_weights") else None
    for m in module.modules():
        if rope_types and isinstance(m, rope_types):
            with torch.device("cpu"):
                fresh = type(m)(theta=m.theta, axes_dim=list(m.axes_dim), scale_rope=m.scale_rope)
            m.pos_freqs, m.neg_freqs = fresh.pos_freqs, fresh.neg_freqs
            for cached in ("_get_device_freqs", "_compute_video_freqs"):
                clear = getattr(getattr(m, cached, None), "cache_clear", None)
                if callable(clear):
                    clear()
        elif owner is not None and "RotaryEmbedding" in type(m).__name__ and hasattr(m, "inv_freq"):
            owner._init_weights(m)


def assert_materialised(module: torch.nn.Module, what: str) -> None:
    """Raise if any parameter, buffer or plain tensor attribute of `module` is still on meta."""
    bad = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    for name, m in module.named_modules():
        bad += [f"{name}.{k}" for k, v in vars(m).items() if isinstance(v, torch.Tensor) and v.is_meta]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} tensor(s) still on the meta device after materialising, e.g. "
                           f"{bad[:3]}; add their recomputation to tools/bench.py:_recompute_plain_tables")


def materialise(factory: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype, seed: int,
                what: str) -> torch.nn.Module:
    """Build `factory()` on meta, allocate it on `device` (to_empty), fill it with random values,
    recompute its rope tables; eval mode, no grad. Deterministic in `seed` on one device type."""
    module = _meta_build(factory, dtype)
    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        _fill_random(module)
        _recompute_plain_tables(module)
    assert_materialised(module, what)
    return module.eval().requires_grad_(False)


def build_transformer(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The Qwen-Image DiT of `shape` with random weights on `device`."""
    from diffusers import QwenImageTransformer2DModel

    cfg = shape_configs(shape)[0]
    return materialise(lambda: QwenImageTransformer2DModel(**cfg), device, dtype, seed, f"{shape} transformer")


def build_vae(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 1) -> torch.nn.Module:
    from diffusers import AutoencoderKLQwenImage

    cfg = shape_configs(shape)[1]
    return materialise(lambda: AutoencoderKLQwenImage(**cfg), device, dtype, seed, f"{shape} VAE")


def text_encoder_config(shape: str, tokenizer):
    """Qwen2_5_VLConfig of `shape`; special-token ids are the (byte-level) tokenizer's own."""
    from transformers import Qwen2_5_VLConfig

    from tools.make_tiny_model import QWEN_SPECIAL_TOKENS

    _, _, text, vision = shape_configs(shape)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(text)
    text["vocab_size"] = text["vocab_size"] or len(tokenizer)
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "mrope_section": text.pop("mrope_section")}
    return Qwen2_5_VLConfig(
        text_config=dict(text, rope_parameters=rope, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def build_text_encoder(shape: str, tokenizer, device: torch.device, dtype: torch.dtype, seed: int = 2):
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = text_encoder_config(shape, tokenizer)
    return materialise(lambda: Qwen2_5_VLForConditionalGeneration(config), device, dtype, seed,
                       f"{shape} text encoder")


def build_engine(shape: str, device: torch.device, dtype: torch.dtype, max_batch_size: int, seed: int = 0):
    """NativeEngine over a random `shape` pipeline built on `device` (DiT seeded with `seed`)."""
    from tools.make_tiny_model import QWEN_IMAGE_SCHEDULER_CONFIG, build_tokenizer
    from trainer.engine.native import NativeEngine

    tokenizer = build_tokenizer()
    transformer = build_transformer(shape, device, dtype, seed)
    vae = build_vae(shape, device, dtype, seed + 1)
    text_encoder = build_text_encoder(shape, tokenizer, device, dtype, seed + 2)
    return NativeEngine.from_modules(transformer, vae, text_encoder, tokenizer, QWEN_IMAGE_SCHEDULER_CONFIG,
                                     device=device, dtype=dtype, max_batch_size=max_batch_size)


def family_parts(family: str, *, wan_size: str = "1.3b", frames: int = 1) -> SimpleNamespace:
    """What --family changes in the bench; main runs the same phases over these for every family.
    wan_size (SIZES of tools/bench_wan.py: "1.3b", "14b", "tiny") and frames: --family wan's model
    and video length (the other families draw one frame).

    build_engine(shape, device, dtype, max_batch, seed=, text_tokens=): the random NativeEngine
        (text_tokens: the T5 window a family pads every prompt to, FLUX's; the other families'
        prompts set their own length);
    build_transformer(shape, device, dtype, seed=): the DiT alone (the actor's, seeded like the engine's);
    adapter: the adapter class; forward_flops(cfg, image_tokens, text_tokens, batch): the FLOP
        model of one DiT forward; prompts(engine, n, text_tokens): the rollout's prompts (Qwen-Image's
        also take one length per prompt and salt=, another set of the same lengths);
    sampling: sampling-config keys the family needs; transformer_config(shape): the DiT's config;
    real_param_counts(): (DiT, VAE + text encoders) parameters of the real shape, counted on meta;
    image_tokens(height, width, vae_scale_factor, dit_cfg): tokens of the DiT's image sequence;
    geometry(dit_cfg): extra keys of every figure's geometry;
    sources(directory, n, size): an editing family's source files, one per prompt (absent: t2i);
    video: whether the engine draws videos (scored frame by frame, score()); items: what the
        rollout figures count ("images" or "videos")."""
    def tokens(height, width, vae_scale_factor, dit_cfg):
        return image_tokens_for(height, width, vae_scale_factor, int(dit_cfg["patch_size"]))

    if family in ("flux", "flux_kontext"):
        from tools import bench_flux
        from trainer.models.flux import FluxAdapter

        adapter_cls = FluxAdapter
        if family == "flux_kontext":
            from tools import bench_edit
            from trainer.models.flux_kontext import FluxKontextAdapter as adapter_cls

        def flux_engine(shape, device, dtype, max_batch_size, seed=0, text_tokens=FluxAdapter.max_sequence_length):
            return bench_flux.build_flux_engine(shape, device, dtype, max_batch_size, text_tokens, seed=seed,
                                                adapter=adapter_cls())

        # FluxPipeline packs 2 x 2 latent patches into one token (the DiT's own patch_size is 1);
        # Kontext's sequence is the target's tokens, then the source's at the same size
        per_image = 2 if family == "flux_kontext" else 1
        parts = SimpleNamespace(
            build_engine=flux_engine, build_transformer=bench_flux.build_flux_transformer, adapter=adapter_cls,
            real_param_counts=bench_flux.real_param_counts,
            forward_flops=bench_flux.flux_forward_flops,
            prompts=lambda engine, n, text_tokens: bench_flux.flux_prompts(n), sampling={},
            transformer_config=lambda shape: bench_flux.flux_shape_configs(shape)[0],
            image_tokens=lambda height, width, vae_scale_factor, dit_cfg: per_image * image_tokens_for(
                height, width, vae_scale_factor, 2),
            geometry=lambda dit_cfg: {"embedded_guidance": True,
                                      "dit_single_layers": int(dit_cfg["num_single_layers"]),
                                      **({"sources_per_prompt": 1} if family == "flux_kontext" else {})})
        if family == "flux_kontext":
            parts.prompts = lambda engine, n, text_tokens: [f"<image> make ball number {i} red" for i in range(n)]
            parts.sources = lambda directory, n, size: bench_edit.write_sources(Path(directory), n, size)
        return parts
    if family == "wan":
        from tools import bench_wan
        from trainer.models.wan import WanAdapter
        from trainer.video import candidate_noise_shape, latent_frames, token_count

        def wan_engine(shape, device, dtype, max_batch_size, seed=0, text_tokens=WanAdapter.max_sequence_length):
            model = bench_wan.build_transformer(wan_size, dtype, device, seed=seed)
            vae = bench_wan.build_vae(wan_size, device, seed=seed + 1)
            return bench_wan.build_wan_engine(model, vae, device, dtype, text_tokens, max_batch_size)

        def wan_transformer(shape, device, dtype, seed=0):
            return bench_wan.build_transformer(wan_size, dtype, device, seed=seed)

        def wan_tokens(height, width, vae_scale_factor, dit_cfg):
            latent = candidate_noise_shape(frames, height, width, channels=int(dit_cfg["in_channels"]),
                                           spatial=vae_scale_factor)
            return token_count(latent, tuple(int(v) for v in dit_cfg["patch_size"]))

        return SimpleNamespace(
            build_engine=wan_engine, build_transformer=wan_transformer, adapter=WanAdapter,
            forward_flops=bench_wan.wan_forward_flops,
            real_param_counts=lambda: bench_wan.real_param_counts(wan_size),
            # a palette colour per prompt: the framewise colour reward scores every candidate; the
            # prompt embeddings are random per prompt (UMT5-XXL is not run), --text-tokens long
            prompts=lambda engine, n, text_tokens: [f"a {_COLOURS[i % len(_COLOURS)]} ball number {i}"
                                                    for i in range(n)],
            sampling={"num_frames": frames, "negative_prompt": "", "cfg_renorm": False, "sde_type": "wan"},
            transformer_config=lambda shape: dict(bench_wan.SIZES[wan_size]), image_tokens=wan_tokens,
            geometry=lambda dit_cfg: {"frames": frames, "latent_frames": latent_frames(frames),
                                      "wan_size": wan_size, "text_encoder": "random embeddings (UMT5 not run)"},
            video=True, items="videos")
    if family == "qwen_image_edit":
        from tools import bench_edit
        from tools.tiny_qwen_image_edit import edit_transformer_config
        from trainer.models.qwen_image_edit import QwenImageEditAdapter

        def edit_transformer(shape, device, dtype, seed=0):
            from diffusers import QwenImageTransformer2DModel

            cfg = edit_transformer_config(shape_configs(shape)[0], "2511")
            return materialise(lambda: QwenImageTransformer2DModel(**cfg), device, dtype, seed,
                               f"{shape} edit transformer")

        def edit_engine(shape, device, dtype, max_batch_size, seed=0, text_tokens=None):
            return bench_edit.build_edit_engine(shape, device, dtype, max_batch_size, seed=seed)

        return SimpleNamespace(
            build_engine=edit_engine, build_transformer=edit_transformer, adapter=QwenImageEditAdapter,
            forward_flops=dit_forward_flops, real_param_counts=real_param_counts,
            # the instruction with its source's vision tokens sets the text length (--text-tokens unused)
            prompts=lambda engine, n, text_tokens: [f"<image> make ball number {i} red" for i in range(n)],
            sampling={"negative_prompt": " "},
            transformer_config=lambda shape: edit_transformer_config(shape_configs(shape)[0], "2511"),
            # the DiT's sequence: the target's tokens, then the source's at the same size
            image_tokens=lambda height, width, vae_scale_factor, dit_cfg: 2 * tokens(height, width, vae_scale_factor,
                                                                                     dit_cfg),
            geometry=lambda dit_cfg: {"variant": "2511", "sources_per_prompt": 1},
            sources=lambda directory, n, size: bench_edit.write_sources(Path(directory), n, size))
    if family == "sd3":
        from tools import bench_sd3
        from trainer.models.sd3 import SD3Adapter

        def sd3_engine(shape, device, dtype, max_batch_size, seed=0, text_tokens=None):
            return bench_sd3.build_sd3_engine(shape, device, dtype, max_batch_size, seed=seed)

        return SimpleNamespace(build_engine=sd3_engine, build_transformer=bench_sd3.build_sd3_transformer,
                               adapter=SD3Adapter, forward_flops=bench_sd3.sd3_forward_flops,
                               real_param_counts=bench_sd3.real_param_counts,
                               prompts=lambda engine, n, text_tokens: bench_sd3.sd3_prompts(n),
                               sampling={"cfg_renorm": False, "negative_prompt": ""},
                               transformer_config=bench_sd3.transformer_config, image_tokens=tokens,
                               geometry=lambda dit_cfg: {})
    from trainer.models.qwen_image import QwenImageAdapter

    def prompts(engine, n, text_tokens, salt=""):
        encoder = engine.prompt_encoder
        return make_prompts(n, engine.tokenizer, encoder.template, encoder.template_start_idx, text_tokens, salt)

    def qwen_engine(shape, device, dtype, max_batch_size, seed=0, text_tokens=None):
        return build_engine(shape, device, dtype, max_batch_size, seed=seed)

    return SimpleNamespace(build_engine=qwen_engine, build_transformer=build_transformer, adapter=QwenImageAdapter,
                           forward_flops=dit_forward_flops, prompts=prompts, sampling={},
                           real_param_counts=real_param_counts,
                           transformer_config=lambda shape: shape_configs(shape)[0], image_tokens=tokens,
                           geometry=lambda dit_cfg: {})


# ----------------------------------------------------------------------------------------------
# figures

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed(device: torch.device) -> Iterator[list[float]]:
    """with timed(dev) as t: ...; t[0] is the wall time, device-synchronised at both ends."""
    out = [0.0]
    _sync(device)
    start = time.perf_counter()
    yield out
    _sync(device)
    out[0] = time.perf_counter() - start


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


@dataclass
class Reporter:
    """Emits figures: one JSON line each, printed and appended to `out` by rank 0.

    Reductions across ranks are collective: every rank must call emit() for every figure.
    """

    out: Path | None
    device: torch.device
    geometry: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    lines: list[dict[str, Any]] = field(default_factory=list)
    #: bytes: the phase's peak before the last stage_peak reset it (peak_gb takes it in)
    peak_floor: int = 0

    def reduce(self, value: float, op: str) -> float:
        """MAX / MIN / MEAN of a scalar over ranks (no-op unlaunched)."""
        from trainer.distributed import all_reduce_max, all_reduce_sum, collective_device

        if self.world_size == 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=collective_device())
        if op == "max":
            return float(all_reduce_max(t)[0])
        if op == "min":
            return -float(all_reduce_max(-t)[0])
        return float(all_reduce_sum(t)[0]) / self.world_size

    def emit(self, figure: str, value: float | None, unit: str, op: str = "max", **extra: Any) -> dict[str, Any]:
        """value None: a figure that could not be measured (e.g. out of memory on every rank); the
        caller agrees on it over ranks first."""
        value = None if value is None else self.reduce(value, op)
        line = {"figure": figure, "value": value, "unit": unit, "device": device_name(self.device),
                "world_size": self.world_size, "geometry": dict(self.geometry), **extra}
        self.lines.append(line)
        if self.rank == 0:
            text = json.dumps(line, sort_keys=False)
            print(text, flush=True)
            if self.out is not None:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                with open(self.out, "a") as f:
                    f.write(text + "\n")
        return line

    def peak_gb(self) -> float | None:
        """The device's peak allocated memory (GB) since the last phase_memory; None off CUDA."""
        if self.device.type != "cuda":
            return None
        return max(self.peak_floor, torch.cuda.max_memory_allocated(self.device)) / 1e9

    def phase_memory(self, phase: str) -> None:
        """peak_mem_<phase> (GB, max over ranks) since the last reset; resets the peak. CUDA only."""
        if self.device.type != "cuda":
            return
        self.emit(f"peak_mem_{phase}", self.peak_gb(), "GB")
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_floor = 0

    @contextlib.contextmanager
    def stage_peak(self, name: str, out: dict[str, float] | None) -> Iterator[None]:
        """out[name] = the peak allocated memory (GB) of the work inside, on its own; the phase's
        peak (peak_gb, phase_memory) still covers it. CUDA only (out unchanged elsewhere, and
        nothing measured for out None)."""
        if out is None or self.device.type != "cuda":
            yield
            return
        self.peak_floor = max(self.peak_floor, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        out[name] = torch.cuda.max_memory_allocated(self.device) / 1e9


#: untimed warm-up steps at most before a compiled step is timed (phase_step): each one that still
#: compiles a graph is followed by another
MAX_WARM_UP_STEPS = 4
#: steps tried at most for the timed one (phase_step): one that compiled a graph is followed by another
MAX_TIMED_ATTEMPTS = 3


class RankCompileWatch:
    """trainer.core.modules.CompileWatch with its count the max over ranks, so that every rank of
    a launched bench takes the same number of steps in until_steady."""

    def __init__(self, rep: Any) -> None:
        from trainer.core.modules import CompileWatch

        self.rep, self.watch = rep, CompileWatch()

    def new_graphs(self) -> int:
        return int(self.rep.reduce(self.watch.new_graphs(), "max"))


def until_steady(step: Callable[[int], Any], watch: Any, tries: int) -> Iterator[tuple[int, Any, int | None, bool]]:
    """step(0), step(1), ... until one compiles no graph, `tries` at most: yields (i, step(i), the
    graphs it compiled (None without a CompileWatch), whether it is the last) after each."""
    for i in range(tries):
        result = step(i)
        new = watch.new_graphs() if watch is not None else None
        last = not new or i == tries - 1
        yield i, result, new, last
        if last:
            return


def alloc_retries(device: torch.device) -> int | None:
    """The caching allocator's count of allocations it retried after freeing its cache (CUDA only):
    a step near the card's limit that retries pays a device-wide synchronisation and cudaFree each
    time, which its stage times show but do not name."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int = 50) -> float:
    """Measured dense GEMM throughput (TFLOP/s) of n x n x n in `dtype`: the MFU denominator
    unless --peak-tflops is given."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    with timed(device) as t:
        for _ in range(iters):
            a @ b
    return 2.0 * n ** 3 * iters / t[0] / 1e12


# ----------------------------------------------------------------------------------------------
# the workload

#: prompts name a palette colour so ColorScorer scores every candidate (a NaN would fail a group)
_COLOURS = ("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple")


def make_prompts(n: int, tokenizer, template: str, start_idx: int, text_tokens: int | Sequence[int],
                 salt: str = "") -> list[str]:
    """n distinct prompts whose encoded conditioning (template suffix included, prefix dropped)
    is `text_tokens` tokens long under `tokenizer` (one length for all, or one per prompt), so the
    DiT sees the intended text length; `salt` makes another set of prompts of the same lengths."""
    lengths = [int(text_tokens)] * n if isinstance(text_tokens, int) else [int(t) for t in text_tokens]
    out = []
    for i, text_tokens in enumerate(lengths):
        base = f"a {_COLOURS[i % len(_COLOURS)]} ball number {i}{salt}"
        words = base
        filler = " on a wide green field under a blue sky"
        while True:
            ids = tokenizer(template.format(words), add_special_tokens=False)["input_ids"]
            if len(ids) - start_idx >= text_tokens:
                break
            words += filler
        while len(tokenizer(template.format(words), add_special_tokens=False)["input_ids"]) - start_idx > text_tokens \
                and len(words) > len(base):
            words = words[:-1]
        out.append(words)
    return out


def spread_lengths(n: int, text_tokens: int, spread: int, rollout_id: int, seed: int) -> list[int]:
    """--text-tokens-spread: rollout `rollout_id`'s n prompt lengths, drawn uniformly from
    [text_tokens - spread, text_tokens] by (seed, rollout_id), so every rollout brings new ones
    (as a run's prompts do), and the same ones in every run."""
    import random

    rng = random.Random(f"{seed}:{rollout_id}")
    return [rng.randint(text_tokens - spread, text_tokens) for _ in range(n)]


def build_requests(engine, adapter, sampling, prompts: Sequence[str], group_size: int, sde_indices: list[int],
                   seed: int, rollout_id: int, media: Sequence[str] | None = None) -> list:
    """The rollout's RolloutRequests: prompts x group_size candidates, group-major; `media`: an
    editing family's source file of each prompt (None for text-to-image)."""
    import dataclasses

    sigmas = engine.sigma_schedule(sampling.height, sampling.width, sampling.num_inference_steps)
    reqs = [adapter.build_rollout_request(p, group_index=g, slot=s, sample_id=f"bench:{rollout_id}:{g}:{s}",
                                          sampling=sampling, sde_indices=sde_indices, sigmas=sigmas,
                                          generation_seed=seed)
            for g, p in enumerate(prompts) for s in range(group_size)]
    if media:
        reqs = [dataclasses.replace(r, media=[media[r.group_index]]) for r in reqs]
    return reqs


#: --algorithms nft's advantage clip: the DiffusionNFT recipe's (configs/tiny_cpu_demo_nft.toml); the
#: config's default 0 is refused with --algorithm nft (the optimality probability divides by it)
NFT_ADV_CLIP_MAX = 5.0


def parts_of(args) -> SimpleNamespace:
    """family_parts of the parsed flags (--family, and --wan-size / --frames for --family wan)."""
    if args.family != "wan":
        return family_parts(args.family)
    return family_parts("wan", wan_size="tiny" if args.shape == "tiny" else args.wan_size, frames=args.frames)


def actor_cfg(args, mode: str, algorithm: str = "flowgrpo"):
    """The config sections Actor reads, from trainer/config.py's own dataclasses. algorithm "nft":
    --algorithm nft with the config's defaults for every --nft-* option (--nft-timestep-fraction
    as the bench's flag says) and NFT_ADV_CLIP_MAX."""
    from types import SimpleNamespace

    from trainer.config import FsdpConfig, GrpoConfig, LoraConfig, OptimConfig

    lora = mode == "lora"
    nft = {} if algorithm == "flowgrpo" else dict(
        algorithm="nft", adv_clip_max=NFT_ADV_CLIP_MAX,
        nft_timestep_fraction=float(getattr(args, "nft_timestep_fraction", GrpoConfig.nft_timestep_fraction)),
        nft_sigmas_per_forward=int(getattr(args, "nft_sigmas_per_forward", GrpoConfig.nft_sigmas_per_forward)))
    fsdp = FsdpConfig(fsdp_trainable_mode=mode, fsdp_param_dtype=args.dtype, fsdp_reduce_dtype="fp32",
                      fsdp_master_dtype="fp32" if lora else None,
                      fsdp_activation_checkpointing=not args.no_activation_checkpointing,
                      fsdp_compile=bool(getattr(args, "fsdp_compile", False)),
                      fsdp_frozen_params=getattr(args, "fsdp_frozen_params", "auto"),
                      replay_precision=getattr(args, "replay_precision", "default") if lora else "default",
                      replay_fp8_layers=args.replay_fp8_variants[0][0] if getattr(args, "replay_fp8_variants", None)
                      else getattr(args, "replay_fp8_layers", "lora-base"),
                      fp8_fast_accum=args.replay_fp8_variants[0][2] == "fast"
                      if getattr(args, "replay_fp8_variants", None) else bool(getattr(args, "fp8_fast_accum", False)))
    return SimpleNamespace(
        fsdp=fsdp,
        lora=LoraConfig(lora_rank=args.lora_rank if lora else 0, lora_alpha=args.lora_alpha, lora_adapter_mode=lora),
        optim=OptimConfig(lr=3e-4 if lora else 1e-5, weight_decay=0.0, adam_eps=1e-8 if lora else 1e-15,
                          adam_fused=bool(getattr(args, "adam_fused", False))),
        grpo=GrpoConfig(eps_clip=1e-4, num_updates_per_batch=args.num_updates, micro_batch_size=args.micro_batch,
                        **nft))


def buffers_to(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its floating buffers (SD3's sincos position table) in `dtype`, as
    from_pretrained(dtype) leaves them when the loop loads the actor and as the engine holds its
    own; materialise rebuilds them in fp32. Complex tables and parameters are left alone."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)
    return model


def build_actor(args, mode: str, mesh, device: torch.device, dtype: torch.dtype, *, reshard_after_forward: bool = True,
                activation_checkpointing: bool | None = None, activation_checkpointing_every: int | None = None,
                algorithm: str = "flowgrpo"):
    """trainer.actor.Actor over a fresh random DiT seeded like the engine's (same base weights).

    reshard_after_forward / activation_checkpointing / activation_checkpointing_every (None: as
    the args say): the replay variants (--replay-variants); algorithm: the
    update it is built for (actor_cfg; "nft" adds the old policy)."""
    from trainer.actor import Actor, build_train_model

    fam = parts_of(args)
    cfg = actor_cfg(args, mode, algorithm)
    cfg.fsdp.no_fsdp_reshard_after_forward = not reshard_after_forward
    if activation_checkpointing is not None:
        cfg.fsdp.fsdp_activation_checkpointing = activation_checkpointing
    cfg.fsdp.fsdp_activation_checkpointing_every = (args.activation_checkpointing_every
                                                    if activation_checkpointing_every is None
                                                    else activation_checkpointing_every)
    model = buffers_to(fam.build_transformer(args.shape, device, dtype, seed=args.seed), dtype)
    model, lora_config, never_trained = build_train_model(model, mesh, cfg.fsdp, cfg.lora, adapter=fam.adapter())
    return Actor(model, mesh, cfg, device=device, built=True, lora_config=lora_config, never_trained=never_trained)


def _release_host_cache() -> None:
    """Give cached pinned host blocks back to the OS. The offload paths pin tens of GB per phase and
    the caching host allocator keeps (and rounds up) every block, so without this the engine's and
    the actor's offloads would together exceed a 128 GB host. The API moved between releases."""
    if not torch.cuda.is_available():
        return
    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"), (torch._C, "_host_emptyCache")):
        fn = getattr(owner, name, None)
        if callable(fn):
            fn()
            return


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _release_host_cache()


def _mean_time(device: torch.device, fn: Callable[[], Any], iters: int) -> float:
    with timed(device) as t:
        for _ in range(iters):
            fn()
    return t[0] / max(iters, 1)


# ----------------------------------------------------------------------------------------------
# phases

@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    rep: Reporter
    mesh: Any
    engine: Any
    adapter: Any
    sampling: Any
    sde_indices: list[int]
    prompts: list[str]
    dit_cfg: dict
    image_tokens: int
    text_tokens: int
    peak_tflops: float
    #: the family's FLOPs of one DiT forward (cfg, image_tokens, text_tokens, batch)
    forward_flops: Callable[..., float] = None
    #: rollout_images_per_s by variant ("eager", "compile", ...), for the in-process ratios
    images_per_s: dict[str, float] = field(default_factory=dict)
    #: an editing family's source file per prompt (None: text-to-image)
    media: list[str] | None = None
    #: --text-tokens-spread: rollout id -> that rollout's prompts (None: c.prompts in every rollout)
    rollout_prompts: Callable[[int], list[str]] | None = None
    #: the engine draws videos, scored frame by frame (score); the rollout figures count `items`
    video: bool = False
    items: str = "images"
    #: --profile-step: a step was profiled (one per run, the first algorithm / source's)
    step_profiled: bool = False
    #: the actor's FP8 replay layers whose weight's FP8 copy differed from the engine's (share_fp8_weights)
    replay_fp8_mismatched: int = 0
    #: the actor's linked layers whose own weights were freed, and their bytes (share_fp8_weights)
    replay_fp8_released: tuple[int, int] = (0, 0)
    #: the step's FP8 variant, (layers, sharing, accumulation): --replay-fp8-variants' first entry,
    #: then the one phase_steps runs
    replay_fp8_variant: tuple[str, str, str] = ("lora-base", "on", "full")
    #: --profile-step with several FP8 replay variants: each one's profile path gets this suffix
    profile_suffix: str = ""

    def condition(self, prompt_index: int = 0) -> dict:
        """The engine's conditioning of prompt `prompt_index` (with its source for an edit family)."""
        if self.media:
            return self.engine.encode_condition(self.prompts[prompt_index], [self.media[prompt_index]],
                                                (self.sampling.height, self.sampling.width))
        return self.engine.encode_prompt(self.prompts[prompt_index])


def rollout_variant(args) -> str:
    """The figures' name of the engine's speed options: "eager", "compile", "fp8", "fp8+compile"."""
    parts = (["fp8"] if args.rollout_precision == "fp8" else []) + (["compile"] if args.rollout_compile else [])
    return "+".join(parts) or "eager"


def dit_call(c: Ctx, b: int, cond: dict | None = None) -> Callable[[], Any]:
    """One no-grad DiT forward of b rows of prompt 0, exactly the engine's rollout call (the
    adapter's velocity, one conditional row per sample, with the embedded guidance of a
    guidance-distilled family: FLUX's), as a callable; its inputs are built once, here. cond:
    prompt 0's conditioning when the caller has it already (else encoded here)."""
    from trainer.engine.base import embedded_guidance_condition
    from trainer.trajectory import SamplerSettings

    a, e = c.args, c.engine
    cond = c.condition(0) if cond is None else cond
    req = build_requests(e, c.adapter, c.sampling, c.prompts[:1], 1, c.sde_indices, a.seed, 0, c.media)[0]
    shape = e.noise_shape(req)  # the engine's own (a video family's [C, F', h, w])
    geometry = req.geometry(e.vae_scale_factor)
    one_row = SamplerSettings(req.num_inference_steps, req.eta)  # guidance 1: one conditional row
    x_t = torch.randn(b, *shape)
    x = e.adapter.initial_latents(x_t, e.transformer, geometry).to(c.device, c.dtype)
    t = torch.full((b,), 500.0)
    conditions = e.adapter.batch_conditions([cond] * b)  # the engine's own batching
    conditions.update(embedded_guidance_condition(req, b, c.device))

    @torch.no_grad()
    def fwd():
        return e.adapter.velocity(e.transformer, x, t, conditions, geometry, one_row)
    return fwd


def phase_dit_forward(c: Ctx, variant: str = "eager") -> None:
    """dit_forward_s and dit_mfu at each --dit-batches size: the engine's rollout call
    (dit_call). A compiled DiT is compiled for each batch size by its first (untimed) call."""
    a = c.args
    cond = c.condition(0)  # encoded once for every batch size
    text_tokens = int(cond["prompt_embeds"].shape[0])
    for b in a.dit_batches:
        fwd = dit_call(c, b, cond)
        fwd()
        sec = c.rep.reduce(_mean_time(c.device, fwd, max(a.iters, 5)), "max")  # cheap: average more
        flops = c.forward_flops(c.dit_cfg, c.image_tokens, text_tokens, b)
        c.rep.emit("dit_forward_s", sec, "s", batch=b, variant=variant)
        c.rep.emit("dit_mfu", flops / sec / 1e12 / c.peak_tflops, "fraction", batch=b,
                   tflop_per_forward=flops / 1e12, peak_tflops=c.peak_tflops, variant=variant)
    c.rep.phase_memory("dit_forward")


#: --gemms: how each of a block's linear GEMMs is timed (see phase_gemms)
GEMM_VARIANTS = ("bf16", "fp8_rowwise", "fp8_rowwise_fast_accum", "fp8_rowwise_quantized", "fp8_tensorwise")


def block_linears(c: Ctx) -> list[dict[str, Any]]:
    """Every nn.Linear of the first block of each repeated block list (FLUX: double- and
    single-stream) as the rollout calls it: name, the module, rows per DiT row (the tokens it
    sees: image, text or one modulation row) and blocks (the list's length), from forward hooks
    on one eager no-grad forward of one row."""
    from trainer.core.modules import repeated_block_lists

    found: list[dict[str, Any]] = []
    hooks = []
    for blocks in repeated_block_lists(c.engine.transformer):
        for name, m in blocks[0].named_modules():
            if isinstance(m, torch.nn.Linear):
                def record(mod, inputs, name=name, n_blocks=len(blocks)):
                    found.append({"name": name, "module": mod, "rows_per_dit_row": inputs[0].shape[:-1].numel(),
                                  "blocks": n_blocks})
                hooks.append(m.register_forward_pre_hook(record))
    try:
        dit_call(c, 1)()
    finally:
        for h in hooks:
            h.remove()
    return found


def _rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|: a GEMM output's largest error on the scale of its largest value."""
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def phase_gemms(c: Ctx, rows: int) -> None:
    """--gemms: the DiT's linear GEMMs one by one at a DiT forward of `rows` rows, in each of
    GEMM_VARIANTS, to show how far the FP8 rollout's GEMMs are from the tensor cores' rate and what
    another scaling would give (gemm_tflops per distinct (M, K, N), with each variant's
    max_rel_error against the fp32 product of the unquantized operands and, for the rowwise FP8
    ones, max_rel_error_dequantized against that of the FP8 operands as dequantized: the
    accumulation's own error; dit_gemms_s: the sum over one forward's blocks, beside
    dit_forward_s):
      bf16                   F.linear in the compute dtype (the eager / compiled rollout);
      fp8_rowwise            torch._scaled_mm alone, one scale per activation row and per weight
                             channel (the --rollout-precision fp8 GEMM, inputs already quantized);
      fp8_rowwise_fast_accum the same with the tensor cores' fast accumulation (--fp8-fast-accum);
      fp8_rowwise_quantized  core.fp8.fp8_linear: the same GEMM with its per-row activation
                             quantization, unfused (what an eager FP8 rollout runs; compiled blocks
                             fuse the quantization into the kernels before it);
      fp8_tensorwise         torch._scaled_mm with one scale per tensor (not an option of the
                             trainer: the ceiling another scaling would reach)."""
    from trainer.core.fp8 import fp8_eligible, fp8_linear, quantize_rowwise

    layers = block_linears(c)
    shapes: dict[tuple[int, int, int], dict[str, Any]] = {}
    for layer in layers:
        mod = layer["module"]
        key = (rows * layer["rows_per_dit_row"], mod.in_features, mod.out_features)
        entry = shapes.setdefault(key, {"names": [], "count": 0, "module": mod})
        entry["names"].append(layer["name"])
        entry["count"] += layer["blocks"]
    iters = max(c.args.iters, 5)
    totals = {v: 0.0 for v in GEMM_VARIANTS}
    timed_all = {v: True for v in GEMM_VARIANTS}
    for (m, k, n), entry in shapes.items():
        w = entry["module"].weight.detach().to(c.dtype)
        x = torch.randn(m, k, device=c.device, dtype=c.dtype)
        fns: dict[str, Callable[[], Any]] = {"bf16": lambda: torch.nn.functional.linear(x, w)}
        ref = torch.nn.functional.linear(x.float(), w.float())  # the exact product, in fp32
        if fp8_eligible(entry["module"]):
            xq, xs = quantize_rowwise(x)
            wq, ws = quantize_rowwise(w)
            ws = ws.reshape(1, -1).contiguous()
            one = torch.ones((), device=c.device, dtype=torch.float32)
            fns["fp8_rowwise"] = lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=c.dtype)
            fns["fp8_rowwise_fast_accum"] = lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                                     out_dtype=c.dtype, use_fast_accum=True)
            fns["fp8_rowwise_quantized"] = lambda: fp8_linear(x, wq, ws, None)
            fns["fp8_tensorwise"] = lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=c.dtype)
            # the exact product of the FP8 operands as dequantized: what an FP8 GEMM's accumulation misses
            dq_ref = torch.nn.functional.linear(xq.float() * xs, wq.float() * ws.reshape(-1, 1))
        for variant in GEMM_VARIANTS:
            if variant not in fns:
                timed_all[variant] = False
                continue
            y = fns[variant]()  # warm-up: cuBLAS / CUTLASS heuristics
            err = None if variant == "fp8_tensorwise" else _rel_error(y, ref)  # unit scales: timing only
            err_dq = _rel_error(y, dq_ref) if variant.startswith("fp8_rowwise") else None
            del y
            sec = c.rep.reduce(_mean_time(c.device, fns[variant], iters), "max")
            totals[variant] += sec * entry["count"]
            c.rep.emit("gemm_tflops", 2.0 * m * k * n / sec / 1e12, "TFLOP/s", op="min", variant=variant,
                       m=m, k=k, n=n, layers=entry["names"], per_forward=entry["count"], seconds=sec,
                       max_rel_error=None if err is None else c.rep.reduce(err, "max"),
                       **({} if err_dq is None else {"max_rel_error_dequantized": c.rep.reduce(err_dq, "max")}))
        del x, fns, ref
        dq_ref = None
    for variant in GEMM_VARIANTS:
        if timed_all[variant]:  # a sum that left out a layer would understate the forward
            c.rep.emit("dit_gemms_s", totals[variant], "s", variant=variant, rows=rows, linears=len(layers),
                       ratio_to_bf16=totals["bf16"] / totals[variant] if totals[variant] else None)
    _time_quantizations(c, [(m, k, e) for (m, k, _), e in shapes.items() if fp8_eligible(e["module"])], iters)
    c.rep.phase_memory("gemms")


def _time_quantizations(c: Ctx, inputs: list[tuple[int, int, dict[str, Any]]], iters: int) -> None:
    """--gemms: the FP8 rollout's per-row activation quantization (core.fp8.quantize_rowwise) alone,
    once per distinct GEMM input [M, K], beside a copy of the same tensor: how far the kernel is
    from the memory's rate (quantize_s). It reads K bf16 values a row and writes K FP8 values and
    one scale, 3 bytes a value at the least, where a copy moves 4. Compiled on CUDA (the kernel
    inductor generates for it, without the elementwise work the rollout's blocks fuse into it),
    eager elsewhere. dit_quantize_s sums one forward's quantizations (one per FP8 linear)."""
    from trainer.core.fp8 import quantize_rowwise

    compiled = c.device.type == "cuda"
    quantize = torch.compile(quantize_rowwise, dynamic=False) if compiled else quantize_rowwise
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for m, k, entry in inputs:  # layers of one input width and row count share an input shape
        e = merged.setdefault((m, k), {"names": [], "count": 0})
        e["names"] += entry["names"]
        e["count"] += entry["count"]
    total = 0.0
    for (m, k), entry in merged.items():
        x = torch.randn(m, k, device=c.device, dtype=c.dtype)
        quantize(x)  # warm-up: compile, autotune
        sec = c.rep.reduce(_mean_time(c.device, lambda: quantize(x), iters), "max")
        copy_s = c.rep.reduce(_mean_time(c.device, x.clone, iters), "max")
        moved = m * k * (x.element_size() + 1) + 4 * m
        total += sec * entry["count"]
        c.rep.emit("quantize_s", sec, "s", m=m, k=k, layers=entry["names"], per_forward=entry["count"],
                   compiled=compiled, bytes=moved, gb_per_s=moved / sec / 1e9, copy_s=copy_s,
                   copy_gb_per_s=2 * x.nbytes / copy_s / 1e9,
                   of_copy_rate=(moved / sec) / (2 * x.nbytes / copy_s))
        del x
    c.rep.emit("dit_quantize_s", total, "s", linears=sum(e["count"] for e in merged.values()), compiled=compiled)


#: --profile-rollout: the kernel (CUDA) or op (CPU) name fragments of each share in dit_profile_s.
#: Inductor names a generated kernel after the ops it fuses ("triton_red_fused__scaled_mm__to_copy_
#: abs_amax_clamp_..."), so its name can hold "scaled_mm" or "attention" without being either: a
#: triton kernel is "quantize" when it takes a row's amax (the FP8 activation quantization, with
#: whatever elementwise work was fused into it) and "other" otherwise
_PROFILE_SHARES = {"gemm": ("gemm", "scaled_mm", "cutlass", "nvjet", "xmma", "aten::mm", "aten::addmm",
                            "aten::bmm"),
                   "attention": ("flash", "fmha", "sdpa", "attention"),
                   "quantize": ("aten::amax", "aten::abs", "aten::clamp")}


def profile_share(name: str) -> str:
    """Which share of dit_profile_s a kernel / op of this name counts in (_PROFILE_SHARES)."""
    name = name.lower()
    if name.startswith("triton"):
        return "quantize" if "amax" in name else "other"
    return next((k for k, frags in _PROFILE_SHARES.items() if any(f in name for f in frags)), "other")


def phase_profile_dit(c: Ctx, rows: int, path: Path) -> None:
    """--profile-rollout PATH: one DiT forward of `rows` rows (the rollout's call, with the speed
    options in force) under torch.profiler, after a warm-up call (a compiled DiT compiles there);
    rank 0 writes key_averages().table sorted by device time (CPU time on a CPU run) to PATH.
    dit_profile_s carries the shares of the kernels' own time (CUDA; the ops' self time on CPU) in
    GEMMs, attention, the FP8 activation quantization and the rest, by name (profile_share)."""
    from torch.profiler import profile

    fwd = dit_call(c, rows)
    fwd()
    with profile(activities=profile_activities(c.device)) as prof:
        with timed(c.device) as t:
            fwd()
    averages = prof.key_averages()
    shares, kernel_s = kernel_shares(c, averages)
    sort_by = write_profile_table(c, averages, path)
    c.rep.emit("dit_profile_s", t[0], "s", path=str(path), sort_by=sort_by, written_by_rank=0, rows=rows,
               variant=rollout_variant(c.args), shares=shares, kernel_s=kernel_s)


def cfg_rows(c: Ctx) -> int:
    """DiT rows per candidate: 2 under true CFG (conditional + unconditional), else 1. Read from
    the family's own rollout request, not from --guidance-scale: FLUX.1 turns the scale into its
    embedded guidance and runs one row."""
    req = build_requests(c.engine, c.adapter, c.sampling, c.prompts[:1], 1, c.sde_indices, c.args.seed, 0,
                         c.media)[0]
    return 2 if req.guidance_scale > 1.0 else 1


def rollout_rows(c: Ctx) -> int:
    """DiT rows per rollout forward: the engine's batch of candidates (all of them unless
    --engine-batch-size) times cfg_rows."""
    n = c.args.prompts * c.args.group_size
    step = getattr(c.engine, "max_batch_size", 0) or n
    return min(step, n) * cfg_rows(c)


def rollout(c: Ctx, rollout_id: int, sampling: Any = None, sde_indices: list[int] | None = None) -> tuple[Any, float]:
    """One rollout of prompts x group_size candidates through engine.generate; (Trajectory, s).
    sampling / sde_indices: another sampling config than the bench's (the nft step's ODE one)."""
    prompts = c.rollout_prompts(rollout_id) if c.rollout_prompts is not None else c.prompts
    reqs = build_requests(c.engine, c.adapter, sampling or c.sampling, prompts, c.args.group_size,
                          c.sde_indices if sde_indices is None else sde_indices, c.args.seed, rollout_id, c.media)
    with timed(c.device) as t:
        traj = c.engine.generate(reqs)
    return traj, t[0]


def phase_vae_decode(c: Ctx) -> None:
    """--vae-decode: the rollout's VAE decode of its n candidates (random latents at the
    rollout's size, one frame), with diffusers' causal 3-D convolutions and with the 2-D ones they
    equal on one frame (trainer.models.causal_conv, what the rollout runs): vae_decode_s per path
    (mean of --iters calls after one warm-up), and the largest difference of their images."""
    import copy

    from trainer.models.causal_conv import install_single_frame_convs

    a, vae = c.args, c.engine.vae
    plain = copy.deepcopy(vae)
    for m in plain.modules():
        m.__dict__.pop("forward", None)  # diffusers' own forwards
    fast = copy.deepcopy(plain)
    install_single_frame_convs(fast)
    z_dim, f = vae.config.z_dim, c.engine.vae_scale_factor
    z = torch.randn(a.prompts * a.group_size, z_dim, 1, a.height // f, a.width // f,
                    generator=torch.Generator().manual_seed(0)).to(c.device, vae.dtype)
    out = {}
    with torch.no_grad():
        for name, model in (("3d", plain), ("2d", fast)):
            out[name] = model.decode(z, return_dict=False)[0]  # warm-up: cuDNN's algorithm choice
            sec = c.rep.reduce(_mean_time(c.device, lambda: model.decode(z, return_dict=False), max(a.iters, 2)), "max")
            c.rep.emit("vae_decode_s", sec, "s", variant=name, images=z.shape[0])
    diff = (out["3d"].float() - out["2d"].float()).abs().max().item()
    c.rep.emit("vae_decode_max_abs_diff", diff, "abs", note="images in [-1, 1], the two convolution paths")
    del plain, fast, out
    _free(c.device)


def rollout_split(c: Ctx) -> dict[str, float]:
    """The engine's split of its last rollout (the native engine's encode / denoise / decode
    seconds, each up to a device synchronisation; none from an engine that does not report it),
    the slowest rank's."""
    return {k: c.rep.reduce(v, "max") for k, v in c.engine.last_stats.items()
            if k in ("encode_time", "denoise_time", "decode_time")}


def phase_rollout(c: Ctx, variant: str = "eager") -> Any:
    """rollout_images_per_s (text encode + DiT + VAE, batched by the engine) and rollout_mfu
    (DiT FLOPs only over the whole rollout time); rollout_first_s: the untimed warm-up rollout
    (with compilation: the compile); rollout_new_graphs: graphs compiled during the timed
    rollouts (0 = no recompiles: the shapes are fixed)."""
    a = c.args
    _, first = rollout(c, rollout_id=0)  # warm-up: allocator, cuBLAS / cuDNN handles, rope caches, compile
    c.rep.emit("rollout_first_s", first, "s", variant=variant)
    times, traj, graphs = [], None, 0.0
    for i in range(a.iters):
        traj, sec = rollout(c, rollout_id=1 + i)
        times.append(sec)
        graphs += c.engine.last_stats.get("new_graphs", 0.0)
    sec = c.rep.reduce(sum(times) / len(times), "max")
    n = len(traj)
    c.rep.emit("rollout_s", sec, "s", candidates=n, dit_forwards=c.engine.last_stats.get("dit_forwards"),
               variant=variant, split=rollout_split(c))
    c.rep.emit("rollout_images_per_s", n / sec, f"{c.items}/s", op="min", candidates=n, variant=variant)
    dit = c.forward_flops(c.dit_cfg, c.image_tokens, c.text_tokens, n * cfg_rows(c)) * a.steps
    c.rep.emit("rollout_mfu", dit / sec / 1e12 / c.peak_tflops, "fraction", op="min", peak_tflops=c.peak_tflops,
               variant=variant)
    if c.engine.compile_blocks:
        c.rep.emit("rollout_new_graphs", graphs, "graphs", variant=variant)
    c.rep.phase_memory("rollout")
    c.images_per_s[variant] = n / sec
    return traj


def _stock_pipeline(c: Ctx):
    """diffusers' QwenImagePipeline over the engine's own modules (the same weights and devices)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    e = c.engine
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(e.scheduler_config), vae=e.vae,
                             text_encoder=e.text_encoder, tokenizer=e.tokenizer, transformer=e.transformer)


def _flowgrpo_rollout_fn(path: Path):
    """FlowGRPO's Qwen-Image rollout function, imported from a local checkout at run time."""
    root = Path(path).resolve()
    module_file = root / "flow_grpo" / "diffusers_patch" / "qwenimage_pipeline_with_logprob.py"
    if not module_file.is_file():
        raise SystemExit(f"--flowgrpo-path {path}: {module_file} does not exist; point it at a FlowGRPO checkout")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    return importlib.import_module("flow_grpo.diffusers_patch.qwenimage_pipeline_with_logprob").pipeline_with_logprob


def phase_compare(c: Ctx, path: str) -> None:
    """compare_<path>_images_per_s: the rollout's prompts x group_size images through other code
    on the engine's modules, timed like phase_rollout (a warm-up call, then --iters), and
    rollout_vs_<path>: the eager engine's images/s over it (both per DiT row: the same CFG rows).

    diffusers: QwenImagePipeline.__call__ (ODE; true CFG as the pipeline does it: two forwards
    per step when --guidance-scale > 1); flowgrpo: FlowGRPO's pipeline_with_logprob (SDE over
    its window, CFG rows in one forward), imported from --flowgrpo-path."""
    a = c.args
    pipe = _stock_pipeline(c)
    pipe.set_progress_bar_config(disable=True)
    prompts = [p for p in c.prompts for _ in range(a.group_size)]
    per_call = a.compare_batch or len(prompts)
    guided = a.guidance_scale > 1.0
    negative = [" "] * per_call
    kw = dict(height=a.height, width=a.width, num_inference_steps=a.steps, output_type="pt",
              max_sequence_length=512)
    if path == "diffusers":
        def call(batch):
            extra = dict(true_cfg_scale=a.guidance_scale, negative_prompt=negative[:len(batch)]) if guided \
                else dict(true_cfg_scale=1.0)
            return pipe(prompt=batch, **kw, **extra)
    else:
        fn = _flowgrpo_rollout_fn(a.flowgrpo_path)

        def call(batch):
            return fn(pipe, prompt=list(batch), negative_prompt=negative[:len(batch)], true_cfg_scale=a.guidance_scale,
                      noise_level=a.eta, **kw)

    def run() -> float:
        with timed(c.device) as t, torch.no_grad():
            for start in range(0, len(prompts), per_call):
                call(prompts[start:start + per_call])
        return t[0]

    dit = c.engine.transformer
    if path == "flowgrpo":
        # FlowGRPO's function still passes txt_seq_lens, which diffusers >= 0.36 no longer takes
        # (the DiT reads the text lengths from the mask it is also given): drop it at the call
        own_forward = dit.forward

        def forward(*args, txt_seq_lens=None, **kwargs):
            return own_forward(*args, **kwargs)

        dit.forward = forward
    try:
        run()
        sec = c.rep.reduce(sum(run() for _ in range(a.iters)) / a.iters, "max")
    finally:
        if path == "flowgrpo":
            del dit.forward
    c.rep.emit(f"compare_{path}_images_per_s", len(prompts) / sec, "images/s", op="min", candidates=len(prompts),
               per_call=per_call)
    if "eager" in c.images_per_s:
        c.rep.emit(f"rollout_vs_{path}", c.images_per_s["eager"] * sec / len(prompts), "ratio", variant="eager")
    c.rep.phase_memory(f"compare_{path}")
    del pipe
    _free(c.device)


def phase_rollout_gap(c: Ctx, actor, traj: Any, replay_fn, variant: str) -> None:
    """How far the engine's rollout is from the actor's replay on the rollout's own transitions
    (what an FP8 or compiled rollout costs in on-policyness): rollout_replay_kl, the closed-form
    KL between the engine's and the actor's transition Gaussians at the recorded latents (nats
    per element, the log-prob's convention), and rollout_logp_gap_mean, mean(sampler log-prob -
    replay log-prob) (its sample estimate). Both 0 for an eager engine in the actor's dtype."""
    gap = sampler_replay_gap(c, actor, traj.without_images()[: c.args.micro_batch], replay_fn)
    c.rep.emit("rollout_replay_kl", gap["kl_mean"], "nats", variant=variant, max=gap["kl_max"])
    c.rep.emit("rollout_logp_gap_mean", gap["gap_mean"], "nats", variant=variant, max_abs=gap["gap_max_abs"])


def sampler_replay_gap(c: Ctx, actor, rows: Any, replay_fn) -> dict[str, float]:
    """The engine's transitions against the actor's on `rows` (recorded rollout rows), no grad:
    kl_mean / kl_max, the closed-form KL of the two transition Gaussians at the recorded
    latents (flow_grpo.transition_kl; nats per element), and gap_mean / gap_max_abs of (sampler
    log-prob - replay log-prob). Rank-local."""
    from trainer.flow_grpo import transition_kl

    with torch.no_grad():
        _, mean_e, std = replay_fn.moments(c.engine.transformer, rows)
        logp_a, mean_a, _ = replay_fn.moments(actor.model, rows)
    b, s = int(std.shape[0]), int(std.shape[1])
    kl = transition_kl(mean_e.reshape(b * s, -1), mean_a.reshape(b * s, -1).to(mean_e.device),
                       std.reshape(b * s, 1).to(mean_e.device))
    gap = rows.log_probs.float() - logp_a.float().cpu()
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "gap_mean": float(gap.mean()),
            "gap_max_abs": float(gap.abs().max())}


def bench_scorer(video: bool) -> tuple[Any, Callable[[Any], Any]]:
    """(scorer, batch conversion) of the bench's reward: ColorScorer (no weights) on images; on
    videos the same scorer through FramewiseScorer, as the trainer's --reward-scorer-path framewise
    --reward-frame-scorer color runs it (its default frames: 8 evenly spaced, mean per video)."""
    from trainer.rewards.base import ImageBatch
    from trainer.rewards.color import ColorScorer

    if not video:
        return ColorScorer(), ImageBatch.from_any
    from trainer.rewards.video import FramewiseScorer, VideoBatch

    return FramewiseScorer(scorer=ColorScorer(), reduction="mean"), VideoBatch.from_any


def score(c: Ctx, traj: Any):
    """(advantages [n], valid [n], seconds, degenerate): bench_scorer + compute_advantages, the
    conversion of the decoded images / videos to uint8 included. A degenerate result (random
    weights can give equal images) falls back to +-1 advantages so the update is never skipped;
    the line says so."""
    from trainer.rewards.post_process import compute_advantages

    scorer, to_batch = bench_scorer(c.video)
    with timed(c.device) as t:
        comps = scorer.score(to_batch(traj.images), list(traj.prompts), list(traj.metadata))
        result = compute_advantages(comps, c.args.group_size)
    adv, valid = result.advantages, result.valid
    if result.degenerate or not bool(valid.any()):
        n = adv.shape[0]
        adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])
        valid = torch.ones(n, dtype=torch.bool)
    return adv, valid, t[0], bool(result.degenerate)


def _fwd_bwd(c: Ctx, actor, batch: Any, replay_fn) -> float:
    """Seconds of one micro-batch forward + backward through the actor's sharded model."""
    rows = batch[: c.args.micro_batch]
    actor.model.train()
    with timed(c.device) as t:
        logp = replay_fn(actor.model, rows)
        logp.float().mean().backward()
    actor.optimizer.zero_grad(set_to_none=True)
    return t[0]


def phase_replay(c: Ctx, actor, batch: Any, replay_fn, mode: str, *, checkpointing: bool | float | None = None,
                 **extra: Any) -> None:
    """replay_transitions_per_s and replay_mfu of one micro-batch forward + backward over all its
    trained columns, and replay_logp_max_abs_err of the replay against the sampler's log-prob.
    mode: the figures' suffix; checkpointing: the fraction of blocks checkpointed (None: as the
    args say), for the hardware FLOPs; extra rides along on the figure lines."""
    a = c.args
    if checkpointing is None:
        checkpointing = checkpointed_fraction(c.dit_cfg, a)
    rows = batch[: a.micro_batch]
    with torch.no_grad():
        logp = replay_fn(actor.model, rows).float().cpu()
    err = float((logp - rows.log_probs.float()).abs().max())
    c.rep.emit(f"replay_logp_max_abs_err_{mode}", err, "nats", mode=mode)
    _fwd_bwd(c, actor, batch, replay_fn)  # warm-up
    sec = c.rep.reduce(sum(_fwd_bwd(c, actor, batch, replay_fn) for _ in range(a.iters)) / a.iters, "max")
    transitions = a.micro_batch * len(c.sde_indices)
    model_f, hw_f = replay_flops(c.dit_cfg, c.image_tokens, c.text_tokens, transitions * cfg_rows(c), checkpointing,
                                 forward_flops=c.forward_flops)
    c.rep.emit(f"replay_transitions_per_s_{mode}", transitions / sec, "transitions/s", op="min", mode=mode,
               micro_batch=a.micro_batch, seconds=sec, **extra)
    c.rep.emit(f"replay_mfu_{mode}", model_f / sec / 1e12 / c.peak_tflops, "fraction", op="min", mode=mode,
               hfu=hw_f / sec / 1e12 / c.peak_tflops, peak_tflops=c.peak_tflops, **extra)
    c.rep.phase_memory(f"replay_{mode}")


def phase_update(c: Ctx, actor, batch: dict, adv, valid, replay_fn, mode: str) -> float:
    """update_s: Actor.train_step over the rank's candidates (anchor + num_updates updates)."""
    actor.train_step(batch, adv, replay_fn, valid=valid)  # warm-up (AdamW state)
    with timed(c.device) as t:
        metrics = actor.train_step(batch, adv, replay_fn, valid=valid)
    sec = c.rep.reduce(t[0], "max")
    c.rep.emit(f"update_s_{mode}", sec, "s", mode=mode, optimizer_steps=metrics.get("train/optimizer_steps"),
               transitions=int(adv.shape[0]) * len(c.sde_indices))
    c.rep.phase_memory(f"update_{mode}")
    return sec


#: --optimizers: AdamW's implementations timed side by side (the trainer's --adam-fused picks fused)
ADAMW_IMPLEMENTATIONS = ("foreach", "fused")


def phase_optimizers(c: Ctx, actor) -> None:
    """--optimizers: one AdamW step over copies of the actor's trainable tensors (this rank's shards,
    as the actor's optimizer sees them: DTensors under FSDP2) with random gradients, as each of
    ADAMW_IMPLEMENTATIONS, from the same state: optimizer_step_s per implementation (the mean of
    --iters steps after two warm-ups) and, on the fused figure, the largest difference of its
    tensors from foreach's after the same steps. The actor is not touched."""
    from torch.distributed.tensor import DTensor

    from trainer.train_model import local_shard

    o = actor.optimizer.defaults
    gen = torch.Generator(device="cpu").manual_seed(c.args.seed)
    grads = [torch.randn(local_shard(p).shape, generator=gen).to(local_shard(p)) for p in actor.trainable]
    results: dict[str, list[torch.Tensor]] = {}
    iters = max(c.args.iters, 5)
    for impl in ADAMW_IMPLEMENTATIONS:
        params = [torch.nn.Parameter(p.detach().clone()) for p in actor.trainable]
        for p, g in zip(params, grads):
            p.grad = g if not isinstance(p.data, DTensor) else DTensor.from_local(
                g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        opt = torch.optim.AdamW(params, lr=o["lr"], betas=o["betas"], eps=o["eps"], weight_decay=o["weight_decay"],
                                **{impl: True})
        for _ in range(2):
            opt.step()
        sec = c.rep.reduce(_mean_time(c.device, opt.step, iters), "max")
        results[impl] = [local_shard(p).detach() for p in params]
        diff = None if impl == "foreach" else c.rep.reduce(max(
            float((a.float() - b.float()).abs().max()) for a, b in zip(results[impl], results["foreach"])), "max")
        c.rep.emit("optimizer_step_s", sec, "s", implementation=impl, tensors=len(params),
                   elements=c.rep.reduce(float(sum(g.numel() for g in grads)), "mean") * c.rep.world_size,
                   steps=2 + iters, **({} if diff is None else {"max_abs_diff_to_foreach": diff}))
        del opt, params
    c.rep.phase_memory("optimizers")


def _lora_gradient(c: Ctx, actor, rows: Any, adv: torch.Tensor, replay_fn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(this rank's shard of every trainable tensor's gradient, fp32 copies; the replayed log-probs)
    of the first update's objective at ratio 1, -mean(A x logp), over `rows`; gradients cleared after."""
    from trainer.train_model import local_shard

    actor.model.train()
    actor.optimizer.zero_grad(set_to_none=True)
    logp = replay_fn(actor.model, rows)
    (-(adv.to(logp.device).float()[:, None] * logp.float()).mean()).backward()
    grads = [torch.zeros_like(local_shard(p), dtype=torch.float32) if p.grad is None
             else local_shard(p.grad).detach().float().clone() for p in actor.trainable]
    actor.optimizer.zero_grad(set_to_none=True)
    return grads, logp.detach().float().cpu()


def phase_replay_precision(c: Ctx, actor, batch: Any, adv: torch.Tensor, replay_fn) -> None:
    """replay_fp8_grad_rel_diff (--replay-precision fp8 / fp8-dgrad): |g_fp8 - g_default| / |g_default| of
    the LoRA gradient of one micro-batch (the first update's objective at ratio 1, _lora_gradient), the
    same actor and batch with its base GEMMs in FP8 and then in the compute dtype (set_replay_precision
    both ways, the run's FP8 precision again after); cosine, both norms and the replayed log-probs' max |difference|
    ride along. Before the actor's first step LoRA B is 0, so only B has a gradient
    (lora_b_nonzero says which case was measured)."""
    from trainer.train_model import set_replay_precision

    a = c.args
    rows, adv_rows = batch[: a.micro_batch], adv[: a.micro_batch]
    fp8, logp8 = _lora_gradient(c, actor, rows, adv_rows, replay_fn)
    set_replay_precision(actor.model, "default")
    try:
        ref, logp = _lora_gradient(c, actor, rows, adv_rows, replay_fn)
    finally:
        set_replay_precision(actor.model, a.replay_precision, a.replay_fp8_variants[0][0],
                             fast_accum=a.replay_fp8_variants[0][2] == "fast")
    world = c.rep.world_size

    def total(parts) -> float:  # a sum over every rank's shards
        return c.rep.reduce(float(sum(float(t) for t in parts)), "mean") * world

    diff = total((x - y).double().pow(2).sum() for x, y in zip(fp8, ref))
    n_ref = total(y.double().pow(2).sum() for y in ref)
    n_fp8 = total(x.double().pow(2).sum() for x in fp8)
    dot = total((x.double() * y.double()).sum() for x, y in zip(fp8, ref))
    rel = math.sqrt(diff / n_ref) if n_ref > 0 else None
    c.rep.emit("replay_fp8_grad_rel_diff", rel, "fraction",
               cosine=dot / math.sqrt(n_ref * n_fp8) if n_ref > 0 and n_fp8 > 0 else None,
               grad_norm_fp8=math.sqrt(n_fp8), grad_norm_default=math.sqrt(n_ref),
               logp_max_abs_diff=c.rep.reduce(float((logp8 - logp).abs().max()), "max"),
               micro_batch=a.micro_batch, lora_b_nonzero=actor.optimizer_steps > 0, precision=a.replay_precision,
               fp8_layers=a.replay_fp8_variants[0][0],
               objective="-mean(A * logp): the first update's at ratio 1")
    c.rep.phase_memory("replay_precision")


def phase_sync(c: Ctx, actor, kind: str, verify: bool = True, label: str | None = None,
               gather_mode: str | None = None) -> float:
    """<kind>_sync_s: WeightSyncer(kind).sync(actor.model, engine), warmed up, mean of --iters.
    gather_mode: how several ranks gather each bucket (trainer.weight_sync.GATHER_MODES; None:
    the default, DEFAULT_GATHER_MODE)."""
    from trainer.weight_sync import DEFAULT_GATHER_MODE, WeightSyncer

    a = c.args
    syncer = WeightSyncer(kind, wire_dtype=a.dtype, bucket_size_mb=a.bucket_mb, verify_checksum=verify,
                          name_map=c.adapter.weight_name_map, lora_config=actor.lora_config,
                          policy_version=c.engine.policy_version, gather_mode=gather_mode)
    syncer.sync(actor.model, c.engine)  # warm-up (the first adapter sync injects LoRA into the engine)
    sec = c.rep.reduce(_mean_time(c.device, lambda: syncer.sync(actor.model, c.engine), a.iters), "max")
    gb = syncer.last_manifest.total_bytes / 1e9 if syncer.last_manifest else 0.0
    c.rep.emit(label or f"{kind}_sync_s", sec, "s", kind=kind, verify_checksum=verify, gb=gb,
               tensors=syncer.last_manifest.tensor_count if syncer.last_manifest else 0,
               gather_mode=gather_mode or DEFAULT_GATHER_MODE)
    c.rep.phase_memory(f"sync_{kind}")
    return sec


#: column_sums_wide's row length in periods: rows of CHECKSUM_WIDE_FOLD * CHECKSUM_PERIOD words
CHECKSUM_WIDE_FOLD = 64


def column_sums_wide(words: torch.Tensor) -> torch.Tensor:
    """trainer.core.checksum.column_sums(words), bit for bit, by another reduction order: the
    alternative phase_checksum times against the one the sync uses.

    The words as a [n // (P * K), P * K] view reduced over dim 0 (K = CHECKSUM_WIDE_FOLD: 65,344
    independent column sums for a device reduction to spread over, where column_sums has 1,021),
    those K * P partial sums folded into P ([K, P] reduced over dim 0), then the < P * K remaining
    words by column_sums (they start at a multiple of P, so their residues line up). Integer
    addition modulo 2^32 is associative and commutative: the order cannot change the result."""
    from trainer.core.checksum import CHECKSUM_PERIOD, column_sums

    p, k = CHECKSUM_PERIOD, CHECKSUM_WIDE_FOLD
    n = words.numel()
    m = n - n % (p * k)
    if m == 0:
        return column_sums(words)
    cs = words[:m].view(-1, p * k).sum(0, dtype=torch.int32).view(k, p).sum(0, dtype=torch.int32)
    if n > m:
        cs += column_sums(words[m:])
    return cs


def phase_checksum(c: Ctx) -> None:
    """checksum_s: weights_checksum over the engine DiT's parameters (what a verified full / merged
    sync computes on each side), by itself; checksum_alt_s: the same with column_sums_wide, whose
    digest must be equal (same_digest says whether it is, on this device)."""
    from trainer.core.checksum import column_sums, weights_checksum

    params = list(c.engine.transformer.named_parameters())
    gb = sum(p.numel() * p.element_size() for _, p in params) / 1e9
    digests = {}
    for figure, fn in (("checksum", column_sums), ("checksum_alt", column_sums_wide)):
        digests[figure] = weights_checksum(params, fn)  # warm-up
        sec = c.rep.reduce(_mean_time(c.device, lambda: weights_checksum(params, fn), c.args.iters), "max")
        same = digests[figure] == digests["checksum"]
        c.rep.emit(f"{figure}_s", sec, "s", gb=gb, tensors=len(params), column_sums=fn.__name__, same_digest=same)
        c.rep.emit(f"{figure}_gb_per_s", gb / sec, "GB/s", op="min", gb=gb, column_sums=fn.__name__)
    c.rep.phase_memory("checksum")


def replay_variant(c: Ctx, name: str, build: Callable[[], Any], batch: dict, replay_fn,
                   checkpointing: bool | float, **extra: Any) -> None:
    """The LoRA replay figures of an actor from build(), suffixed lora_<name>. Device out of
    memory (on any rank, while building or replaying) gives replay_transitions_per_s_lora_<name>
    with value null and "oom": true instead of ending the run. An out-of-memory error on only some
    ranks in the middle of a collective can still hang the others (NCCL's timeout ends that)."""
    mode = f"lora_{name}"
    oom = False
    actor = None
    try:
        actor = build()
        phase_replay(c, actor, batch, replay_fn, mode, checkpointing=checkpointing, variant=name, **extra)
    except torch.OutOfMemoryError:  # not bound: the traceback's frames (and their tensors) go with it
        oom = True
    if actor is not None:
        actor.optimizer.zero_grad(set_to_none=True)
    actor = None
    _free(c.device)
    if c.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(c.device)
        c.rep.peak_floor = 0
    if c.rep.reduce(1.0 if oom else 0.0, "max") > 0.5:
        c.rep.emit(f"replay_transitions_per_s_{mode}", None, "transitions/s", mode=mode, variant=name, oom=True,
                   **extra)


def actor_blocks(dit_cfg: dict) -> int:
    """Every block the actor may checkpoint (FLUX: the double- and the single-stream blocks)."""
    return int(dit_cfg["num_layers"]) + int(dit_cfg.get("num_single_layers") or 0)


def checkpointed_blocks(dit_cfg: dict, on: bool, every: int) -> int:
    """How many of the actor's blocks are checkpointed: blocks 0, every, 2 * every, ...; none when
    checkpointing is off (each checkpointed block recomputes its forward in backward)."""
    return math.ceil(actor_blocks(dit_cfg) / every) if on else 0


def checkpointed_fraction(dit_cfg: dict, args) -> float:
    """The fraction of the actor's blocks that --no-activation-checkpointing and
    --activation-checkpointing-every leave checkpointed."""
    on = not args.no_activation_checkpointing
    return checkpointed_blocks(dit_cfg, on, args.activation_checkpointing_every) / actor_blocks(dit_cfg)


def phase_replay_variants(c: Ctx, batch: dict, replay_fn) -> None:
    """--replay-variants: LoRA replay of a freshly built actor per REPLAY_VARIANTS entry (one at a
    time, each freed before the next): parameters kept gathered after forward (noreshard),
    checkpointing every other block (ac_every2), no checkpointing (ac_none)."""
    a = c.args
    n_blocks = actor_blocks(c.dit_cfg)
    for name, (reshard, ac, every) in REPLAY_VARIANTS.items():
        ac_on = (not a.no_activation_checkpointing) if ac is None else ac
        checkpointed = checkpointed_blocks(c.dit_cfg, ac_on, every)

        def build(reshard=reshard, ac_on=ac_on, every=every):
            return build_actor(a, "lora", c.mesh, c.device, c.dtype, reshard_after_forward=reshard,
                               activation_checkpointing=ac_on, activation_checkpointing_every=every)

        replay_variant(c, name, build, batch, replay_fn, checkpointed / n_blocks, reshard_after_forward=reshard,
                       activation_checkpointing=ac_on, activation_checkpointing_every=every,
                       checkpointed_blocks=checkpointed)


def profile_activities(device: torch.device) -> list:
    """torch.profiler's activities for a phase profile: CPU, and CUDA on cuda."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_sort_key(c: Ctx) -> str:
    """The key a profile's op table is sorted by: device time, CPU time on a CPU run."""
    return "device_time_total" if c.device.type == "cuda" else "cpu_time_total"


def write_profile_table(c: Ctx, averages, path: Path) -> str:
    """Rank 0 writes the profile's op table (key_averages, 40 rows) to `path`, sorted by device
    time (CPU time on a CPU run); returns the sort key, for the figure."""
    sort_by = profile_sort_key(c)
    if c.rep.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(averages.table(sort_by=sort_by, row_limit=40) + "\n")
    return sort_by


def phase_profile_replay(c: Ctx, actor, batch: dict, replay_fn, path: Path) -> None:
    """--profile-replay PATH: one LoRA replay micro-batch (forward + backward) under torch.profiler
    (CPU, and CUDA on cuda); rank 0 writes key_averages().table sorted by device time (CPU time on
    a CPU run) to PATH. Warmed up first, so the table shows the steady state."""
    from torch.profiler import profile

    _fwd_bwd(c, actor, batch, replay_fn)  # warm-up
    with profile(activities=profile_activities(c.device)) as prof:
        sec = _fwd_bwd(c, actor, batch, replay_fn)
    sort_by = write_profile_table(c, prof.key_averages(), path)
    c.rep.emit("replay_profile_s", sec, "s", path=str(path), sort_by=sort_by, written_by_rank=0,
               micro_batch=c.args.micro_batch)


def phase_offload(c: Ctx, actor, mode: str) -> None:
    """Actor offload / onload and engine release / resume (pinned host memory). Each runs twice:
    cold (the pinned blocks are allocated) then warm (the caching host allocator reuses them, as
    in a run's steady state); the figure is the warm round, the cold one rides along. The host
    cache is emptied after each module so the two never hold pinned memory at once."""
    rounds = []
    for _ in range(2):
        rounds.append((actor.offload(), actor.onload()))
    _release_host_cache()
    (cold_off, cold_on), (off, on) = rounds
    c.rep.emit(f"actor_offload_s_{mode}", off["perf/actor_offload_time"], "s", gb=off["perf/actor_offload_gb"],
               cold_s=c.rep.reduce(cold_off["perf/actor_offload_time"], "max"))
    c.rep.emit(f"actor_onload_s_{mode}", on["perf/actor_onload_time"], "s", gb=on["perf/actor_onload_gb"],
               cold_s=c.rep.reduce(cold_on["perf/actor_onload_time"], "max"))
    times = []
    for _ in range(2):
        with timed(c.device) as t_off:
            c.engine.release_memory()
        with timed(c.device) as t_on:
            c.engine.resume_memory()
        times.append((t_off[0], t_on[0]))
    _release_host_cache()
    c.rep.emit("engine_release_s", times[1][0], "s", cold_s=c.rep.reduce(times[0][0], "max"))
    c.rep.emit("engine_resume_s", times[1][1], "s", cold_s=c.rep.reduce(times[0][1], "max"))
    c.rep.phase_memory(f"offload_{mode}")


#: --algorithms: the updates phase_step times
ALGORITHMS = ("flowgrpo", "nft")
#: --replay-fp8-sharing: link the actor's FP8 layers to the engine's copies and free the weights
#: that leaves unread (fp8-dgrad), link and keep them, or quantize at every forward
REPLAY_FP8_SHARING = ("on", "keep", "off")
#: --replay-fp8-variants' optional third field: the FP8 forward GEMMs' accumulation, full or with
#: the tensor cores' fast one (the trainer's --fp8-fast-accum), engine and actor alike
FP8_ACCUMULATIONS = ("full", "fast")
#: --old-logprob-source: where the FlowGRPO step's pi_old comes from (the trainer's flag)
OLD_LOGPROB_SOURCES = ("replay", "rollout")


def step_label(algorithm: str, source: str = "replay") -> str:
    """The suffix of a step's memory figure: "" for the default FlowGRPO step (peak_mem_step, as
    before the other steps existed), "_rollout_logprob" for FlowGRPO on the recorded log-probs,
    "_nft" for DiffusionNFT."""
    if algorithm == "nft":
        return "_nft"
    return "" if source == "replay" else "_rollout_logprob"


@contextlib.contextmanager
def old_logprob_source(actor, source: str) -> Iterator[None]:
    """The actor's --old-logprob-source set to `source` inside the block (its GrpoConfig swapped for
    a copy with that one field changed, as a run started with the flag holds it), restored after."""
    import dataclasses

    own = actor.grpo
    actor.grpo = dataclasses.replace(own, old_logprob_source=source)
    try:
        yield
    finally:
        actor.grpo = own


def flowgrpo_update(actor, replay_fn, source: str = "replay") -> Callable[..., dict[str, float]]:
    """update(batch, adv, valid, rollout_id) -> metrics: Actor.train_step as trainer/loop.py calls it,
    with pi_old from `source` (--old-logprob-source)."""
    def update(batch, adv, valid, rollout_id):
        with old_logprob_source(actor, source):
            return actor.train_step(batch, adv, replay_fn, valid=valid)

    return update


def nft_parts(c: Ctx) -> tuple[Any, list[int]]:
    """(sampling, sde_indices) of an nft rollout: the bench's sampling config through the loop's own
    trainer.nft.ode_rollout_sampling (the ODE path, only the last step recorded)."""
    from trainer.nft import ode_rollout_sampling
    from trainer.sampling import resolve_sde_indices

    sampling = ode_rollout_sampling(c.sampling)
    return sampling, resolve_sde_indices(sampling, c.args.steps, rollout_id=0)


def nft_update(c: Ctx, actor, sampling: Any) -> Callable[..., dict[str, float]]:
    """update(batch, adv, valid, rollout_id) -> metrics: Actor.nft_train_step as trainer/loop.py
    calls it: the loop's velocity function (make_velocity_fn), the rollout's step sigmas without
    the terminal 0 (Trainer._nft_schedule), the draw seed of nft_draw_seed; the old policy's soft
    update is the step's own last act (Actor._nft_move_old)."""
    from trainer.loop import make_velocity_fn, nft_draw_seed
    from trainer.rollout import driver_sigmas

    velocity_fn = make_velocity_fn(c.adapter)
    schedule = torch.tensor(driver_sigmas(c.engine, sampling)[:-1], dtype=torch.float32)

    def update(batch, adv, valid, rollout_id):
        return actor.nft_train_step(batch, adv, velocity_fn, schedule, nft_draw_seed(c.args.seed, rollout_id), valid)

    return update


def phase_step(c: Ctx, actor, replay_fn, kind: str, *, algorithm: str = "flowgrpo", source: str = "replay",
               onpolicy: bool = False, warm_up: bool | None = None) -> None:
    """step_s: one step of the rank's candidates, top to bottom as trainer/loop.py runs it for
    `algorithm`: rollout -> reward -> update -> sync (with --offload: actor offloaded around the
    rollout, engine released around the update, as a colocated run does). flowgrpo: the SDE
    rollout, Actor.train_step with pi_old from `source`; nft: the ODE rollout, Actor.nft_train_step
    (its old-policy update included). The line carries the stage split (`stages`), the
    algorithm, the source (flowgrpo), the update's own figures and the device's peak memory.

    warm_up (None: whether the engine is compiled) first runs one untimed step (step_first_s), so
    the timed one is steady state: the compile of the engine's blocks with LoRA, a fresh actor's
    AdamW state and compiled shapes.

    onpolicy (flowgrpo): also step_onpolicy beside it, from the timed step itself: the first
    executed update's max |ratio - 1| (the value) and mean ratio as the actor reports them, its
    train/rollout_logprob_gap_max (source rollout), and the sampler-vs-replay log-prob gap and
    closed-form transition KL on the step's first micro-batch (sampler_replay_gap, measured after
    the reward and before the update, outside every timer)."""
    from trainer.loop import GcClock
    from trainer.weight_sync import WeightSyncer

    a = c.args
    syncer = WeightSyncer(kind, wire_dtype=a.dtype, bucket_size_mb=a.bucket_mb, name_map=c.adapter.weight_name_map,
                          lora_config=actor.lora_config, policy_version=c.engine.policy_version)
    sampling, sde_indices = nft_parts(c) if algorithm == "nft" else (None, None)
    update = nft_update(c, actor, sampling) if algorithm == "nft" else flowgrpo_update(actor, replay_fn, source)
    fp8_variant = dict(zip(("replay_fp8_layers", "replay_fp8_sharing", "fp8_accum"), c.replay_fp8_variant)) \
        if a.replay_precision != "default" and algorithm == "flowgrpo" else {}
    tags = {"algorithm": algorithm, **fp8_variant, **({"old_logprob_source": source} if algorithm == "flowgrpo" else
                                        {"nft_timestep_fraction": float(c.args.nft_timestep_fraction),
                                         "nft_sigmas_per_forward": int(c.args.nft_sigmas_per_forward)})}
    base = 100 if algorithm == "flowgrpo" and source == "replay" else 200 if algorithm == "flowgrpo" else 300
    compiled = c.engine.compile_blocks or bool(getattr(a, "fsdp_compile", False))
    if c.engine.compile_blocks if warm_up is None else warm_up:
        # the first rollout with the engine's LoRA recompiles its blocks (a new module structure):
        # sync first, so the untimed steps take that compile and the timed one is steady state.
        # Compiled blocks warm up until a step compiles no graph: with prompts of varied lengths
        # (--text-tokens-spread) the graphs with the text length symbolic come a step or two later
        syncer.sync(actor.model, c.engine)
        share_fp8_weights(c, actor)

        def warm_up_step(i: int) -> float:
            with timed(c.device) as t:
                _one_step(c, update, actor, syncer, base - 1 - i, {}, sampling, sde_indices)
            return t[0]

        for i, seconds, new, _ in until_steady(warm_up_step, RankCompileWatch(c.rep) if compiled else None,
                                               MAX_WARM_UP_STEPS if compiled else 1):
            c.rep.emit("step_first_s" if i == 0 else "step_warm_up_s", seconds, "s", sync_kind=kind, warm_up_step=i,
                       new_graphs=new, note="an untimed warm-up step: the compile for the engine's LoRA, a fresh "
                                            "actor's state, the graphs of new text lengths", **tags)
    probe = None
    if onpolicy:
        def probe(batch):
            # with --offload the actor is off the device here: on for the probe, off again (untimed)
            if a.offload:
                actor.onload()
            try:
                return sampler_replay_gap(c, actor, batch[: a.micro_batch], replay_fn)
            finally:
                if a.offload:
                    actor.offload()
    gc_clock = GcClock()  # the garbage collector's pauses inside a timed step

    def timed_step(attempt: int) -> tuple[float, dict[str, float], Any, dict[str, Any]]:
        stages: dict[str, float] = {}
        peaks: dict[str, float] = {}
        retries = alloc_retries(c.device)
        gc_clock.take()
        with timed(c.device) as total:
            traj, degenerate, metrics, gap, probe_s = _one_step(c, update, actor, syncer, base + attempt, stages,
                                                                sampling, sde_indices, probe, peaks=peaks)
        pauses = gc_clock.take()
        counters = {"alloc_retries": None if retries is None
                    else c.rep.reduce(alloc_retries(c.device) - retries, "max"),
                    "gc_s": c.rep.reduce(pauses["perf/gc_time"], "max"),
                    "gc_full_collections": int(c.rep.reduce(pauses["perf/gc_full_collections"], "max")),
                    "stage_peak_mem_gb": {k: c.rep.reduce(v, "max") for k, v in sorted(peaks.items())} or None}
        return total[0] - probe_s, stages, (traj, degenerate, metrics, gap), counters

    # a timed step that still compiled a graph (a text length or variant the warm-up did not meet)
    # is not steady: it is recorded as such and the next one is timed
    try:
        for _, (seconds, stages, (traj, degenerate, metrics, gap), counters), new_graphs, last in until_steady(
                timed_step, RankCompileWatch(c.rep) if compiled else None, MAX_TIMED_ATTEMPTS if compiled else 1):
            if not last:
                c.rep.emit("step_compiled_s", seconds, "s", sync_kind=kind, new_graphs=new_graphs,
                           note="a step timed after the warm-up that compiled graphs: not steady, another one follows",
                           **tags)
    finally:
        gc_clock.close()
    stages = {k: c.rep.reduce(v, "max") for k, v in sorted(stages.items())}
    peak = c.rep.peak_gb()
    update_figures = {k.split("/", 1)[1]: v for k, v in metrics.items()
                      if k in ("train/optimizer_steps", "train/num_microbatches", "train/nft_old_decay",
                               "train/old_deviation", "train/ratio_mean", "train/ratio_max", "train/ratio_min")}
    c.rep.emit("step_s", seconds, "s", sync_kind=kind, offload=bool(a.offload), stages=stages,
               reward_degenerate=degenerate, candidates=len(traj), peak_mem_gb=peak, **counters,
               engine_fp8_weights_dropped=getattr(c.engine, "fp8_weights_dropped", 0),
               replay_fp8_shared_layers=sum(getattr(m, "fp8_source", None) is not None for m in actor.model.modules()),
               replay_fp8_mismatched_layers=c.replay_fp8_mismatched,
               replay_fp8_released_layers=c.replay_fp8_released[0],
               replay_fp8_released_gb=c.replay_fp8_released[1] / 1e9,
               fp8_fast_accum_layers={side: sum(bool(getattr(m, "fp8_fast_accum", False)) for m in model.modules())
                                      for side, model in (("engine", c.engine.transformer), ("actor", actor.model))},
               new_graphs=new_graphs, update=update_figures, rollout_split=rollout_split(c), **tags)
    if onpolicy:
        emit_onpolicy(c, actor, metrics, gap, tags)
    c.rep.phase_memory(f"step{step_label(algorithm, source)}")
    if a.profile_step is not None and not c.step_profiled:
        c.step_profiled = True
        phase_profile_step(c, update, actor, syncer, base + MAX_TIMED_ATTEMPTS, sampling, sde_indices, tags)


def share_fp8_weights(c: Ctx, actor) -> None:
    """As the trainer's loop does once the engine holds the adapter: an FP8 replay reads the FP8
    engine's copies of the frozen weights (train_model.share_engine_fp8_weights), unless
    --offload (the engine's modules leave the device during the update) or the step's variant has
    --replay-fp8-sharing off; with sharing on, fp8-dgrad's linked layers then free their own
    weights (core.fp8.release_linked_weights), as the loop's do, and keep leaves them."""
    from trainer.core.fp8 import release_linked_weights
    from trainer.train_model import share_engine_fp8_weights

    a = c.args
    c.replay_fp8_mismatched = 0  # a variant that links nothing reports none, not the last one's
    if a.replay_precision == "default" or a.offload or c.replay_fp8_variant[1] == "off" or a.sync_kind != "adapter":
        return
    _, c.replay_fp8_mismatched = share_engine_fp8_weights(actor.model, c.engine, c.adapter.weight_name_map,
                                                          c.dtype)
    if c.replay_fp8_variant[1] == "on":
        released = release_linked_weights(actor.model)
        if released[0]:  # a later variant of the same layers finds them released already
            c.replay_fp8_released = released
        _free(c.device)


def kernel_shares(c: Ctx, averages) -> tuple[dict[str, float], float]:
    """A profile's kernel time split by profile_share, and its total in seconds: on CUDA the
    kernels' own time (their launching ops would count it twice), on a CPU run the ops' self time."""
    cuda = c.device.type == "cuda"
    kinds = {k: 0.0 for k in (*_PROFILE_SHARES, "other")}
    for e in averages:
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kinds[profile_share(e.key)] += e.self_device_time_total if cuda else e.self_cpu_time_total
    total = sum(kinds.values())
    return {k: v / (total or 1.0) for k, v in kinds.items()}, total / 1e6


def phase_profile_step(c: Ctx, update, actor, syncer, rollout_id: int, sampling, sde_indices, tags: dict) -> None:
    """--profile-step PATH: one more step after the timed one, each of its stages (rollout, reward,
    update, sync) under a torch.profiler of its own. Rank 0 writes each stage's op table to PATH,
    one section a stage. step_profile_s (the step's seconds, the profilers' start and stop left out)
    carries per stage its seconds, the kernels' total and shares (as dit_profile_s's), and
    gpu_idle_s: the stage's seconds less its kernels' time, where the device waited on the host
    (launches, Python, synchronisation) or on a copy the profiler does not count as a kernel."""
    from torch.profiler import profile

    profs: dict[str, Any] = {}

    @contextlib.contextmanager
    def stage_ctx(name: str):
        with profile(activities=profile_activities(c.device)) as prof:
            yield
        profs[name] = prof

    stages: dict[str, float] = {}
    _one_step(c, update, actor, syncer, rollout_id, stages, sampling, sde_indices, stage_ctx=stage_ctx)
    sort_by, sections, split = profile_sort_key(c), [], {}
    for name, prof in profs.items():
        averages = prof.key_averages()
        shares, kernel_s = kernel_shares(c, averages)
        seconds = stages[name]
        split[name] = {"s": seconds, "kernel_s": kernel_s, "shares": shares,
                       "gpu_idle_s": max(seconds - kernel_s, 0.0) if c.device.type == "cuda" else None}
        sections.append(f"== {name}: {seconds:.3f} s, kernels {kernel_s:.3f} s ==\n"
                        + averages.table(sort_by=sort_by, row_limit=40) + "\n")
    path = c.args.profile_step
    if c.profile_suffix:  # one profile per FP8 replay variant
        path = path.with_name(f"{path.stem}-{c.profile_suffix}{path.suffix}")
    if c.rep.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(sections))
    c.rep.emit("step_profile_s", sum(v for k, v in stages.items() if k in profs), "s", path=str(path),
               sort_by=sort_by, written_by_rank=0, stages=split, **tags)


def emit_onpolicy(c: Ctx, actor, metrics: dict[str, float], gap: dict[str, float], tags: dict[str, str]) -> None:
    """step_onpolicy: the on-policy figures of a FlowGRPO step (phase_step's docstring). The value
    and the first-update fields are rank-local (Actor.last_update_stats), reduced by max here."""
    first = actor.last_update_stats[0] if actor.last_update_stats else None
    if first is None:  # every update skipped: nothing was replayed
        c.rep.emit("step_onpolicy", None, "ratio", skipped=True, **tags)
        return
    r_max, r_min, r_mean = (float(first[k]) for k in ("ratio_max", "ratio_min", "ratio_mean"))
    rep = c.rep
    gap_max = metrics.get("train/rollout_logprob_gap_max")
    rep.emit("step_onpolicy", max(r_max - 1.0, 1.0 - r_min), "ratio", **tags,
             first_update_ratio_mean=rep.reduce(r_mean, "mean"), first_update_ratio_max=rep.reduce(r_max, "max"),
             first_update_ratio_min=-rep.reduce(-r_min, "max"),
             rollout_logprob_gap_max=gap_max,
             sampler_replay_gap_max_abs=rep.reduce(gap["gap_max_abs"], "max"),
             sampler_replay_gap_mean=rep.reduce(gap["gap_mean"], "mean"),
             sampler_replay_kl=rep.reduce(gap["kl_mean"], "mean"),
             sampler_replay_kl_max=rep.reduce(gap["kl_max"], "max"),
             kl_ref=metrics.get("train/kl_ref"), gap_rows=c.args.micro_batch,
             note="first_update_*: the actor's first executed update; sampler_replay_*: the step's first micro-batch, "
                  "before the update; value: max |ratio - 1| of the first update")


def _one_step(c: Ctx, update: Callable[..., dict[str, float]], actor, syncer, rollout_id: int,
              stages: dict[str, float], sampling: Any = None, sde_indices: list[int] | None = None,
              probe: Callable[[Any], Any] | None = None,
              stage_ctx: Callable[[str], Any] = lambda name: contextlib.nullcontext(),
              peaks: dict[str, float] | None = None) -> tuple[Any, bool, dict[str, float], Any, float]:
    """The stages of phase_step, their seconds into `stages`; (trajectory, reward degenerate, the
    update's metrics, probe(batch)'s result, probe's seconds). probe runs between the reward and
    the update, outside every stage: the caller takes its seconds off the step's. stage_ctx(name):
    a context each of the rollout, reward, update and sync stages runs inside (--profile-step's
    profilers), outside its timer. peaks: given, each of the rollout's and the update's own peak
    memory (GB, CUDA) goes into it (Reporter.stage_peak)."""
    a = c.args
    if a.offload:
        with timed(c.device) as t:
            actor.offload()
        stages["actor_offload"] = t[0]
    with stage_ctx("rollout"), c.rep.stage_peak("rollout", peaks):
        traj, stages["rollout"] = rollout(c, rollout_id=rollout_id, sampling=sampling, sde_indices=sde_indices)
    if c.engine.compile_blocks:
        stages["rollout_new_graphs"] = c.engine.last_stats.get("new_graphs", 0.0)
    with stage_ctx("reward"):
        adv, valid, stages["reward"], degenerate = score(c, traj)
    batch = traj.without_images()
    found, probe_s = None, 0.0
    if probe is not None:
        with timed(c.device) as t:
            found = probe(batch)
        probe_s = t[0]
    if a.offload:
        with timed(c.device) as t:
            c.engine.release_memory()
            actor.onload()
        stages["swap_to_train"] = t[0]
    with stage_ctx("update"), c.rep.stage_peak("update", peaks), timed(c.device) as t:
        metrics = update(batch, adv, valid, rollout_id)
    stages["update"] = t[0]
    if a.offload:
        with timed(c.device) as t:
            c.engine.resume_memory()
        stages["swap_to_sync"] = t[0]
    with stage_ctx("sync"), timed(c.device) as t:
        syncer.sync(actor.model, c.engine)
    stages["sync"] = t[0]
    return traj, degenerate, metrics, found, probe_s


def phase_steps(c: Ctx, actor, replay_fn, kind: str) -> None:
    """The FlowGRPO steps of --algorithms, one per --old-logprob-source, on the bench's actor. The
    nft step is phase_nft_step's, on an actor of its own, after the caller drops this one."""
    from trainer.core.fp8 import set_fp8_fast_accum
    from trainer.train_model import set_replay_precision

    a = c.args
    if "flowgrpo" not in a.algorithms:
        return
    onpolicy = a.old_logprob_source is not None
    fp8 = a.replay_precision != "default"
    variants = a.replay_fp8_variants if fp8 else [c.replay_fp8_variant]
    for v, variant in enumerate(variants):
        c.replay_fp8_variant = variant
        if len(variants) > 1:  # --profile-step: a profile per variant
            c.step_profiled, c.profile_suffix = False, "-".join(variant)
        if v:  # another FP8 replay variant on the same actor: its layers swapped, its links undone
            fast = variant[2] == "fast"
            if variant[:2] == variants[v - 1][:2]:  # the accumulation alone (released weights stay released)
                set_fp8_fast_accum(actor.model, fast)
            else:
                set_replay_precision(actor.model, a.replay_precision, variant[0], fast_accum=fast)
            if c.engine.precision == "fp8":  # the sampler's GEMMs accumulate as the replay's
                set_fp8_fast_accum(c.engine.transformer, fast)
        for i, source in enumerate(a.old_logprob_source or ["replay"]):
            # one warm-up per actor and variant: the later sources find the compiled shapes and
            # AdamW state; a later variant recompiles the actor's blocks and links (or not) anew
            warm = (True if v and i == 0 else None if not onpolicy
                    else i == 0 and (c.engine.compile_blocks or actor.optimizer_steps == 0))
            phase_step(c, actor, replay_fn, kind, source=source, onpolicy=onpolicy, warm_up=warm)


def phase_nft_step(c: Ctx, replay_fn, kind: str) -> None:
    """The DiffusionNFT step of --algorithms nft: an actor built for it (its old policy included)
    over the same seeded base weights, then phase_step; freed after."""
    actor = build_actor(c.args, "lora", c.mesh, c.device, c.dtype, algorithm="nft")
    c.rep.phase_memory("build_actor_nft")
    phase_step(c, actor, replay_fn, kind, algorithm="nft", warm_up=True)
    actor.optimizer.zero_grad(set_to_none=True)
    del actor
    _free(c.device)


def run_full(c: Ctx, replay_fn, batch: dict, adv, valid) -> None:
    """--full: full fine-tune replay, update (where AdamW state fits) and full sync.

    Runs before any LoRA is installed in the engine (a full sync refuses a LoRA engine)."""
    a = c.args
    actor = build_actor(a, "full", c.mesh, c.device, c.dtype)
    c.rep.phase_memory("build_actor_full")
    phase_sync(c, actor, "full", verify=True)
    phase_sync(c, actor, "full", verify=False, label="full_sync_noverify_s")
    phase_sync(c, actor, "full", verify=False, label="full_sync_noverify_per_tensor_s", gather_mode="per_tensor")
    phase_sync(c, actor, "full", verify=False, label="full_sync_noverify_flat_s", gather_mode="flat")
    c.engine.release_memory()  # room for the full gradients; the engine's own release path
    phase_replay(c, actor, batch, replay_fn, "full")
    if _update_fits(c, actor):
        phase_update(c, actor, batch, adv, valid, replay_fn, "full")
    elif c.rep.rank == 0:
        print("# full fine-tune update skipped: parameters + gradients + AdamW moments do not fit beside the "
              "activations on this many devices (shard over more GPUs)", file=sys.stderr, flush=True)
    del actor
    _free(c.device)
    c.engine.resume_memory()
    _release_host_cache()  # the engine's pinned copies, now cached


def _update_fits(c: Ctx, actor) -> bool:
    """Whether a full-FT AdamW step fits on every rank: params + grads + 2 moments of the local
    shard, plus 10% and 8 GB of activations, under the free device memory (True on CPU). The
    answer is reduced over ranks so that all of them take the same branch (train_step is
    collective)."""
    if c.device.type != "cuda":
        return True
    from trainer.train_model import local_shard as _local

    local = sum(_local(p).numel() * _local(p).element_size() for p in actor.model.parameters())
    need = 4 * local * 1.1 + 8e9
    free, _total = torch.cuda.mem_get_info(c.device)
    return c.rep.reduce(1.0 if need < free else 0.0, "min") > 0.5


# ----------------------------------------------------------------------------------------------
# main

# ----------------------------------------------------------------------------------------------
# --scorers: each real-architecture reward model at random weights, on its own

#: CLIP towers (transformers CLIPConfig fields) of the scorers' published models
_CLIP_SHAPES = {
    # laion/CLIP-ViT-H-14 (PickScore_v1, HPSv2.1): 0.99 B parameters
    "vit_h_14": dict(text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16),
                     vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                                 patch_size=14, image_size=224, hidden_act="gelu"),
                     projection_dim=1024, text_act="gelu"),
    # openai/clip-vit-large-patch14 (CLIPScore, the aesthetic predictor): 0.43 B parameters
    "vit_l_14": dict(text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
                     vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                                 patch_size=14, image_size=224, hidden_act="quick_gelu"),
                     projection_dim=768, text_act="quick_gelu"),
    "tiny": dict(text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
                 vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             patch_size=8, image_size=32),
                 projection_dim=16, text_act="quick_gelu"),
}


def _random_clip(tower: str, tokenizer, seed: int):
    from transformers import CLIPConfig, CLIPModel

    shape = _CLIP_SHAPES[tower]
    cfg = CLIPConfig(
        text_config=dict(**shape["text"], vocab_size=49408, max_position_embeddings=77, hidden_act=shape["text_act"],
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=shape["vision"], projection_dim=shape["projection_dim"])
    torch.manual_seed(seed)
    return CLIPModel(cfg)


def bench_scorers(args: argparse.Namespace) -> int:
    """Time each real-architecture scorer on --score-images random images at random weights
    (built in memory: no weights are read), through the scorer's own score(). One JSON line per
    scorer: the mean of --iters timed calls after a warm-up."""
    import numpy as np

    from tools.tiny_clip import tiny_clip_processor
    from trainer.rewards.aesthetic import AestheticHead, AestheticScorer
    from trainer.rewards.base import ImageBatch
    from trainer.rewards.clipscore import ClipScoreScorer
    from trainer.rewards.hpsv2 import Hpsv21Scorer
    from trainer.rewards.pickscore import PickScoreScorer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    real = args.shape == "real"
    proc = tiny_clip_processor(224 if real else 32)
    tok = proc.tokenizer
    big, large = ("vit_h_14", "vit_l_14") if real else ("tiny", "tiny")
    rng = np.random.default_rng(args.seed)
    batch = ImageBatch([rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8)
                        for _ in range(args.score_images)])
    prompts = [f"prompt {i // 8}: a photo of a red panda in a teacup" for i in range(args.score_images)]

    def aesthetic():
        from transformers import CLIPVisionModelWithProjection

        clip = _random_clip(large, tok, args.seed)
        vcfg = clip.config.vision_config
        vcfg.projection_dim = clip.config.projection_dim
        vision = CLIPVisionModelWithProjection(vcfg)
        return AestheticScorer.from_modules(vision, AestheticHead(clip.config.projection_dim), proc.image_processor,
                                            device, dtype)

    builders = {
        "pickscore": lambda: PickScoreScorer.from_modules(_random_clip(big, tok, args.seed), proc, device, dtype),
        "hpsv21": lambda: Hpsv21Scorer.from_modules(_random_clip(big, tok, args.seed), tok, device, dtype),
        "clipscore": lambda: ClipScoreScorer.from_modules(_random_clip(large, tok, args.seed), proc, device, dtype),
        "aesthetic": aesthetic,
    }
    for name, build in builders.items():
        scorer = build()
        params = sum(p.numel() for p in (scorer.clip.model if hasattr(scorer, "clip") else scorer.vision).parameters())
        out = scorer.score(batch, prompts, [{}] * len(batch))  # warm-up (kernels, allocator)
        assert torch.isfinite(out[name]).all(), f"{name}: non-finite scores at random weights"
        times = []
        for _ in range(args.iters):
            _sync(device)
            t0 = time.perf_counter()
            scorer.score(batch, prompts, [{}] * len(batch))
            _sync(device)
            times.append(time.perf_counter() - t0)
        line = {"figure": "score_images_s", "scorer": name, "value": float(sum(times) / len(times)), "unit": "s",
                "images": len(batch), "height": args.height, "width": args.width, "params": int(params),
                "device": device_name(device), "dtype": str(dtype).replace("torch.", ""), "shape": args.shape}
        print(json.dumps(line), flush=True)
        if args.out is not None:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")
        del scorer
        _free(device)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from trainer.config import GrpoConfig
    from trainer.train_model import REPLAY_FP8_LAYERS, REPLAY_PRECISIONS

    p = tool_parser("bench", __doc__)
    p.add_argument("--family", choices=FAMILIES, default="qwen_image",
                   help="model family: qwen_image (Qwen-Image), sd3 (Stable Diffusion 3.5 Medium), flux "
                        "(FLUX.1-dev, tools/bench_flux.py), qwen_image_edit (Qwen-Image-Edit-2511 editing a "
                        "random source per prompt, tools/bench_edit.py's modules), flux_kontext (FLUX.1-Kontext "
                        "editing a random source per prompt: FLUX.1-dev's modules with the Kontext adapter) or wan "
                        "(Wan2.1 text-to-video, "
                        "tools/bench_wan.py's modules, random prompt embeddings in place of UMT5-XXL)")
    p.add_argument("--wan-size", choices=WAN_SIZES, default=None,
                   help="--family wan --shape real: the published Wan2.1-T2V model to build (unset: 1.3b; the "
                        "tiny shape is the test model)")
    p.add_argument("--frames", type=int, default=None,
                   help="frames per video, --family wan only: of the form 4k+1 (the VAE encodes the first frame "
                        "alone, then groups of 4); unset: 33 (real, FlowGRPO's Wan recipe), 5 (tiny). The image "
                        "families draw one frame")
    p.add_argument("--shape", choices=SHAPES, default="tiny",
                   help="tiny: the family's test model (the default: seconds on a CPU, safe on a shared host); "
                        "real: Qwen-Image 20.4 B / SD3.5-Medium 2.24 B / FLUX.1-dev 11.9 B, a GPU's job: refused "
                        "before anything is allocated when its parameters cannot fit in free memory")
    p.add_argument("--flowgrpo-path", type=Path, default=None, metavar="DIR",
                   help="a local FlowGRPO checkout, imported at run time and timed on the same modules (nothing "
                        "is copied): --family sd3 times its SD3 rollout function (flow_grpo/diffusers_patch/"
                        "sd3_pipeline_with_logprob.py: flowgrpo_rollout_s, flowgrpo_vs_native); --compare flowgrpo "
                        "times its Qwen-Image one (qwenimage_pipeline_with_logprob.py)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="unset: cuda when available")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="unset: bf16 on cuda, fp32 on cpu")
    p.add_argument("--output", "--out", dest="out", type=Path, default=None,
                   help="JSON-lines file the figures are appended to")
    p.add_argument("--height", type=int, default=None,
                   help="image height; a multiple of 16 (real) / 8 (tiny; 16 for --family wan); unset: 384 (real), "
                        "64 (tiny); --family wan: 240 (real), 32 (tiny)")
    p.add_argument("--width", type=int, default=None, help="image width; unset: as --height's default")
    p.add_argument("--steps", type=int, default=12, help="denoising steps per image")
    p.add_argument("--trained-steps", type=int, default=3, help="SDE steps drawn from --sde-pool per rollout")
    p.add_argument("--sde-pool", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="SDE step pool")
    p.add_argument("--eta", type=float, default=0.7, help="SDE noise level")
    p.add_argument("--guidance-scale", type=float, default=1.0,
                   help="> 1: true CFG (two DiT rows per candidate in rollout and replay; FLOPs count both)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per GPU")
    p.add_argument("--group-size", type=int, default=8, help="candidates per prompt (prompts x group = per GPU)")
    p.add_argument("--text-tokens", type=int, default=None,
                   help="text conditioning length of every prompt; unset: 128 (--family wan: 512, the UMT5 window)")
    p.add_argument("--text-tokens-spread", type=int, default=0,
                   help="Qwen-Image: every rollout draws new prompts whose text lengths spread over "
                        "[--text-tokens - K, --text-tokens] (a run's prompts vary in length: batches then carry "
                        "the attention mask and compiled blocks see changing lengths); 0: every prompt has "
                        "exactly --text-tokens, the same prompts in every rollout. MFU still counts --text-tokens")
    p.add_argument("--engine-batch-size", "--max-batch", dest="max_batch", type=int, default=0,
                   help="engine candidates per DiT forward; 0 = all")
    p.add_argument("--micro-batch-size", "--micro-batch", dest="micro_batch", type=int, default=8,
                   help="replay micro-batch; must divide each update's share")
    p.add_argument("--num-updates-per-batch", "--num-updates", dest="num_updates", type=int, default=2,
                   help="optimizer steps per rollout, as in training")
    p.add_argument("--lora-rank", type=int, default=64, help="LoRA rank")
    p.add_argument("--lora-alpha", type=int, default=128, help="LoRA alpha")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--activation-checkpointing-every", type=int, default=1,
                   help="checkpoint only every k-th block of the actors the replay, update and step phases "
                        "build (1: every block; 2: blocks 0, 2, 4, ...): fewer recomputed forwards for more "
                        "stored activations")
    p.add_argument("--fsdp-frozen-params", choices=("auto", "shard", "replicate"), default="auto",
                   help="the LoRA actors' frozen base: sharded by FSDP2 or whole on each rank outside it, as the "
                        "trainer's flag (auto: whole on one rank); the figures' geometry says which")
    p.add_argument("--weight-sync-bucket-size-mb", "--bucket-mb", dest="bucket_mb", type=float, default=2048,
                   help="weight sync bucket size, as in training")
    p.add_argument("--sync-kind", choices=("adapter", "merged"), default="adapter", help="LoRA sync of the step")
    p.add_argument("--full", action="store_true", help="also time full fine-tune replay / update and the full sync")
    p.add_argument("--offload", action="store_true", help="the step offloads actor / engine around each stage")
    p.add_argument("--skip", nargs="+", default=[], choices=SKIPPABLE, metavar="PHASE",
                   help=f"phases to leave out, of {SKIPPABLE} (e.g. offload when host RAM is short); the rollout "
                        "always runs, it feeds the others. fp8_grad: with --replay-precision fp8 / fp8-dgrad, the LoRA "
                        "gradient's comparison with the compute dtype (replay_fp8_grad_rel_diff; two more "
                        "micro-batch gradients, which the 60-block model on one H200 has no room for at "
                        "micro-batch 8). eager: with --rollout-compile / --rollout-precision fp8, "
                        "leave out the eager DiT forward and rollout timed before the speed options are switched on "
                        "(and so rollout_speedup); the rollout with the speed options still runs and feeds the rest")
    p.add_argument("--dit-batches", type=int, nargs="+", default=[1, 8, 32],
                   help="batch sizes of the DiT forward timing")
    p.add_argument("--iters", type=int, default=2, help="timed repetitions after the warm-up")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="MFU denominator; unset: the measured dense GEMM throughput")
    p.add_argument("--gemm-size", type=int, default=8192, help="size of the GEMM that measures the peak")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    p.add_argument("--num-layers", type=int, default=None,
                   help="DiT blocks of --shape real, at full width (default 60: the whole model); compares "
                        "with a product-path run on a model directory of that depth")
    p.add_argument("--scorers", action="store_true",
                   help="only time the reward scorers (PickScore, HPSv2.1, CLIPScore, aesthetic) at random weights")
    p.add_argument("--score-images", type=int, default=32, help="images per scorer call with --scorers")
    p.add_argument("--rollout-compile", action="store_true",
                   help="the engine's repeated DiT blocks under torch.compile (the trainer's --rollout-compile)")
    p.add_argument("--rollout-precision", choices=("default", "fp8"), default="default",
                   help="the engine's DiT linears in FP8 (the trainer's --rollout-precision)")
    p.add_argument("--fsdp-compile", action="store_true",
                   help="the actor's blocks under torch.compile (the trainer's --fsdp-compile)")
    p.add_argument("--replay-precision", choices=REPLAY_PRECISIONS, default="default",
                   help="the LoRA actor's frozen base GEMMs in FP8, with fp8-dgrad their input gradient too (the "
                        "trainer's --replay-precision): every replay, "
                        "update and step figure then times it, and replay_fp8_grad_rel_diff compares its LoRA "
                        "gradient with the compute dtype's on the same batch")
    p.add_argument("--replay-fp8-layers", choices=REPLAY_FP8_LAYERS, default="lora-base",
                   help="with --replay-precision fp8 / fp8-dgrad: the LoRA base layers only, or every frozen block "
                        "linear (the trainer's --replay-fp8-layers)")
    p.add_argument("--replay-fp8-sharing", choices=REPLAY_FP8_SHARING, default="on",
                   help="with --replay-precision fp8 / fp8-dgrad and --rollout-precision fp8: on: the actor's FP8 "
                        "layers read the engine's FP8 copies of their frozen weights, linked after the step's first "
                        "adapter sync as the trainer links them, and under fp8-dgrad free their own weights, which "
                        "nothing reads any more (the trainer does too; no later variant can switch them back); keep: "
                        "linked, their weights kept; off: they quantize their weight at every forward")
    p.add_argument("--adam-fused", action="store_true",
                   help="the actor's AdamW as torch's fused kernel (the trainer's --adam-fused)")
    p.add_argument("--optimizers", action="store_true",
                   help=f"time one AdamW step over copies of the LoRA actor's trainable tensors as each of "
                        f"{ADAMW_IMPLEMENTATIONS} (optimizer_step_s, with fused's largest difference from foreach)")
    p.add_argument("--fp8-fast-accum", action="store_true",
                   help="the FP8 forward GEMMs of the engine and the actor with fast accumulation (the trainer's "
                        "--fp8-fast-accum); the default accumulation of --replay-fp8-variants' entries")
    p.add_argument("--replay-fp8-variants", nargs="+", default=None, metavar="LAYERS:SHARING[:ACCUM]",
                   help="the step phase once per entry (e.g. lora-base:off frozen:on frozen:on:fast), on the same "
                        "actor and engine, switching in between: FP8 replay variants compared in one process; ACCUM "
                        f"(one of {FP8_ACCUMULATIONS}) sets the FP8 forward GEMMs' accumulation, the engine's too "
                        "(unset: --fp8-fast-accum's). The first entry builds the actor and serves the other phases; "
                        "unset: --replay-fp8-layers:--replay-fp8-sharing")
    p.add_argument("--algorithms", nargs="+", default=["flowgrpo"], choices=ALGORITHMS, metavar="ALGORITHM",
                   help=f"the updates the step phase times, each top to bottom as the trainer's --algorithm runs it, "
                        f"of {ALGORITHMS} (FlowGRPO first, on the bench's actor; nft on a fresh actor built after "
                        "the FlowGRPO one is freed, with the config's --nft-* defaults and --adv-clip-max "
                        f"{NFT_ADV_CLIP_MAX}); step_s carries an algorithm field")
    p.add_argument("--old-logprob-source", nargs="+", default=None, choices=OLD_LOGPROB_SOURCES, metavar="SOURCE",
                   help=f"the FlowGRPO step once per source, of {OLD_LOGPROB_SOURCES} (the trainer's "
                        "--old-logprob-source), each with the on-policy figures beside it (step_onpolicy); unset: "
                        "replay only, without step_onpolicy")
    p.add_argument("--nft-timestep-fraction", type=float, default=GrpoConfig.nft_timestep_fraction,
                   help="the nft step's noise levels per sample, as the trainer's flag (in (0, 1]; default: the "
                        "config's)")
    p.add_argument("--nft-sigmas-per-forward", type=int, default=GrpoConfig.nft_sigmas_per_forward,
                   help="the nft step's noise levels per DiT forward, as the trainer's flag (>= 0, 0: all of a "
                        "micro-batch's levels in one; default: the config's)")
    p.add_argument("--compare", nargs="+", default=[], choices=COMPARE_PATHS, metavar="PATH",
                   help=f"also time the same rollout through other code on the same modules, before the engine's "
                        f"speed options are switched on: any of {COMPARE_PATHS} (flowgrpo needs --flowgrpo-path and "
                        "--guidance-scale > 1: its rollout function always runs CFG)")
    p.add_argument("--compare-batch", type=int, default=0,
                   help="prompts per call of the --compare paths (0: all candidates in one call)")
    p.add_argument("--replay-variants", action="store_true",
                   help=f"also time LoRA replay with each of {tuple(REPLAY_VARIANTS)} (an actor built per variant; "
                        "out of memory gives a null figure with oom: true)")
    p.add_argument("--profile-replay", type=Path, default=None, metavar="PATH",
                   help="profile one LoRA replay micro-batch (forward + backward) and write the op table to PATH")
    p.add_argument("--profile-rollout", type=Path, default=None, metavar="PATH",
                   help="profile one DiT forward at the rollout's batch, with the speed options, and write the op "
                        "table to PATH (dit_profile_s: the kernels' shares in GEMMs, attention, FP8 quantization "
                        "and the rest)")
    p.add_argument("--profile-step", type=Path, default=None, metavar="PATH",
                   help="after the timed step, one more step with each stage (rollout, reward, update, sync) under "
                        "torch.profiler: the stages' op tables to PATH, and step_profile_s with each stage's kernel "
                        "time, its shares and the device's idle time (the stage's seconds less its kernels')")
    p.add_argument("--vae-decode", action="store_true",
                   help="time the rollout's VAE decode with diffusers' causal 3-D convolutions and with the 2-D ones "
                        "they equal on one frame, which the rollout runs (vae_decode_s, vae_decode_max_abs_diff; "
                        "Qwen-Image's VAE)")
    p.add_argument("--gemms", action="store_true",
                   help=f"time each linear GEMM of the DiT's blocks at the rollout's batch as {GEMM_VARIANTS} "
                        "(gemm_tflops, dit_gemms_s), and the FP8 activation quantization alone at each input beside a "
                        "copy of it (quantize_s, dit_quantize_s)")
    args = p.parse_args(argv)
    variants = args.replay_fp8_variants or [f"{args.replay_fp8_layers}:{args.replay_fp8_sharing}"]
    accum = "fast" if args.fp8_fast_accum else "full"
    args.replay_fp8_variants = [tuple(v.split(":", 2)) + ((accum,) if v.count(":") == 1 else ()) for v in variants]
    for i, (v, (layers, *sharing)) in enumerate(zip(variants, args.replay_fp8_variants)):
        if (layers not in REPLAY_FP8_LAYERS or len(sharing) != 2 or sharing[0] not in REPLAY_FP8_SHARING
                or sharing[1] not in FP8_ACCUMULATIONS):
            p.error(f"--replay-fp8-variants {v}: each entry is LAYERS:SHARING[:ACCUM] with LAYERS one of "
                    f"{REPLAY_FP8_LAYERS}, SHARING one of {REPLAY_FP8_SHARING} and ACCUM one of {FP8_ACCUMULATIONS} "
                    "(e.g. lora-base:off frozen:on frozen:on:fast)")
        if sharing[1] == "fast" and args.replay_precision == "default" and args.rollout_precision == "default":
            p.error(f"--replay-fp8-variants {v} / --fp8-fast-accum: fast accumulation is the FP8 GEMMs'; add "
                    "--rollout-precision fp8 or --replay-precision fp8 (or fp8-dgrad)")
        later = args.replay_fp8_variants[i + 1:]
        if (args.replay_precision == "fp8-dgrad" and sharing[0] == "on"
                and any(w[:2] != (layers, "on") for w in later)):
            p.error(f"--replay-fp8-variants {v}: with --replay-precision fp8-dgrad, sharing on frees the actor's "
                    "linked weights, so no later entry could switch its layers: put it last (or follow it only with "
                    f"{layers}:on:ACCUM entries), or use {layers}:keep here")
    video = args.family == "wan"
    if video:  # FlowGRPO's Wan geometry (33 x 240 x 416) at the real shape, 5 x 32 x 32 at the tiny one
        height, width = (240, 416) if args.shape == "real" else (32, 32)
    else:
        height = width = 384 if args.shape == "real" else 64  # the tiny SD3 DiT draws at most 192 pixels a side
    args.height = height if args.height is None else args.height
    args.width = width if args.width is None else args.width
    args.text_tokens = (512 if video else 128) if args.text_tokens is None else args.text_tokens
    check_video_flags(p, args)
    skip = set(args.skip)
    if "eager" in skip and args.rollout_precision == "default" and not args.rollout_compile:
        p.error("--skip eager leaves out the eager rollout timed before the speed options; without --rollout-compile "
                "or --rollout-precision fp8 the eager rollout is the only one (it feeds every other phase): drop "
                "eager from --skip or add a speed option")
    if "eager" in skip and args.compare:
        p.error("--compare's ratios are against the eager rollout: drop eager from --skip or drop --compare")
    if "flowgrpo" in args.compare and (args.flowgrpo_path is None or args.guidance_scale <= 1.0):
        p.error("--compare flowgrpo needs --flowgrpo-path (a local FlowGRPO checkout) and --guidance-scale > 1 "
                "(FlowGRPO's Qwen-Image rollout function always runs true CFG)")
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    if args.activation_checkpointing_every < 1:
        p.error(f"--activation-checkpointing-every must be >= 1, got {args.activation_checkpointing_every}")
    if args.flowgrpo_path is not None and args.family != "sd3" and "flowgrpo" not in args.compare:
        p.error("--flowgrpo-path is read by --family sd3 (FlowGRPO's SD3 rollout function) or by --compare flowgrpo "
                "(its Qwen-Image one): add one of them")
    if args.compare and args.family != "qwen_image":
        p.error(f"--compare times Qwen-Image pipelines, not --family {args.family}'s (--family sd3 times FlowGRPO's "
                "SD3 rollout with --flowgrpo-path)")
    args.algorithms = list(dict.fromkeys(args.algorithms))
    if args.old_logprob_source is not None:
        args.old_logprob_source = list(dict.fromkeys(args.old_logprob_source))
        if "flowgrpo" not in args.algorithms:
            p.error("--old-logprob-source sets the FlowGRPO step's pi_old: add flowgrpo to --algorithms")
    if "nft" in args.algorithms and args.guidance_scale > 1.0:
        p.error("--algorithms nft samples CFG-free (the trainer refuses --algorithm nft with guidance_scale > 1): "
                "drop nft or --guidance-scale")
    if not 0.0 < args.nft_timestep_fraction <= 1.0:
        p.error(f"--nft-timestep-fraction must be in (0, 1], got {args.nft_timestep_fraction}")
    if args.nft_sigmas_per_forward < 0:
        p.error(f"--nft-sigmas-per-forward must be >= 0, got {args.nft_sigmas_per_forward}")
    if args.text_tokens_spread and args.family != "qwen_image":
        p.error(f"--text-tokens-spread varies Qwen-Image's prompt lengths; --family {args.family} pads every prompt "
                "to its window or draws fixed prompts: drop it")
    if not 0 <= args.text_tokens_spread < args.text_tokens:
        p.error(f"--text-tokens-spread must be in [0, --text-tokens = {args.text_tokens}), got {args.text_tokens_spread}")
    if args.prompts * args.group_size % (args.num_updates * args.micro_batch):
        p.error(f"--micro-batch-size {args.micro_batch} x --num-updates-per-batch {args.num_updates} must divide "
                f"the {args.prompts * args.group_size} candidates per GPU (--prompts x --group-size)")
    return args


def check_video_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--frames / --wan-size against --family (p.error, exit 2, on the first problem): the image
    families draw one frame; --family wan needs 4k+1 frames and sizes that are multiples of 16
    (trainer.video's rules, WanPipeline's), and sets --frames and --wan-size's defaults."""
    from trainer.video import frames_problem, size_problem

    if args.family != "wan":
        if args.frames not in (None, 1):
            p.error(f"--frames {args.frames}: --family {args.family} draws images (one frame); --frames is "
                    "--family wan's (videos)")
        if args.wan_size is not None:
            p.error(f"--wan-size picks the Wan2.1 model of --family wan, not --family {args.family}'s")
        args.frames = 1
        return
    args.frames = (33 if args.shape == "real" else 5) if args.frames is None else args.frames
    args.wan_size = args.wan_size or "1.3b"
    problem = frames_problem(args.frames)
    if problem:
        p.error(f"--frames: {problem.replace('num_frames', 'frames')}")
    problem = size_problem(args.height, args.width)
    if problem:
        p.error(f"--height / --width: {problem}")
    if args.num_layers is not None:
        p.error("--num-layers shortens the image families' real DiTs; --family wan builds the published sizes "
                "(--wan-size 1.3b or 14b)")


def meta_param_count(factory: Callable[[], torch.nn.Module]) -> int:
    """Parameters of `factory()`, built on the meta device: no memory, no init."""
    return sum(p.numel() for p in _meta_build(factory, torch.float32).parameters())


def real_param_counts() -> tuple[int, int]:
    """(DiT, VAE + text encoder) parameters of the real Qwen-Image shape (after --num-layers)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tools.make_tiny_model import build_tokenizer

    _, vae, _, _ = shape_configs("real")
    text = text_encoder_config("real", build_tokenizer())
    return (dit_param_counts(shape_configs("real")[0])["total"],
            meta_param_count(lambda: AutoencoderKLQwenImage(**vae))
            + meta_param_count(lambda: Qwen2_5_VLForConditionalGeneration(text)))


def available_bytes(device_type: str) -> tuple[int, str]:
    """(free bytes, where the figure comes from) of this rank's device: the GPU's free memory, or
    the host's MemAvailable on CPU."""
    if device_type == "cuda":
        free, _ = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))
        return int(free), f"free on {torch.cuda.get_device_name(int(os.environ.get('LOCAL_RANK', '0')))}"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024, "available on this host (/proc/meminfo MemAvailable)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "available on this host"


def memory_estimate(dit: int, rest: int, dtype_bytes: int, device_type: str, world: int) -> int:
    """A lower bound of the bytes the real-shape bench holds at once, parameters only: every rank's
    engine (its DiT, VAE and text encoders) plus the actor's DiT, sharded over the ranks. On CPU
    every rank lives on this one host; on CUDA each has its own device."""
    if device_type == "cuda":
        return (dit + rest + -(-dit // world)) * dtype_bytes
    return (world * (dit + rest) + dit) * dtype_bytes


def memory_problem(args: argparse.Namespace, fam: SimpleNamespace, device_type: str, dtype: torch.dtype) -> str | None:
    """Why --shape real cannot run here (None when it may): its parameters alone, estimated from the
    shape on the meta device before anything is allocated, exceed the free memory."""
    dit, rest = fam.real_param_counts()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    size = torch.empty((), dtype=dtype).element_size()
    need = memory_estimate(dit, rest, size, device_type, world)
    have, where = available_bytes(device_type)
    if need <= have:
        return None
    gb = 1e9
    return (f"--shape real --family {args.family} needs at least {need / gb:.1f} GB for its parameters alone (the "
            f"engine's {dit / 1e9:.2f} B DiT + {rest / 1e9:.2f} B VAE and text encoders, and the actor's DiT, in "
            f"{args.dtype}{f' on each of {world} ranks' if world > 1 else ''}), but {have / gb:.1f} GB is {where}. "
            "Use --shape tiny (the default) for a smoke test, or run --shape real on a GPU with that much free "
            "memory (--num-layers N builds a shallower real-width DiT)")


def main(argv: Sequence[str] | None = None) -> int:
    import torch.distributed as dist

    from trainer.distributed import build_mesh, init_distributed
    from trainer.loop import make_replay_fn
    from trainer.models.base import apply_attention_policy
    from trainer.sampling import parse_sampling_config, resolve_sde_indices
    from trainer.train_model import replicates_frozen

    args = parse_args(argv)
    fam = parts_of(args)
    if args.num_layers and args.shape == "real":
        REAL_TRANSFORMER_CONFIG["num_layers"] = int(args.num_layers)
        from tools.bench_flux import REAL_FLUX_TRANSFORMER_CONFIG
        from tools.bench_sd3 import REAL_SD3_TRANSFORMER_CONFIG

        REAL_SD3_TRANSFORMER_CONFIG["num_layers"] = int(args.num_layers)
        REAL_SD3_TRANSFORMER_CONFIG["dual_attention_layers"] = tuple(
            i for i in REAL_SD3_TRANSFORMER_CONFIG["dual_attention_layers"] if i < int(args.num_layers))
        # N double-stream blocks and 2N single-stream ones, FLUX.1-dev's 19 : 38
        REAL_FLUX_TRANSFORMER_CONFIG["num_layers"] = int(args.num_layers)
        REAL_FLUX_TRANSFORMER_CONFIG["num_single_layers"] = 2 * int(args.num_layers)
    if args.scorers:
        return bench_scorers(args)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if device_type == "cuda" else "fp32")
    dtype = _DTYPES[args.dtype]
    problem = memory_problem(args, fam, device_type, dtype) if args.shape == "real" else None
    if problem is None and (args.rollout_compile or args.fsdp_compile):
        from trainer.preflight import torch_compile_cache_problem

        problem = torch_compile_cache_problem()  # the trainer's preflight rule: compiled code is loaded from it
    if problem:
        if os.environ.get("RANK", "0") == "0":
            print(f"bench: error: {problem}", file=sys.stderr)
        return 2
    created = not dist.is_initialized()
    info = init_distributed(device_type)
    try:
        mesh = build_mesh(device_type)
        device = info.device
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine = fam.build_engine(args.shape, device, dtype, args.max_batch, seed=args.seed,
                                  text_tokens=args.text_tokens)
        build_s = time.perf_counter() - t0
        adapter = fam.adapter(vae_scale_factor=engine.vae_scale_factor)
        # before any rollout or replay, as the training loop does (FLUX: cuDNN attention off on CUDA)
        apply_attention_policy(adapter, device)
        sampling = parse_sampling_config({
            "height": args.height, "width": args.width, "num_inference_steps": args.steps, "eta": args.eta,
            "sde_type": "sde", "sde_resample_per_rollout": True, "num_sde_steps": args.trained_steps,
            "sde_pool": list(args.sde_pool), "guidance_scale": args.guidance_scale, **fam.sampling})
        sde_indices = resolve_sde_indices(sampling, args.steps, rollout_id=0)
        prompts = fam.prompts(engine, args.prompts, args.text_tokens)
        media = None
        if hasattr(fam, "sources"):  # an editing family: one random source per prompt, at the output size
            import atexit
            import shutil
            import tempfile

            sources_dir = tempfile.mkdtemp(prefix="bench-sources-")
            atexit.register(shutil.rmtree, sources_dir, True)
            media = fam.sources(sources_dir, args.prompts, args.height)
        text_tokens = int((engine.encode_condition(prompts[0], media[:1], (args.height, args.width)) if media
                           else engine.encode_prompt(prompts[0]))["prompt_embeds"].shape[0])
        dit_cfg = dict(engine.transformer.config)
        image_tokens = fam.image_tokens(args.height, args.width, engine.vae_scale_factor, dit_cfg)
        geometry = {"family": args.family, "shape": args.shape, "height": args.height, "width": args.width, "steps": args.steps,
                    "trained_steps": len(sde_indices), "sde_indices": sde_indices, "eta": args.eta,
                    "guidance_scale": args.guidance_scale,
                    "prompts": args.prompts, "group_size": args.group_size,
                    "candidates": args.prompts * args.group_size, "image_tokens": image_tokens,
                    "dit_layers": int(dit_cfg["num_layers"]),
                    "text_tokens": text_tokens, "max_batch": args.max_batch, "micro_batch": args.micro_batch,
                    "num_updates": args.num_updates, "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha,
                    "activation_checkpointing": not args.no_activation_checkpointing, "dtype": args.dtype,
                    **({"activation_checkpointing_every": args.activation_checkpointing_every}
                       if args.activation_checkpointing_every != 1 else {}),
                    "replay_precision": args.replay_precision,
                    "frozen_params": "replicate" if replicates_frozen(args.fsdp_frozen_params, info.world_size) else "shard",
                    **({"replay_fp8_layers": args.replay_fp8_variants[0][0]}
                       if args.replay_fp8_variants[0][0] != "lora-base" else {}),
                    **({"fp8_fast_accum": True} if args.replay_fp8_variants[0][2] == "fast" else {}),
                    **({"text_tokens_spread": args.text_tokens_spread} if args.text_tokens_spread else {}),
                    **fam.geometry(dit_cfg)}
        rep = Reporter(args.out, device, geometry, rank=info.rank, world_size=info.world_size)
        peak = args.peak_tflops
        if peak is None:
            gemm = args.gemm_size if device.type == "cuda" else min(args.gemm_size, 256)
            peak = rep.reduce(matmul_tflops(device, dtype, gemm, iters=50 if device.type == "cuda" else 5), "min")
            rep.emit("matmul_tflops", peak, "TFLOP/s", gemm=gemm)
        rep.emit("build_engine_s", build_s, "s")
        rep.phase_memory("build_engine")
        c = Ctx(args, device, dtype, rep, mesh, engine, adapter, sampling, sde_indices, prompts, dit_cfg,
                image_tokens, text_tokens, peak, fam.forward_flops, media=media, video=getattr(fam, "video", False),
                items=getattr(fam, "items", "images"), replay_fp8_variant=args.replay_fp8_variants[0])
        if args.text_tokens_spread:  # Qwen-Image's prompts (parse_args refuses the other families)
            c.rollout_prompts = lambda rollout_id: fam.prompts(
                engine, args.prompts,
                spread_lengths(args.prompts, args.text_tokens, args.text_tokens_spread, rollout_id, args.seed),
                salt=f" take {rollout_id}")

        skip = set(args.skip)
        speedups = args.rollout_compile or args.rollout_precision != "default"
        variant = rollout_variant(args)
        traj = None
        # the eager engine first: every ratio comes from this process (--skip eager: the speed options only)
        if (args.compare or speedups) and "eager" not in skip:
            if "dit" not in skip:
                phase_dit_forward(c, variant="eager")
            traj = phase_rollout(c, variant="eager")
            for path in args.compare:
                phase_compare(c, path)
        rows = rollout_rows(c)
        if args.gemms:  # eager forward hooks find the shapes: before any block is compiled
            phase_gemms(c, rows)
        if speedups:
            with timed(device) as t:
                engine.enable_speedups(compile_blocks=args.rollout_compile, precision=args.rollout_precision,
                                       fp8_fast_accum=(args.rollout_precision == "fp8"
                                                       and args.replay_fp8_variants[0][2] == "fast"))
            from trainer.core.fp8 import FP8Linear

            # FP8 takes only linears whose sizes are multiples of 16: a narrow test DiT may have none
            fp8_linears = sum(isinstance(m, FP8Linear) for m in engine.transformer.modules())
            rep.emit("enable_speedups_s", t[0], "s", variant=variant, fp8_linears=fp8_linears)
        if "dit" not in skip and (speedups or traj is None):
            phase_dit_forward(c, variant=variant)
        if args.profile_rollout is not None:
            phase_profile_dit(c, rows, args.profile_rollout)
        if "checksum" not in skip:
            phase_checksum(c)
        if speedups or traj is None:  # the eager figures of a --compare-only run are the ones above
            traj = phase_rollout(c, variant=variant)
        if args.vae_decode:
            phase_vae_decode(c)
        if args.flowgrpo_path is not None and args.family == "sd3":
            from tools.bench_sd3 import phase_flowgrpo

            phase_flowgrpo(c, args.flowgrpo_path)
        adv, valid, score_s, degenerate = score(c, traj)
        scorer = "color" if not c.video else f"framewise color: {bench_scorer(True)[0].describe()}"
        rep.emit("reward_s", score_s, "s", scorer=scorer, degenerate=degenerate)
        batch = traj.without_images()
        replay_fn = make_replay_fn(adapter)  # the training loop's own

        if args.full:
            run_full(c, replay_fn, batch, adv, valid)
        if args.replay_variants:
            phase_replay_variants(c, batch, replay_fn)

        if variant != "eager" and "eager" in c.images_per_s:
            rep.emit("rollout_speedup", c.images_per_s[variant] / c.images_per_s["eager"], "ratio", variant=variant)
        actor = build_actor(args, "lora", mesh, device, dtype)
        rep.phase_memory("build_actor_lora")
        phase_rollout_gap(c, actor, traj, replay_fn, variant)
        rep.phase_memory("rollout_gap")  # the first step's peak is its own, as every later variant's
        if "merged" not in skip:
            phase_sync(c, actor, "merged", verify=True)
            phase_sync(c, actor, "merged", verify=False, label="merged_sync_noverify_s")
        if "replay" not in skip:
            phase_replay(c, actor, batch, replay_fn, "lora")
        if args.profile_replay is not None:
            phase_profile_replay(c, actor, batch, replay_fn, args.profile_replay)
        if args.optimizers:
            phase_optimizers(c, actor)
        if "update" not in skip:
            phase_update(c, actor, batch, adv, valid, replay_fn, "lora")
        if args.replay_precision != "default" and "fp8_grad" not in skip:  # after the update: LoRA B is no longer 0
            phase_replay_precision(c, actor, batch, adv, replay_fn)
        if args.sync_kind == "adapter" and "adapter" not in skip:  # installs LoRA in the engine
            phase_sync(c, actor, "adapter")
            phase_sync(c, actor, "adapter", label="adapter_sync_per_tensor_s", gather_mode="per_tensor")
        if "offload" not in skip:
            phase_offload(c, actor, "lora")
        if "step" not in skip:
            phase_steps(c, actor, replay_fn, args.sync_kind)
            if "nft" in args.algorithms:  # the FlowGRPO actor leaves the device before the nft one is built
                actor = None
                _free(device)
                phase_nft_step(c, replay_fn, args.sync_kind)
        return 0
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
