"""The Stable Diffusion 3.5 parts of tools/bench.py (--family sd3): the modules at SD3.5-Medium
shape (or the tiny test shape) with random weights, its FLOP model, and the optional timing of
FlowGRPO's own SD3 rollout function on the same modules.

Nothing is read from disk: the DiT (SD3.5-Medium's MMDiT-X, 2.24 B parameters), the VAE, CLIP-L,
CLIP-G and T5-XXL are built from configs on the meta device and filled with random values on the
device (tools/bench.py:materialise); the tokenizers are the offline ones of tools/tiny_sd3.py.

FlowGRPO's rollout (`--flowgrpo-path` = a local checkout of yifan123/flow_grpo): its
`flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py::pipeline_with_logprob` is imported from
that checkout at run time (nothing of it is part of this project) and called on a diffusers
StableDiffusion3Pipeline assembled from the engine's own modules, at the same geometry, prompts,
guidance and noise level, in the same process; `flowgrpo_rollout_s` and the ratio to the native
engine's rollout are reported.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

#: SD3.5-Medium's transformer/config.json (SD3Transformer2DModel, 2.24 B parameters; Stability quotes 2.5 B)
REAL_SD3_TRANSFORMER_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                                   attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                   caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                                   pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                                   qk_norm="rms_norm")
#: SD3.5's vae/config.json (AutoencoderKL, 16 latent channels, 8x)
REAL_SD3_VAE_CONFIG = dict(in_channels=3, out_channels=3,
                           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                           block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                           norm_num_groups=32, sample_size=1024, use_quant_conv=False, use_post_quant_conv=False,
                           scaling_factor=1.5305, shift_factor=0.0609)
#: CLIP ViT-L/14 and OpenCLIP bigG/14 text towers with projection, T5 v1.1 XXL encoder
REAL_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu", max_position_embeddings=77)
REAL_CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                   num_attention_heads=20, projection_dim=1280, hidden_act="gelu", max_position_embeddings=77)
REAL_T5 = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", dropout_rate=0.0)
#: SD3.5's scheduler/scheduler_config.json
SD3_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def real_param_counts() -> tuple[int, int]:
    """(DiT, VAE + the three text encoders) parameters of SD3.5-Medium's real shape (after
    --num-layers), counted on the meta device: the bench's memory estimate before it allocates."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from tools.bench import meta_param_count

    return (meta_param_count(lambda: SD3Transformer2DModel(**REAL_SD3_TRANSFORMER_CONFIG)),
            meta_param_count(lambda: AutoencoderKL(**REAL_SD3_VAE_CONFIG))
            + sum(meta_param_count(lambda c=c: CLIPTextModelWithProjection(CLIPTextConfig(**c)))
                  for c in (REAL_CLIP_L, REAL_CLIP_G))
            + meta_param_count(lambda: T5EncoderModel(T5Config(**REAL_T5))))


def transformer_config(shape: str) -> dict:
    from tools.tiny_sd3 import TINY_SD3_TRANSFORMER_CONFIG

    return dict(REAL_SD3_TRANSFORMER_CONFIG if shape == "real" else TINY_SD3_TRANSFORMER_CONFIG)


# ----------------------------------------------------------------------------------------------
# the FLOP model (pure)


def sd3_param_counts(cfg: dict) -> dict[str, int]:
    """Matmul weights of an SD3 MMDiT(-X) config, split by what each one multiplies.

    d = heads * head_dim, f = 4d (FeedForward), L = num_layers, X = len(dual_attention_layers),
    p = patch_size, c = caption_projection_dim (the context width; SD3.5 sets c = d).
    image   per image token: per block to_q/k/v + to_out.0 (4 d^2) and ff (2 d f); per dual
            block attn2's to_q/k/v + to_out.0 (4 d^2); patch embedding (p^2 C_in d), proj_out
            (d p^2 C_out);
    text    per text token: per block add_q/k/v_proj (3 c d); the last block is context_pre_only
            and has neither to_add_out nor ff_context, the others add to_add_out (d c) and
            ff_context (2 c 4c); the context embedder (joint_attention_dim * c);
    sample  once per sample: the AdaLN linears (norm1 6d^2, or 9d^2 in a dual block;
            norm1_context 6 c d, 2 c d in the last block), norm_out (2 d^2) and the timestep /
            pooled-text embedders (256 d + d^2 + pooled_dim d + d^2).
    """
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    c = int(cfg.get("caption_projection_dim") or d)
    f = 4 * d
    n = int(cfg["num_layers"])
    x = len(tuple(cfg.get("dual_attention_layers") or ()))
    p2 = int(cfg["patch_size"]) ** 2
    image = n * (4 * d * d + 2 * d * f) + x * 4 * d * d + p2 * int(cfg["in_channels"]) * d \
        + d * p2 * int(cfg.get("out_channels") or cfg["in_channels"])
    text = n * 3 * c * d + (n - 1) * (d * c + 2 * c * 4 * c) + int(cfg["joint_attention_dim"]) * c
    sample = (n - x) * 6 * d * d + x * 9 * d * d + (n - 1) * 6 * c * d + 2 * c * d + 2 * d * d \
        + 256 * d + d * d + int(cfg["pooled_projection_dim"]) * d + d * d
    return {"image": image, "text": text, "sample": sample, "total_matmul": image + text + sample}


