"""The FLUX.1-Kontext adapter (FluxKontextPipeline): FLUX.1-dev's DiT, conditioned on a source image.

Kontext is FLUX.1-dev's architecture and text conditioning (CLIP pooled + T5 states, the
embedded guidance as the distilled DiT's input, no true CFG); what it adds is the source:

- the VAE encodes the source, resized to the candidate's output size (the pipeline's own
  _encode_vae_image: argmax, then (z - shift) * scale), packed 2 x 2 like the target;
- the DiT sees [target tokens, source tokens] with position ids (0, row, col) for the target and
  (1, row, col) for the source (edit_geometry.kontext_position_ids), and the velocity is its
  output over the target tokens.

The trajectory records the source latents as the condition "image_latents" [B, L, 4C] beside
"prompt_embeds" / "pooled_prompt_embeds" / "guidance", and `Geometry.media` = ("image",), so the
replay feeds the DiT exactly the sequence the sampler ran, without the VAE or the file. One
source per record, as FluxKontextPipeline takes one. The source is sized to the output (not the
pipeline's nearest preferred ~1 megapixel resolution), one sequence length per rollout, as the
edit recipes condition at the training resolution.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.models.base import pack_latents, packed_grid
from trainer.models.edit_geometry import kontext_position_ids
from trainer.models.flux import FLUX_DEV_GUIDANCE, FluxAdapter, flux_velocity, has_guidance_embedding  # noqa: F401
from trainer.models.qwen_image_edit import IMAGE_LATENTS, instruction_text
from trainer.trajectory import EMBEDDED_GUIDANCE, Geometry, SamplerSettings, Trajectory

#: FlowGRPO's Kontext recipe: FLUX.1-Kontext-dev's embedded guidance 2.5
KONTEXT_GUIDANCE = 2.5


def kontext_img_ids(rows: int, cols: int, device: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[2 rows cols, 3] ids of the target grid then the source grid at the same size (first axis 0,
    then 1), as FluxKontextPipeline concatenates latent_ids and image_ids."""
    return torch.cat([kontext_position_ids(rows, cols, 0.0), kontext_position_ids(rows, cols, 1.0)]).to(
        device=device, dtype=dtype)


