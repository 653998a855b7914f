"""Build a tiny, random-weight Stable Diffusion 3.5 pipeline directory, entirely offline.

The directory has the layout of a real SD3.5 checkout (model_index.json, transformer/, vae/,
text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/ (CLIP-G), text_encoder_3/ +
tokenizer_3/ (T5), scheduler/), so StableDiffusion3Pipeline.from_pretrained loads it and every
consumer reads it through the same code as the real model. tools/make_tiny_model.py --family sd3
writes it.

Sizes follow diffusers' own SD3 unit tests: a 2-block MMDiT-X (2 heads x 8, patch 1) whose first
block has the dual attention of SD3.5-Medium (`dual_attention_layers`, RMS q/k norm), two 2-layer
CLIP text encoders with projection of width 16 (their pooled projections concatenate to the DiT's
pooled_projection_dim 32, their hidden states to the T5 width 32 = joint_attention_dim, as 768 +
1280 <= 4096 in the real model), a 2-layer T5 encoder of width 32 and a 4-channel AutoencoderKL
with spatial factor 2 and SD3's scaling / shift factors. Tokenizers are built in code: the CLIP
ones byte-level with no merges (tools/tiny_clip.py), the T5 one a Unigram of single characters.
The scheduler config is SD3.5's (static shift 3).
"""

from __future__ import annotations

from pathlib import Path

#: SD3.5-Medium's (and -Large's) scheduler/scheduler_config.json
SD3_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}

TINY_SD3_TRANSFORMER_CONFIG = dict(
    sample_size=32,
    patch_size=1,
    in_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=32,
    out_channels=4,
    pos_embed_max_size=96,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)

#: SD3's VAE latent normalisation (vae/config.json of SD3.5)
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609

TINY_SD3_VAE_CONFIG = dict(
    sample_size=32,
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=SD3_VAE_SHIFT_FACTOR,
    scaling_factor=SD3_VAE_SCALING_FACTOR,
)

#: CLIP's context length, which SD3's pipeline pads every CLIP prompt to
CLIP_MAX_LENGTH = 77


def build_clip_tokenizer():
    """A byte-level CLIP tokenizer with no merges (every byte a token, end-of-text the largest
    id as in CLIP), 77-token context."""
    from transformers import CLIPTokenizer

    from tools.tiny_clip import bytes_to_unicode

    symbols = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def build_t5_tokenizer():
    """A Unigram T5 tokenizer over single printable ASCII characters (with and without the word
    marker): <pad> 0, </s> 1, <unk> 2 as in T5, no sentinel tokens."""
    from transformers import T5Tokenizer

    chars = [chr(c) for c in range(33, 127)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    vocab += [("\u2581" + c, -1.5) for c in chars] + [(c, -2.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def build_clip_text_encoder(tokenizer, hidden_size: int = 16, projection_dim: int = 16):
    """A 2-layer CLIPTextModelWithProjection (SD3 reads the penultimate hidden state and the
    projected pooled output) with the tokenizer's own special-token ids."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH,
                            projection_dim=projection_dim, hidden_act="gelu",
                            bos_token_id=tokenizer.convert_tokens_to_ids("<|startoftext|>"), eos_token_id=eos,
                            pad_token_id=eos)
    return CLIPTextModelWithProjection(config).eval()


def build_t5_encoder(tokenizer, d_model: int = 32):
    """A 2-layer T5EncoderModel of width `d_model`."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      decoder_start_token_id=tokenizer.pad_token_id)
    return T5EncoderModel(config).eval()


def build_tiny_sd3_pipeline(output_dir, seed: int = 0, vae_output_gain: float = 1.0,
                            vae_norm_groups: int = TINY_SD3_VAE_CONFIG["norm_num_groups"]) -> Path:
    """Write a complete tiny SD3.5 pipeline to `output_dir` (created; an existing directory's
    files are overwritten) and return its path. Deterministic in `seed`. vae_output_gain scales
    the decoder's last convolution (bias zeroed), as for the tiny Qwen-Image model: at random init
    the decoder maps every latent to nearly one grey, and a gain spreads the colours.

    vae_norm_groups is the VAE's norm_num_groups (a vae/config.json key, so every loader reads
    it). With the default 4 groups of 2 channels, the GroupNorm just before the decoder's output
    convolution re-centres each pair of channels over the picture, so the picture's mean colour
    hardly follows the latents even under a gain: at gain 8, shifting one latent channel of an
    8x8 picture by 0.5 raises its red, green or blue colour reward by 0.005 .. 0.025 at best.
    One group (a LayerNorm over the whole feature map) leaves the balance between channels, hence
    the colour, to the latents: 0.02 .. 0.07, and a colour reward is learned in a few rollouts.
    The weights are the same either way (a GroupNorm starts at weight 1, bias 0, drawing nothing)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from tools.make_tiny_model import save_tiny_pipeline, scale_vae_output

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER_CONFIG)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**{**TINY_SD3_VAE_CONFIG, "norm_num_groups": int(vae_norm_groups)})
    scale_vae_output(vae, vae_output_gain)
    clip_tok, clip_tok_2, t5_tok = build_clip_tokenizer(), build_clip_tokenizer(), build_t5_tokenizer()
    torch.manual_seed(seed + 2)
    clip_l = build_clip_text_encoder(clip_tok)
    torch.manual_seed(seed + 3)
    clip_g = build_clip_text_encoder(clip_tok_2)
    torch.manual_seed(seed + 4)
    t5 = build_t5_encoder(t5_tok)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG), vae=vae,
        text_encoder=clip_l, tokenizer=clip_tok, text_encoder_2=clip_g, tokenizer_2=clip_tok_2,
        text_encoder_3=t5, tokenizer_3=t5_tok)
    return save_tiny_pipeline(pipe, output_dir, {"family": "sd3", "seed": seed, "random_weights": True,
                                                 "vae_output_gain": vae_output_gain,
                                                 "vae_norm_groups": int(vae_norm_groups)})