def sd3_forward_flops(cfg: dict, image_tokens: int, text_tokens: int, batch: int = 1) -> float:
    """FLOPs of one SD3 DiT forward over `batch` samples (matmuls only, multiply-add = 2 FLOPs).

        F = batch * [ 2 * (P_image * N_img + P_text * N_txt + P_sample)
                      + 4 * (N_img + N_txt)^2 * d * L + 4 * N_img^2 * d * X ]

    joint attention over image + text tokens in every block (Q K^T and P V, 2 * L_tot^2 * d
    each), the dual blocks' second attention over the image tokens alone. SD3.5-Medium at
    512x512 (1024 image tokens) with 77 + 128 text tokens, batch 1: 2.22e12.
    """
    p = sd3_param_counts(cfg)
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    n_img, n_txt = int(image_tokens), int(text_tokens)
    x = len(tuple(cfg.get("dual_attention_layers") or ()))
    linear = 2.0 * (p["image"] * n_img + p["text"] * n_txt + p["sample"])
    attention = 4.0 * (n_img + n_txt) ** 2 * d * int(cfg["num_layers"]) + 4.0 * n_img * n_img * d * x
    return float(batch) * (linear + attention)


# ----------------------------------------------------------------------------------------------
# random modules


def _recompute_pos_embed(model: torch.nn.Module) -> None:
    """SD3's PatchEmbed keeps its 2-D sin-cos position table as a persistent buffer, which
    to_empty leaves uninitialised: recompute it as PatchEmbed's constructor does."""
    from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed

    for m in model.modules():
        if isinstance(m, PatchEmbed) and getattr(m, "pos_embed", None) is not None:
            grid = m.pos_embed_max_size or m.height
            table = get_2d_sincos_pos_embed(m.proj.out_channels, grid, base_size=m.base_size,
                                            interpolation_scale=m.interpolation_scale, output_type="pt")
            m.pos_embed.copy_(table.float().unsqueeze(0).to(m.pos_embed.device))


