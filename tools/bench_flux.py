"""tools/bench.py --family flux: FLUX.1-dev's shapes, FLOP model and file-free build.

    torchrun --nproc-per-node 1 tools/bench.py --family flux --shape real --height 512 --width 512 \\
        --steps 6 --sde-pool 1 2 3 4 --trained-steps 4 --eta 0.9 --prompts 6 --group-size 24 \\
        --micro-batch 3 --text-tokens 512 --output bench/results/h200x1-flux.jsonl

tools/bench.py:family_parts("flux") hands these pieces to the bench's main, which runs the same
phases as for Qwen-Image and SD3 (DiT forward, rollout, reward, LoRA replay and update, merged /
adapter sync, offload, the whole step; --full adds the full fine-tune ones; --rollout-compile,
--rollout-precision fp8 and --fsdp-compile as for the other families: the eager rollout first,
then the engine's speed options, rollout_speedup and the rollout-to-replay gap), over a FLUX.1-dev
pipeline of random weights built from its configs on the meta device and materialised on the
rank's device: the 11.9 B FluxTransformer2DModel (19 double-stream, 38 single-stream blocks, 24
heads x 128, T5 width 4096, CLIP pooled 768, the guidance embedding), its 84 M AutoencoderKL,
CLIP-L's text model (123 M) and the T5-XXL encoder (4.76 B). The engine, actor and sync are the
project's, through trainer.models.flux.FluxAdapter. --text-tokens is the T5 window
(max_sequence_length): FluxPipeline pads every prompt to it, so it is the text length the DiT
sees (FLUX.1-dev's default 512; FlowGRPO trains at 128). --compare stays Qwen-Image's.
"""

from __future__ import annotations

import torch

#: FluxTransformer2DModel of FLUX.1-dev (black-forest-labs/FLUX.1-dev transformer/config.json)
REAL_FLUX_TRANSFORMER_CONFIG = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19,
                                    num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                                    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                                    axes_dims_rope=(16, 56, 56))
#: FLUX.1-dev's AutoencoderKL (vae/config.json): 16 latent channels, 8x spatial
REAL_FLUX_VAE_CONFIG = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                            up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=(128, 256, 512, 512),
                            layers_per_block=2, act_fn="silu", latent_channels=16, norm_num_groups=32,
                            sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                            use_post_quant_conv=False)
#: openai/clip-vit-large-patch14's text model (text_encoder/config.json)
REAL_CLIP_CONFIG = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                        hidden_act="quick_gelu")
#: google/t5-v1_1-xxl's encoder (text_encoder_2/config.json)
REAL_T5_CONFIG = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0)


def flux_shape_configs(shape: str) -> tuple[dict, dict, dict, dict]:
    """(transformer, vae, clip, t5) configs of `shape` ("real" | "tiny": tools/tiny_flux.py's)."""
    from tools.tiny_flux import TINY_FLUX_TRANSFORMER_CONFIG, TINY_FLUX_VAE_CONFIG

    if shape == "real":
        return (dict(REAL_FLUX_TRANSFORMER_CONFIG), dict(REAL_FLUX_VAE_CONFIG), dict(REAL_CLIP_CONFIG),
                dict(REAL_T5_CONFIG))
    if shape == "tiny":
        return (dict(TINY_FLUX_TRANSFORMER_CONFIG), dict(TINY_FLUX_VAE_CONFIG),
                dict(vocab_size=None, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=77, projection_dim=32, hidden_act="gelu"),
                dict(vocab_size=None, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0))
    raise ValueError(f"--shape must be one of ('real', 'tiny'), got {shape!r}")