def check_one_source(images: list) -> None:
    """ValueError unless a record gave exactly one source (FluxKontextPipeline takes one)."""
    if len(images) != 1:
        raise ValueError(f"FLUX.1-Kontext edits one source image, a record gave {len(images)}; keep one image "
                         "per record (tools/prepare_data.py --source edit --image-column with one image)")


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1-Kontext-dev (module docstring); FLUX.1's loading, text encoding, schedule, decode
    and request (guidance_scale is the embedded guidance), its own conditioning."""

    family = "flux_kontext"
    generation_task = "i2i"
    shared_conditions = (IMAGE_LATENTS,)
    #: FlowGRPO's counting_flux_kontext geometry, for tools/sample.py without --sampling-config
    sampling_defaults = {"height": 512, "width": 512, "num_inference_steps": 6, "guidance_scale": KONTEXT_GUIDANCE,
                         "eta": 0.9, "sde_type": "sde", "sde_indices": [1, 2, 3, 4]}

    def prompt_encoder(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict):
        """FLUX.1's encode (the instruction's <image> placeholders dropped), from a
        FluxKontextPipeline over the same modules, which the callable carries as `.pipe`."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

        pipe = FluxKontextPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config), vae=vae,
                                   text_encoder=text_encoder["clip"], tokenizer=tokenizer["clip"],
                                   text_encoder_2=text_encoder["t5"], tokenizer_2=tokenizer["t5"],
                                   transformer=transformer)

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int) -> dict[str, torch.Tensor]:
            embeds, pooled, _ = pipe.encode_prompt(prompt=[instruction_text(p) for p in prompts], prompt_2=None,
                                                   device=device, max_sequence_length=max_sequence_length)
            return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

        encode.tokenizer = tokenizer["t5"]
        encode.pipe = pipe
        return encode

    def encode_condition(self, prompt_encoder, prompt: str, images: list, size: tuple[int, int],
                         device: torch.device, max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        """The instruction's FLUX conditioning plus "image_latents" [1, L, 4C]: encode_instruction's,
        then encode_source's (the engine calls the two apart, to encode a source once per rollout)."""
        out = self.encode_instruction(prompt_encoder, prompt, images, device, max_sequence_length)
        out.update(self.encode_source(prompt_encoder, images, size, device))
        return out

    def encode_instruction(self, prompt_encoder, prompt: str, images: list, device: torch.device,
                           max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        """FLUX.1's text conditioning of the instruction (CLIP pooled + T5 states); Kontext's text
        encoders do not see the source, so `images` only has its count checked."""
        check_one_source(images)
        return prompt_encoder([prompt], device, int(max_sequence_length or self.max_sequence_length))

    def encode_source(self, prompt_encoder, images: list, size: tuple[int, int],
                      device: torch.device) -> dict[str, torch.Tensor]:
        """{"image_latents" [1, L, 4C]}: the one source resized to size = (height, width),
        VAE-encoded ((z - shift) * scale, argmax) and packed as FluxKontextPipeline does."""
        from trainer.models.edit_source import resized_source

        check_one_source(images)
        pipe = prompt_encoder.pipe
        height, width = size
        pixels = pipe.image_processor.preprocess(resized_source(images[0], height, width), height, width)
        z = pipe._encode_vae_image(pixels.to(device=device, dtype=pipe.vae.dtype), generator=None)
        return {IMAGE_LATENTS: pack_latents(z)}

    def batch_conditions(self, rows) -> dict[str, torch.Tensor]:
        """FLUX.1's stacked text conditions plus the stacked source latents."""
        out = super().batch_conditions(rows)
        if any(IMAGE_LATENTS in r for r in rows):
            if not all(IMAGE_LATENTS in r for r in rows):
                raise ValueError("a batch mixes candidates with and without a source image; an i2i rollout's "
                                 "records all need one")
            out[IMAGE_LATENTS] = torch.stack([r[IMAGE_LATENTS] for r in rows])
        return out

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                 geometry: Geometry, sampler: SamplerSettings, *,
                 rollout_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The target's velocity [B, L, 4C]: the DiT over [x, image_latents] with Kontext's ids,
        the embedded guidance from the conditions (module docstring)."""
        if sampler.guided:
            raise ValueError("true CFG was asked of the FLUX.1-Kontext adapter, but its --sampling-config "
                             "guidance_scale is the embedded guidance (2.5 for Kontext-dev), one row per candidate")
        if IMAGE_LATENTS not in conditions or not geometry.media:
            raise ValueError("FLUX.1-Kontext samples and replays with a source image: the conditions lack "
                             "'image_latents' or the geometry names no media; give every record an image")
        rows, cols = packed_grid(geometry.height, geometry.width, geometry.vae_scale_factor)
        n = int(x.shape[1])
        cond = conditions[IMAGE_LATENTS].to(device=x.device, dtype=x.dtype)
        if int(cond.shape[1]) != n:
            raise ValueError(f"image_latents hold {int(cond.shape[1])} tokens, the target {n}; the trajectory's "
                             "geometry does not match its conditions")
        guided = has_guidance_embedding(transformer)
        guidance = conditions.get(EMBEDDED_GUIDANCE) if guided else None
        if guided and guidance is None:
            raise ValueError("this FLUX.1-Kontext DiT has a guidance embedding but the conditions carry no "
                             "'guidance'; set --sampling-config guidance_scale (the embedded guidance)")
        out = flux_velocity(transformer, torch.cat([x, cond], dim=1), t, conditions["prompt_embeds"],
                            conditions["pooled_prompt_embeds"], guidance, rows, cols, rollout_dtype=rollout_dtype,
                            img_ids=kontext_img_ids(rows, cols))
        return out[:, :n]

    def check_trajectory(self, traj: Trajectory, who: str) -> None:
        """FLUX.1's checks, then one source's latents [B, L, 4C] and geometry.media ("image",)."""
        super().check_trajectory(traj, who)
        lat = traj.conditions.get(IMAGE_LATENTS)
        if lat is None or len(traj.geometry.media) != 1:
            raise ValueError(f"trajectory of {who}: a Kontext trajectory needs conditions['image_latents'] and one "
                             f"source in geometry.media (got {traj.geometry.media!r})")
        if tuple(lat.shape[1:]) != tuple(traj.latents.shape[2:]):
            raise ValueError(f"trajectory of {who}: image_latents {tuple(lat.shape)} do not match the target's "
                             f"packed latents {tuple(traj.latents.shape[2:])} per candidate")
