"""Build a tiny, random-weight FLUX.1 pipeline directory, entirely offline.

The directory has the layout of a real FLUX.1-dev checkout (model_index.json, transformer/,
vae/, text_encoder/ (CLIP-L), text_encoder_2/ (T5), tokenizer/, tokenizer_2/, scheduler/) and
loads with `FluxPipeline.from_pretrained(dir)`, so every consumer reads it through the same
code as the real model.

Sizes follow diffusers' own FLUX unit tests (tests/pipelines/flux): a DiT of width 32 (2 heads
x 16, RoPE axes [4, 4, 8]), here with 2 double-stream and 2 single-stream blocks and the
guidance embedding FLUX.1-dev has; a CLIP text model of width 32 and a T5 encoder of width 32.
The VAE is an AutoencoderKL with 4 latent channels and spatial factor 4 (three levels) carrying
FLUX.1-dev's scaling_factor 0.3611 and shift_factor 0.1159, so decode exercises the real
un-normalisation. The tokenizers are real transformers classes built in code: CLIP's byte-level
BPE with no merges (one token per byte of a word, the last with "</w>"), T5's Unigram over the
printable ASCII characters. The scheduler config carries FLUX.1-dev's values (dynamic
exponential shift between 256 and 4096 tokens, shifts 0.5 .. 1.15).
"""

from __future__ import annotations

from pathlib import Path

#: FLUX.1-dev's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler)
FLUX_DEV_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

#: diffusers' FLUX test transformer (width 32), with 2 + 2 blocks and FLUX.1-dev's guidance embedding;
#: in_channels = 4 latent channels x the 2 x 2 packing
TINY_FLUX_TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 4, 8),
)

#: 4 latent channels, spatial factor 2 ** (3 - 1) = 4, FLUX.1-dev's latent normalisation
TINY_FLUX_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 3,
    up_block_types=["UpDecoderBlock2D"] * 3,
    block_out_channels=(8, 8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)

#: CLIP-L's special tokens
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def build_clip_tokenizer():
    """transformers' CLIPTokenizer over a byte-level vocabulary with no merges: every byte symbol
    alone and with CLIP's end-of-word suffix "</w>", then the two specials (77-token window,
    CLIP-L's model_max_length)."""
    from transformers import CLIPTokenizer

    from tools.make_tiny_model import byte_level_symbols

    symbols = byte_level_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": len(symbols) + i for i, s in enumerate(symbols)})
    vocab[CLIP_BOS] = len(vocab)
    vocab[CLIP_EOS] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[], unk_token=CLIP_EOS, bos_token=CLIP_BOS, eos_token=CLIP_EOS,
                        pad_token=CLIP_EOS)
    tok.model_max_length = 77
    return tok


def build_t5_tokenizer():
    """transformers' T5Tokenizer (Unigram) with T5's <pad>=0, </s>=1, <unk>=2, the word marker
    and every printable ASCII character alone and after the word marker; no sentinel tokens.
    model_max_length 512, FLUX.1-dev's T5 window."""
    from transformers import T5Tokenizer

    chars = [chr(c) for c in range(33, 127)]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.model_max_length = 512
    return tok


def build_clip_text_model(tokenizer):
    """A 2-layer CLIPTextModel of width 32; its pooled output (the EOS token's state) is the
    transformer's pooled projection input, so hidden_size == pooled_projection_dim."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
        bos_token_id=tokenizer.convert_tokens_to_ids(CLIP_BOS), eos_token_id=tokenizer.convert_tokens_to_ids(CLIP_EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(CLIP_EOS))
    return CLIPTextModel(config).eval()


def build_t5_encoder(tokenizer):
    """A 2-layer T5EncoderModel of width 32 (= joint_attention_dim), 4 heads of 8."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                      is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
    return T5EncoderModel(config).eval()


def build_tiny_flux_parts(seed: int = 0, vae_output_gain: float = 1.0) -> dict:
    """The tiny FLUX.1 components (transformer, vae, the CLIP and T5 tokenizers and encoders,
    scheduler) as pipeline keyword arguments, each model drawn after its own seed (seed ..
    seed + 3); FLUX.1-Kontext's tiny pipeline is built from the same parts."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from tools.make_tiny_model import scale_vae_output

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER_CONFIG)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**TINY_FLUX_VAE_CONFIG)
    scale_vae_output(vae, vae_output_gain)
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    torch.manual_seed(seed + 2)
    text_encoder = build_clip_text_model(tokenizer)
    torch.manual_seed(seed + 3)
    text_encoder_2 = build_t5_encoder(tokenizer_2)
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                tokenizer_2=tokenizer_2, transformer=transformer)


def build_tiny_flux_pipeline(output_dir, seed: int = 0, vae_output_gain: float = 1.0) -> Path:
    """Write a complete tiny FLUX.1 pipeline to `output_dir` (created; an existing
    model_index.json there is overwritten) and return its path. Deterministic in `seed`.
    vae_output_gain: see tools/make_tiny_model.py scale_vae_output."""
    from diffusers import FluxPipeline

    from tools.make_tiny_model import save_tiny_pipeline

    pipe = FluxPipeline(**build_tiny_flux_parts(seed, vae_output_gain))
    return save_tiny_pipeline(pipe, output_dir, {"family": "flux", "seed": seed, "random_weights": True,
                                                 "vae_output_gain": vae_output_gain})
