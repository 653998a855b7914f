"""The FLUX.1 adapter: everything FLUX.1-dev specific the trainer needs.

FLUX.1-dev is a guidance-distilled flow-matching DiT (FluxTransformer2DModel: 19 double-stream
and 38 single-stream blocks, 24 heads x 128). Compared with Qwen-Image:

- text: two encoders. CLIP-L's pooled output [B, 768] feeds the timestep embedding
  (`pooled_projections`); T5's hidden states [B, T, 4096], padded to max_sequence_length by the
  tokenizer, are the token sequence. FluxPipeline passes no attention mask, so the padding
  tokens are real inputs of the DiT and are kept.
- guidance: no classifier-free guidance by default; the distilled model takes the guidance
  scale as an input (`guidance`, FluxPipeline's guidance_scale, 3.5 for FLUX.1-dev) and the
  transformer embeds guidance * 1000 next to the timestep * 1000.
- positions: 3-channel RoPE ids, (0, row, col) per packed image token (`latent_image_ids`) and
  zeros per text token (`text_ids`), passed 2-D (no batch dim) as diffusers 0.42 wants them.
- latents: the VAE's 16 channels 2 x 2-packed into 64 per token (`pack_latents`); decode
  un-normalises with latents / scaling_factor + shift_factor (0.3611 / 0.1159 for the real VAE).
- schedule: sigmas = linspace(1, 1/N, N) shifted by mu = calculate_shift(image tokens) with the
  scheduler's (256, 4096, 0.5, 1.15): trainer.sampling.sigma_schedule with FLUX's
  scheduler_config.json is FluxPipeline's schedule exactly (tests/test_family_flux.py).

Rollout and replay share one DiT call (`flux_velocity`), so the velocity the actor recomputes
comes from exactly the inputs the engine sampled with.
"""

from __future__ import annotations

from typing import Any

import torch

#: the attention projections of every block, as diffusers names them: a double-stream block has
#: the image stream's to_q / to_k / to_v / to_out.0 and the text stream's add_*_proj / to_add_out;
#: a single-stream block's attention has to_q / to_k / to_v (suffix "attn.to_q" matches both kinds)
FLUX_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

#: FluxPipeline's default guidance_scale: the embedded guidance FLUX.1-dev was distilled around
FLUX_DEV_GUIDANCE = 3.5


# ----------------------------------------------------------------------------- geometry


def packed_grid(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    """(rows, cols) of 2 x 2-packed latent patches for height x width pixels:
    (H // (2 * vsf), W // (2 * vsf)), FluxPipeline's prepare_latents grid halved."""
    f = 2 * int(vae_scale_factor)
    return int(height) // f, int(width) // f


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] latents -> [B, (h/2) * (w/2), 4C], as FluxPipeline._pack_latents: token
    (i, j) holds channels c-major of the 2 x 2 patch at rows 2i..2i+1, cols 2j..2j+1."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of pack_latents: [B, rows * cols, 4C] -> [B, C, 2 * rows, 2 * cols]
    (FluxPipeline._unpack_latents). Raises ValueError when the token count is not rows x cols."""
    b, n, c4 = latents.shape
    if n != rows * cols:
        raise ValueError(f"packed latents hold {n} tokens, expected {rows} x {cols} = {rows * cols}")
    x = latents.view(b, rows, cols, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, rows * 2, cols * 2)


def latent_image_ids(rows: int, cols: int, device: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RoPE ids of the packed image tokens, [rows * cols, 3]: (0, i, j) for token i * cols + j
    (FluxPipeline._prepare_latent_image_ids, row-major like pack_latents). 2-D: diffusers 0.42
    takes ids without a batch dim (every row of a batch shares them)."""
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)


def text_ids(num_tokens: int, device: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RoPE ids of the text tokens, [T, 3] zeros (FluxPipeline.encode_prompt): the text stream
    carries no position in RoPE; T5's own relative attention already saw the order."""
    return torch.zeros(int(num_tokens), 3, device=device, dtype=dtype)


def vae_scale_factor_from_config(vae_config: Any) -> int:
    """Spatial compression of an AutoencoderKL: 2 ** (len(block_out_channels) - 1), the rule
    FluxPipeline uses (8 for FLUX.1-dev's VAE, 4 for the tiny one)."""
    blocks = vae_config["block_out_channels"] if isinstance(vae_config, dict) else vae_config.block_out_channels
    return 2 ** (len(blocks) - 1)


def decode_latents(vae, packed: torch.Tensor, height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
    """Packed final latents [B, L, 4C] -> images [B, 3, H, W] float32 in [0, 1] on CPU, as
    FluxPipeline decodes: unpack, z / scaling_factor + shift_factor, vae.decode, x / 2 + 0.5."""
    rows, cols = packed_grid(height, width, vae_scale_factor)
    z = unpack_latents(packed, rows, cols).to(vae.dtype)
    z = z / vae.config.scaling_factor + vae.config.shift_factor
    image = vae.decode(z, return_dict=False)[0]
    return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


# ----------------------------------------------------------------------------- the DiT call


def guidance_tensor(guidance_scale: float, batch_size: int) -> torch.Tensor:
    """The `guidance` input of a guidance-distilled FLUX, [B] fp32 filled with guidance_scale
    (FluxPipeline: torch.full([1], guidance_scale, dtype=float32).expand(B)); the transformer
    casts it to its dtype and multiplies by 1000 itself."""
    return torch.full((int(batch_size),), float(guidance_scale), dtype=torch.float32)


def flux_velocity(
    transformer,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    pooled_prompt_embeds: torch.Tensor,
    guidance: torch.Tensor | None,
    rows: int,
    cols: int,
    *,
    rollout_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Velocity [B, L, 4C] of the FLUX DiT, called exactly as FluxPipeline calls it.

    latents [B, L, 4C] in the dtype the module computes in; timesteps [B] fp32 scheduler
    timesteps (sigma * 1000), rounded through `rollout_dtype` (default: the latents' dtype) and
    divided by 1000 (sampling.transformer_timestep; the transformer multiplies by 1000 again), so
    a replay in another dtype sees the timestep the sampler saw; prompt_embeds [B, T, D] T5 states
    and pooled_prompt_embeds [B, P] CLIP pooled output (both cast to the latents' dtype);
    guidance [B] fp32 (None for a model without guidance_embeds); text ids zeros [T, 3] and
    image ids latent_image_ids(rows, cols), 2-D. No attention mask, as in FluxPipeline. A plain
    forward call: works for the bare module, a peft-injected one and an FSDP2-sharded one.
    """
    from trainer.sampling import transformer_timestep

    dev, dt = latents.device, latents.dtype
    t = transformer_timestep(timesteps, dtype=rollout_dtype or dt).to(dev, dt)
    out = transformer(
        hidden_states=latents,
        timestep=t,
        guidance=None if guidance is None else guidance.to(dev),
        pooled_projections=pooled_prompt_embeds.to(device=dev, dtype=dt),
        encoder_hidden_states=prompt_embeds.to(device=dev, dtype=dt),
        txt_ids=text_ids(int(prompt_embeds.shape[1]), dev, dt),
        img_ids=latent_image_ids(rows, cols, dev, dt),
        return_dict=False,
    )
    return out[0] if isinstance(out, (tuple, list)) else out.sample
