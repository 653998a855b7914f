"""Build a tiny, random-weight Wan2.1 text-to-video pipeline directory, entirely offline.

The directory has the layout of a real Wan2.1-T2V Diffusers checkout (model_index.json naming
WanPipeline, transformer/ (WanTransformer3DModel), vae/ (AutoencoderKLWan), text_encoder/
(UMT5EncoderModel), tokenizer/, scheduler/), so `WanPipeline.from_pretrained(dir)` loads it and
every consumer reads it through the same code as the real model.

    python tools/tiny_wan.py --output-dir tiny-wan [--seed 0]

Sizes follow diffusers' own Wan unit tests (tests/pipelines/wan/test_wan.py): a 2-block DiT of
2 heads x 12 with patch (1, 2, 2) and the real 16 latent channels; an AutoencoderKLWan of base
width 3 whose three down levels give the REAL factors (spatial 8, temporal 4: two of the three
levels halve time), so the tiny model has the real latent geometry ((F - 1) // 4 + 1 latent
frames, H / 8 x W / 8) and the real per-channel latents_mean / latents_std un-normalisation;
a 2-layer UMT5 encoder of width 32 (= the DiT's text_dim, as 4096 is in the real model). The
tokenizer is transformers' T5Tokenizer (a Unigram over single printable ASCII characters, the
one the tiny SD3 / FLUX models use), built in code. The scheduler is the flow-matching Euler
scheduler with Wan2.1's static flow shift 3.0.

The real Wan2.1-T2V-1.3B / -14B configurations are kept below as constants (WAN21_*), with
where each comes from, so a benchmark can build the real shapes with random weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's tools, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ------------------------------------------------------------------ the real configurations
#
# Transformer: diffusers' scripts/convert_wan_to_diffusers.py, get_transformer_config("Wan-T2V-1.3B")
# and ("Wan-T2V-14B") (the configs the Wan-AI/Wan2.1-T2V-*-Diffusers checkpoints were written with;
# they match Wan2.1's own wan/configs: dim 1536 = 12 x 128 / 5120 = 40 x 128).

#: Wan2.1-T2V-1.3B transformer/config.json (1.42 B parameters at these dims)
WAN21_T2V_1_3B_TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    added_kv_proj_dim=None,
)

#: Wan2.1-T2V-14B transformer/config.json
WAN21_T2V_14B_TRANSFORMER_CONFIG = dict(
    WAN21_T2V_1_3B_TRANSFORMER_CONFIG,
    num_attention_heads=40,
    ffn_dim=13824,
    num_layers=40,
)

#: Wan2.1's VAE (the same file for both sizes): AutoencoderKLWan's defaults in diffusers, which
#: the conversion script instantiates (`AutoencoderKLWan()`) before loading Wan2.1_VAE.pth.
#: Three down levels (spatial 8), time halved at the last two (temporal 4), 16 latent channels.
WAN21_VAE_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                          0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_VAE_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
WAN21_VAE_CONFIG = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    latents_mean=list(WAN21_VAE_LATENTS_MEAN),
    latents_std=list(WAN21_VAE_LATENTS_STD),
)

#: google/umt5-xxl's encoder (config.json of that checkpoint; the conversion script loads the text
#: encoder and tokenizer from it). Its width 4096 is the DiT's text_dim.
WAN21_UMT5_XXL_CONFIG = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
)

#: the flow shift of Wan2.1 text-to-video: the conversion script writes
#: FlowMatchEulerDiscreteScheduler(shift=3.0); the published Diffusers checkpoints ship
#: UniPCMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction"),
#: the same shifted sigmas; diffusers' Wan docs name 3.0 as Wan's default shift.
WAN21_FLOW_SHIFT = 3.0
WAN21_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": WAN21_FLOW_SHIFT}

#: WanPipeline's defaults (diffusers 0.42 pipeline_wan.py): 480 x 832, 81 frames, 50 steps, CFG 5.0,
#: UMT5 window 512, "" as the negative prompt
WAN21_DEFAULT_GEOMETRY = {"height": 480, "width": 832, "num_frames": 81}
WAN21_MAX_SEQUENCE_LENGTH = 512

# ------------------------------------------------------------------ the tiny configuration

#: diffusers' Wan test transformer (tests/pipelines/wan/test_wan.py), real 16 latent channels
TINY_WAN_TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)

#: diffusers' Wan test VAE: base width 3, three levels (spatial 8), time halved twice (temporal 4),
#: carrying Wan2.1's real latents_mean / latents_std
TINY_WAN_VAE_CONFIG = dict(
    base_dim=3,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=list(WAN21_VAE_LATENTS_MEAN),
    latents_std=list(WAN21_VAE_LATENTS_STD),
)

#: the tiny UMT5 encoder's width: the tiny DiT's text_dim
TINY_UMT5_D_MODEL = TINY_WAN_TRANSFORMER_CONFIG["text_dim"]


def build_umt5_tokenizer():
    """transformers' T5Tokenizer (Unigram) with T5's <pad>=0, </s>=1, <unk>=2, the word marker
    and every printable ASCII character alone and after the word marker; no sentinel tokens.
    model_max_length 512, WanPipeline's default UMT5 window."""
    from tools.tiny_flux import build_t5_tokenizer

    tok = build_t5_tokenizer()
    tok.model_max_length = WAN21_MAX_SEQUENCE_LENGTH
    return tok