def build_sd3_transformer(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """SD3Transformer2DModel of `shape` with random weights on `device`."""
    from diffusers import SD3Transformer2DModel

    from tools.bench import materialise

    cfg = transformer_config(shape)
    model = materialise(lambda: SD3Transformer2DModel(**cfg), device, dtype, seed, f"{shape} SD3 transformer")
    with torch.no_grad():
        _recompute_pos_embed(model)
    return model


def build_sd3_engine(shape: str, device: torch.device, dtype: torch.dtype, max_batch_size: int, seed: int = 0):
    """NativeEngine over a random SD3.5 pipeline of `shape` (the DiT seeded with `seed`), with the
    SD3 adapter."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from tools.bench import materialise
    from tools.tiny_sd3 import (TINY_SD3_VAE_CONFIG, build_clip_text_encoder, build_clip_tokenizer, build_t5_encoder,
                                build_t5_tokenizer)
    from trainer.engine.native import NativeEngine
    from trainer.models.sd3 import SD3Adapter

    tokenizers = {"tokenizer": build_clip_tokenizer(), "tokenizer_2": build_clip_tokenizer(),
                  "tokenizer_3": build_t5_tokenizer()}
    transformer = build_sd3_transformer(shape, device, dtype, seed)
    if shape == "real":
        vae = materialise(lambda: AutoencoderKL(**REAL_SD3_VAE_CONFIG), device, dtype, seed + 1, "SD3 VAE")
        clip_l = materialise(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**REAL_CLIP_L)), device, dtype,
                             seed + 2, "CLIP-L")
        clip_g = materialise(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**REAL_CLIP_G)), device, dtype,
                             seed + 3, "CLIP-G")
        t5 = materialise(lambda: T5EncoderModel(T5Config(**REAL_T5)), device, dtype, seed + 4, "T5-XXL")
    else:
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(**TINY_SD3_VAE_CONFIG)
        torch.manual_seed(seed + 2)
        clip_l = build_clip_text_encoder(tokenizers["tokenizer"])
        torch.manual_seed(seed + 3)
        clip_g = build_clip_text_encoder(tokenizers["tokenizer_2"])
        torch.manual_seed(seed + 4)
        t5 = build_t5_encoder(tokenizers["tokenizer_3"])
    encoders = torch.nn.ModuleDict({"text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": t5})
    return NativeEngine.from_modules(transformer, vae, encoders, tokenizers, SD3_SCHEDULER, device=device,
                                     dtype=dtype, max_batch_size=max_batch_size, adapter=SD3Adapter())


def sd3_prompts(n: int) -> list[str]:
    """n distinct prompts; SD3's tokenizers pad every prompt to 77 CLIP + max_sequence_length T5
    tokens, so the DiT's text length does not depend on them."""
    colours = ("red", "green", "blue", "yellow", "cyan", "magenta", "orange", "purple")
    return [f"a {colours[i % len(colours)]} ball number {i} on a wide green field" for i in range(n)]


# ----------------------------------------------------------------------------------------------
# FlowGRPO's own rollout on the same modules


def import_flowgrpo_rollout(checkout: Path):
    """flow_grpo.diffusers_patch.sd3_pipeline_with_logprob.pipeline_with_logprob from a local
    checkout of yifan123/flow_grpo (its root on sys.path for this import). Raises ValueError
    naming --flowgrpo-path when the checkout lacks the file or it does not import."""
    root = Path(checkout)
    target = root / "flow_grpo" / "diffusers_patch" / "sd3_pipeline_with_logprob.py"
    if not target.is_file():
        raise ValueError(f"--flowgrpo-path {root}: no {target.relative_to(root)} there; pass the root of a checkout "
                         "of github.com/yifan123/flow_grpo")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("flow_grpo.diffusers_patch.sd3_pipeline_with_logprob")
    except Exception as e:  # whatever its package imports
        raise ValueError(f"--flowgrpo-path {root}: importing its sd3_pipeline_with_logprob failed ({e!r})") from None
    return module.pipeline_with_logprob


def flowgrpo_pipeline(engine):
    """A diffusers StableDiffusion3Pipeline over the engine's own modules (nothing copied)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    enc = engine.text_encoder
    pipe = StableDiffusion3Pipeline(
        transformer=engine.transformer, vae=engine.vae,
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(engine.scheduler_config),
        text_encoder=enc["text_encoder"], text_encoder_2=enc["text_encoder_2"], text_encoder_3=enc["text_encoder_3"],
        **engine.tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def time_flowgrpo_rollout(fn, pipe, prompts: list[str], group_size: int, *, height: int, width: int, steps: int,
                          guidance_scale: float, eta: float, max_sequence_length: int, batch: int, seed: int,
                          device: torch.device) -> tuple[float, int]:
    """(seconds, images) of FlowGRPO's rollout of prompts x group_size images, `batch` images per
    call as its train_sd3.py samples (sample.train_batch_size), negative prompt "" as it uses."""
    from tools.bench import timed

    flat = [p for p in prompts for _ in range(group_size)]
    with timed(device) as t:
        for start in range(0, len(flat), batch):
            chunk = flat[start:start + batch]
            images, latents, log_probs = fn(pipe, prompt=chunk, negative_prompt=[""] * len(chunk), height=height,
                                            width=width, num_inference_steps=steps, guidance_scale=guidance_scale,
                                            output_type="pt", max_sequence_length=max_sequence_length,
                                            noise_level=eta, generator=torch.Generator().manual_seed(seed + start))
            assert torch.isfinite(torch.stack(log_probs)).all()
    return t[0], len(flat)


def phase_flowgrpo(c: Any, checkout: Path) -> None:
    """flowgrpo_rollout_s / flowgrpo_images_per_s and flowgrpo_vs_native (the native engine's
    rollout_s over FlowGRPO's for the same images; > 1 means FlowGRPO's is faster). FlowGRPO's
    function runs its SDE at every step and the native engine only at the trained ones; both
    run the same DiT forwards (2 rows per image under CFG), the text encoders and the VAE."""
    from tools.bench import rollout

    a = c.args
    fn = import_flowgrpo_rollout(checkout)
    pipe = flowgrpo_pipeline(c.engine)
    kw = dict(height=a.height, width=a.width, steps=a.steps, guidance_scale=a.guidance_scale, eta=a.eta,
              max_sequence_length=c.engine.max_sequence_length, batch=a.max_batch or a.group_size, seed=a.seed,
              device=c.device)
    time_flowgrpo_rollout(fn, pipe, c.prompts[:1], 1, **{**kw, "batch": 1})  # warm-up
    theirs, n = time_flowgrpo_rollout(fn, pipe, c.prompts, a.group_size, **kw)
    theirs = c.rep.reduce(theirs, "max")
    _, ours = rollout(c, rollout_id=50)
    ours = c.rep.reduce(ours, "max")
    c.rep.emit("flowgrpo_rollout_s", theirs, "s", candidates=n, batch=kw["batch"], checkout=str(checkout))
    c.rep.emit("flowgrpo_images_per_s", n / theirs, "images/s", op="min", candidates=n)
    c.rep.emit("flowgrpo_vs_native", ours / theirs, "ratio", native_rollout_s=ours, flowgrpo_rollout_s=theirs,
               note="native rollout time / FlowGRPO rollout time, same modules, images and process")