def real_param_counts() -> tuple[int, int]:
    """(DiT, VAE + CLIP + T5) parameters of FLUX.1-dev's real shape (after --num-layers), counted on
    the meta device: the bench's memory estimate before it allocates."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from tools.bench import meta_param_count

    dit, vae, clip, t5 = flux_shape_configs("real")
    return (meta_param_count(lambda: FluxTransformer2DModel(**dit)),
            meta_param_count(lambda: AutoencoderKL(**vae)) + meta_param_count(lambda: CLIPTextModel(CLIPTextConfig(**clip)))
            + meta_param_count(lambda: T5EncoderModel(T5Config(**t5))))


# ----------------------------------------------------------------------------------------------
# the FLOP model (pure; written down here: flux_param_counts and flux_forward_flops)

def flux_param_counts(cfg: dict) -> dict[str, int]:
    """Parameters of a FluxTransformer2DModel config, split by what each one multiplies.

    d = heads * head_dim, f = 4d (FeedForward and the single blocks' MLP), Ld / Ls = double /
    single blocks, P = pooled_projection_dim, c = in_channels, o = patch^2 * out_channels.
    image   weights every image token meets in a double block: to_q/k/v, to_out.0 (4 d^2) and ff
            (2 d f); plus x_embedder (c d) and proj_out (d o);
    text    the double blocks' text stream: add_q/k/v_proj, to_add_out (4 d^2), ff_context
            (2 d f); plus context_embedder (joint_attention_dim * d);
    joint   weights every token (image and text) meets in a single block: to_q/k/v (3 d^2),
            proj_mlp (d f), proj_out ((d + f) d);
    sample  weights applied once per sample: the AdaLN linears (norm1 / norm1_context 2 * 6 d^2
            per double block, norm 3 d^2 per single block, norm_out 2 d^2), the timestep and
            guidance MLPs (256 d + d^2 each) and the pooled text MLP (P d + d^2);
    bias, norm  bias vectors and the q / k RMSNorm weights (elementwise work; not in the FLOP count);
    total   everything (11.90 B for FLUX.1-dev).
    """
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    hd = int(cfg["attention_head_dim"])
    f = 4 * d
    ld, ls = int(cfg["num_layers"]), int(cfg["num_single_layers"])
    c = int(cfg["in_channels"])
    o = int(cfg["patch_size"]) ** 2 * int(cfg.get("out_channels") or c)
    pooled, joint_dim = int(cfg["pooled_projection_dim"]), int(cfg["joint_attention_dim"])
    guidance = bool(cfg.get("guidance_embeds", False))
    stream = 4 * d * d + 2 * d * f
    image = ld * stream + c * d + d * o
    text = ld * stream + joint_dim * d
    joint = ls * (3 * d * d + d * f + (d + f) * d)
    embed_mlps = (2 if guidance else 1) * (256 * d + d * d) + pooled * d + d * d
    sample = ld * 2 * 6 * d * d + ls * 3 * d * d + 2 * d * d + embed_mlps
    bias = (ld * 2 * (4 * d + f + d)                   # both streams: q/k/v/out, ff in (f), ff out (d)
            + ls * (3 * d + f + d)                     # single: q/k/v, proj_mlp, proj_out
            + d + o + d                                # x_embedder, proj_out, context_embedder
            + ld * 2 * 6 * d + ls * 3 * d + 2 * d      # AdaLN linears
            + (2 if guidance else 1) * 2 * d + 2 * d)  # timestep / guidance MLPs, pooled text MLP
    norm = ld * 4 * hd + ls * 2 * hd
    return {"image": image, "text": text, "joint": joint, "sample": sample, "bias": bias, "norm": norm,
            "total": image + text + joint + sample + bias + norm}


def flux_forward_flops(cfg: dict, image_tokens: int, text_tokens: int, batch: int = 1) -> float:
    """FLOPs of one FLUX DiT forward over `batch` samples (matmuls only, multiply-add = 2 FLOPs).

        F = batch * [ 2 * (P_image * N_img + P_text * N_txt + P_joint * (N_img + N_txt) + P_sample)
                      + 4 * (N_img + N_txt)^2 * d * (Ld + Ls) ]

    The double blocks send an image token only through image-stream weights and a text token only
    through text-stream weights; the single blocks run one set of weights over the joined
    sequence; the AdaLN linears and the embedding MLPs run once per sample; every block's joint
    attention costs 2 * N^2 * d for Q K^T and as much for P V. FLUX.1-dev, 512x512 (1024 image
    tokens) with 512 text tokens, batch 1: 2.150e13; with 128 text tokens: 1.581e13.
    """
    p = flux_param_counts(cfg)
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    n = int(image_tokens) + int(text_tokens)
    linear = 2.0 * (p["image"] * image_tokens + p["text"] * text_tokens + p["joint"] * n + p["sample"])
    attention = 4.0 * n * n * d * (int(cfg["num_layers"]) + int(cfg["num_single_layers"]))
    return float(batch) * (linear + attention)


# ----------------------------------------------------------------------------------------------
# building random modules without files


def build_flux_transformer(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The FLUX DiT of `shape` with random weights on `device` (tools/bench.py:materialise; the
    rope has no tables to recompute: FluxPosEmbed computes them per call)."""
    from diffusers import FluxTransformer2DModel

    from tools.bench import materialise

    cfg = flux_shape_configs(shape)[0]
    return materialise(lambda: FluxTransformer2DModel(**cfg), device, dtype, seed, f"{shape} FLUX transformer")


def build_flux_engine(shape: str, device: torch.device, dtype: torch.dtype, max_batch_size: int,
                      max_sequence_length: int, seed: int = 0, adapter=None):
    """NativeEngine over a random FLUX `shape` pipeline on `device`, through `adapter` (FluxAdapter
    by default; FLUX.1-Kontext's has FLUX.1-dev's modules too); the tokenizers are
    tools/tiny_flux.py's (their ids fit every vocabulary; the text length is max_sequence_length
    whatever the prompt)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from tools.bench import materialise
    from tools.tiny_flux import FLUX_DEV_SCHEDULER_CONFIG, build_clip_tokenizer, build_t5_tokenizer
    from trainer.engine.native import NativeEngine
    from trainer.models.flux import FluxAdapter

    _, vae_cfg, clip_cfg, t5_cfg = flux_shape_configs(shape)
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    clip_cfg["vocab_size"] = clip_cfg["vocab_size"] or len(clip_tok)
    t5_cfg["vocab_size"] = t5_cfg["vocab_size"] or len(t5_tok)
    clip_ids = {k: clip_tok.convert_tokens_to_ids(v) for k, v in (("bos_token_id", clip_tok.bos_token),
                                                                  ("eos_token_id", clip_tok.eos_token),
                                                                  ("pad_token_id", clip_tok.pad_token))}
    transformer = build_flux_transformer(shape, device, dtype, seed)
    vae = materialise(lambda: AutoencoderKL(**vae_cfg), device, dtype, seed + 1, f"{shape} FLUX VAE")
    clip = materialise(lambda: CLIPTextModel(CLIPTextConfig(**clip_cfg, **clip_ids)), device, dtype, seed + 2,
                       f"{shape} CLIP text model")
    # CLIP keeps its position ids as a non-persistent buffer, which to_empty leaves uninitialised
    ids = next(b for n, b in clip.named_buffers() if n.endswith("embeddings.position_ids"))
    ids.copy_(torch.arange(ids.shape[-1], device=ids.device).expand_as(ids))
    t5 = materialise(lambda: T5EncoderModel(T5Config(**t5_cfg, is_encoder_decoder=False, use_cache=False,
                                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
                     device, dtype, seed + 3, f"{shape} T5 encoder")
    return NativeEngine.from_modules(transformer, vae, torch.nn.ModuleDict({"clip": clip, "t5": t5}),
                                     {"clip": clip_tok, "t5": t5_tok}, FLUX_DEV_SCHEDULER_CONFIG, device=device,
                                     dtype=dtype, max_batch_size=max_batch_size,
                                     max_sequence_length=max_sequence_length,
                                     adapter=FluxAdapter() if adapter is None else adapter)


def flux_prompts(n: int) -> list[str]:
    """n distinct prompts naming a palette colour (ColorScorer scores each); FLUX's T5 pads each
    to max_sequence_length, so their length does not matter."""
    from tools.bench import _COLOURS

    return [f"a {_COLOURS[i % len(_COLOURS)]} ball number {i}" for i in range(n)]