def build_umt5_encoder(tokenizer, d_model: int = TINY_UMT5_D_MODEL):
    """A 2-layer UMT5EncoderModel of width `d_model` (4 heads of 8), gated-GELU feed-forward as
    umt5-xxl has; UMT5 keeps a relative-position bias per layer (T5 shares the first's)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return UMT5EncoderModel(config).eval()


#: Wan2.2-T2V-A14B's expert switch: WanPipeline's boundary_ratio in its model_index.json (the
#: high-noise expert runs at timesteps >= 0.875 x 1000)
WAN22_A14B_BOUNDARY_RATIO = 0.875

#: the tiny two-expert model's boundary: with the tiny scheduler at 4 steps (timesteps 1000,
#: 857.7, 602.2, 8.9) the first two steps run the high-noise expert, the last two the low-noise one
TINY_WAN22_BOUNDARY_RATIO = 0.7


def build_tiny_wan_pipeline(output_dir, seed: int = 0, vae_output_gain: float = 1.0,
                            boundary_ratio: float | None = None) -> Path:
    """Write a complete tiny Wan2.1 text-to-video pipeline to `output_dir` (created; existing
    files there are overwritten) and return its path. Deterministic in `seed`.

    vae_output_gain scales the decoder's last convolution (bias zeroed), as for the tiny image
    models: at random init a decoder maps every latent to nearly one grey, and a gain spreads
    the colours so a pixel reward has something to climb.

    boundary_ratio: a Wan2.2 A14B-shaped two-expert pipeline instead: a second DiT of the same
    config (its own weights, drawn after seed + 3) as `transformer_2`, and this boundary_ratio in
    model_index.json."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from tools.make_tiny_model import save_tiny_pipeline, scale_vae_output

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**TINY_WAN_TRANSFORMER_CONFIG)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(**TINY_WAN_VAE_CONFIG)
    scale_vae_output(vae, vae_output_gain)
    tokenizer = build_umt5_tokenizer()
    torch.manual_seed(seed + 2)
    text_encoder = build_umt5_encoder(tokenizer)
    experts = {}
    if boundary_ratio is not None:
        torch.manual_seed(seed + 3)
        experts = {"transformer_2": WanTransformer3DModel(**TINY_WAN_TRANSFORMER_CONFIG),
                   "boundary_ratio": float(boundary_ratio)}
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(**WAN21_SCHEDULER_CONFIG), **experts)
    return save_tiny_pipeline(pipe, output_dir, {"family": "wan", "seed": seed, "random_weights": True,
                                                 "vae_output_gain": vae_output_gain,
                                                 "boundary_ratio": boundary_ratio})


def main(argv=None) -> int:
    from pathlib import Path

    from tools.make_tiny_model import add_output_flags, build_staged
    from trainer.cli import run_tool

    parser = argparse.ArgumentParser(description="Write a tiny random-weight Wan2.1 text-to-video pipeline "
                                                 "directory (WanPipeline layout), offline.")
    add_output_flags(parser)
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same weights)")
    parser.add_argument("--vae-output-gain", type=float, default=1.0,
                        help="scale of the VAE decoder's last convolution; > 1 spreads the decoded colours")
    parser.add_argument("--two-experts", action="store_true",
                        help="a Wan2.2 A14B-shaped pipeline: a second DiT (transformer_2) and boundary_ratio "
                             f"{TINY_WAN22_BOUNDARY_RATIO} in model_index.json")
    args = parser.parse_args(argv)
    ratio = TINY_WAN22_BOUNDARY_RATIO if args.two_experts else None

    def build() -> int:
        path = build_staged(lambda d: build_tiny_wan_pipeline(d, seed=args.seed, vae_output_gain=args.vae_output_gain,
                                                              boundary_ratio=ratio),
                            Path(args.output_dir), overwrite=args.overwrite)
        print(f"wrote tiny {'Wan2.2 (two-expert)' if args.two_experts else 'Wan2.1'} text-to-video pipeline to {path}")
        return 0

    return run_tool("tiny_wan", build)


if __name__ == "__main__":
    raise SystemExit(main())
