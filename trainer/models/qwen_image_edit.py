"""The Qwen-Image-Edit adapter (the 2509 / 2511 "plus" layout, QwenImageEditPlusPipeline).

An edit candidate is conditioned on an instruction AND its record's source image(s):

- the Qwen2.5-VL text encoder sees each source (resized to ~384 x 384 pixels at its aspect, as
  the pipeline's CONDITION_IMAGE_SIZE has it) beside the instruction: the prompt becomes
  "Picture 1: <|vision_start|><|image_pad|><|vision_end|>" + instruction under the edit
  template, through trainer.models.qwen_vl_processor.ImagePromptProcessor;
- the VAE encodes each source, resized to the candidate's output size, into condition latents
  (the pipeline's own _encode_vae_image: argmax, so deterministic), packed 2 x 2 like the target;
- the DiT sees [target tokens, condition tokens] with `img_shapes` listing the target first, then
  each source; the velocity is its output over the target tokens (the 2511 DiT's zero_cond_t
  modulates the condition tokens at timestep 0 inside the model);
- true CFG as the pipeline does it: the negative prompt is encoded with the same source images,
  and the combined velocity is rescaled to the conditional one's norm per token. The source
  latents do not depend on the prompt: the engine VAE-encodes each source once (encode_source)
  and runs only the VL encoder per prompt (encode_instruction).

The trajectory records the encoded condition: "prompt_embeds" / "_mask" (and "negative_*"),
plus "image_latents" [B, n_sources * L, C], stored once for both CFG branches
(`shared_conditions`). The replay therefore needs neither the VAE nor the source files: it feeds
the DiT the recorded latents, which is exactly the forward the sampler ran, even after the file
changed or from a sidecar on another host. Sources are resized to the output size rather than the
pipeline's ~1 megapixel default, which keeps one sequence length per rollout (Flow-Factory's edit
recipes condition at the training resolution too); `Geometry.media` holds one "image" per source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from trainer.models.base import GeometryBounds, check_pipeline_dir, pack_latents, packed_grid, read_config_json
from trainer.models.causal_conv import install_single_frame_convs
from trainer.models.qwen_image import (QwenImageAdapter, dit_velocity, guided_velocity, pad_text,
                                       prompt_template_start_idx, vae_scale_factor_from_config)
from trainer.trajectory import Geometry, SamplerSettings, Trajectory

#: the condition name of the packed source latents
IMAGE_LATENTS = "image_latents"
#: the prompt placeholder of one source image in a record (trainer.data.MEDIA_PLACEHOLDERS)
IMAGE_PLACEHOLDER = "<image>"


def check_edit_model_dir(model_path, subfolders: Sequence[str]) -> Path:
    """The model directory as a Path after checking it holds `subfolders` (FileNotFoundError
    naming --model-path otherwise)."""
    return check_pipeline_dir(model_path, subfolders, family="Qwen-Image-Edit", family_flag=" --family qwen_image_edit",
                              pipeline="QwenImageEditPlusPipeline",
                              expected=("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler"))


def instruction_text(prompt: str) -> str:
    """A record's prompt without its <image> placeholders and the spaces around them (the
    pipeline writes its own "Picture k:" marker per source in front of the instruction); a
    prompt without one (a negative prompt such as " ") is passed as it is."""
    if IMAGE_PLACEHOLDER not in prompt:
        return prompt
    return " ".join(prompt.replace(IMAGE_PLACEHOLDER, " ").split())


def edit_img_shapes(batch_size: int, geometry: Geometry) -> list[list[tuple[int, int, int]]]:
    """The DiT's img_shapes for B rows: the target's token grid, then one per source, each source
    at the target's size (module docstring)."""
    rows, cols = packed_grid(geometry.height, geometry.width, geometry.vae_scale_factor)
    return [[(1, rows, cols)] * (1 + len(geometry.media))] * batch_size


def edit_velocity(transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                  geometry: Geometry, sampler: SamplerSettings, *, rollout_dtype: torch.dtype | None = None):
    """Velocity [B, L, C] of the target tokens x [B, L, C]: the DiT over [x, image_latents] (one
    forward; under true CFG both branches in one forward of 2B rows, guided_velocity, whose
    combination and per-token renorm act token by token, so cutting the condition tokens after
    it equals the pipeline's cutting before)."""
    n = int(x.shape[1])
    cond = conditions[IMAGE_LATENTS].to(device=x.device, dtype=x.dtype)
    if int(cond.shape[1]) != n * len(geometry.media):
        raise ValueError(f"image_latents hold {int(cond.shape[1])} tokens for {len(geometry.media)} source(s) of "
                         f"{n} tokens each; the trajectory's geometry does not match its conditions")
    seq = torch.cat([x, cond], dim=1)
    shapes = edit_img_shapes(int(x.shape[0]), geometry)
    if sampler.guided:
        out = guided_velocity(transformer, seq, t, conditions["prompt_embeds"], conditions.get("prompt_embeds_mask"),
                              conditions["negative_prompt_embeds"], conditions.get("negative_prompt_embeds_mask"),
                              shapes, sampler.guidance_scale, sampler.cfg_renorm, rollout_dtype=rollout_dtype)
    else:
        out = dit_velocity(transformer, seq, t, conditions["prompt_embeds"], conditions.get("prompt_embeds_mask"),
                           shapes, rollout_dtype=rollout_dtype)
    return out[:, :n]


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit-2509 / -2511 (module docstring); Qwen-Image's DiT, loading, schedule and
    decode, its own conditioning."""

    family = "qwen_image_edit"
    rollout_subfolders = ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler")
    #: conditions both CFG branches read: encoded once per source (encode_source) and recorded once
    shared_conditions = (IMAGE_LATENTS,)
    #: the generation task this family trains
    generation_task = "i2i"

    @classmethod
    def geometry_bounds(cls, model_path) -> GeometryBounds:
        vae = read_config_json(model_path, "vae")
        vsf = None if vae is None else vae_scale_factor_from_config(vae)
        return GeometryBounds(multiple=None if vsf is None else 2 * vsf,
                              why_multiple=f"vae/config.json's scale factor {vsf} x 2 for the 2 x 2 latent packing")

    def load_rollout_modules(self, model_path, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """Qwen-Image's modules plus the processor: the "tokenizer" entry is an
        ImagePromptProcessor (the tokenizer and the image processor of processor/). The directory
        is checked first as an edit directory, so a missing processor/ is named as such."""
        from trainer.models.qwen_vl_processor import ImagePromptProcessor

        path = check_edit_model_dir(model_path, self.rollout_subfolders)
        modules = super().load_rollout_modules(path, dtype=dtype, device=device)
        modules["tokenizer"] = ImagePromptProcessor.from_pretrained(path / "processor", tokenizer=modules["tokenizer"])
        return modules

    def prompt_encoder(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict):
        """encode(prompts, device, max_sequence_length) of the instruction alone (no source; the
        engine calls encode_instruction / encode_source for records with images). `tokenizer` is the
        ImagePromptProcessor load_rollout_modules returns (or a bare tokenizer, then wrapped with
        a default image processor). The callable carries the pipeline as `.pipe`."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

        from trainer.models.qwen_vl_processor import ImagePromptProcessor, build_image_processor

        processor = tokenizer if isinstance(tokenizer, ImagePromptProcessor) else ImagePromptProcessor(
            build_image_processor({}), tokenizer)
        pipe = QwenImageEditPlusPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
                                         vae=vae, text_encoder=text_encoder, tokenizer=processor.tokenizer,
                                         processor=processor, transformer=transformer)
        pipe.prompt_template_encode_start_idx = prompt_template_start_idx(processor.tokenizer,
                                                                          pipe.prompt_template_encode)

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int = 0,
                   images: list | None = None) -> dict[str, torch.Tensor]:
            embeds, mask = pipe.encode_prompt(prompt=[instruction_text(p) for p in prompts], image=images,
                                              device=device)
            mask = (torch.ones(embeds.shape[:2], dtype=torch.int64, device=embeds.device) if mask is None
                    else mask.to(torch.int64))
            return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

        encode.pipe = pipe
        encode.template = pipe.prompt_template_encode
        encode.template_start_idx = pipe.prompt_template_encode_start_idx
        return encode

    def encode_condition(self, prompt_encoder, prompt: str, images: list, size: tuple[int, int],
                         device: torch.device, max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        """{"prompt_embeds" [1, T, D], "prompt_embeds_mask" [1, T], "image_latents" [1, n L, C]}
        of `prompt` shown the PIL `images`, as QwenImageEditPlusPipeline conditions (module
        docstring) for a size = (height, width) output: encode_instruction's, then encode_source's
        (the engine calls the two apart, to encode a source once for both CFG branches)."""
        out = self.encode_instruction(prompt_encoder, prompt, images, device, max_sequence_length)
        out.update(self.encode_source(prompt_encoder, images, size, device))
        return out

    def encode_instruction(self, prompt_encoder, prompt: str, images: list, device: torch.device,
                           max_sequence_length: int | None = None) -> dict[str, torch.Tensor]:
        """{"prompt_embeds" [1, T, D], "prompt_embeds_mask" [1, T]}: the Qwen2.5-VL encoder over
        `prompt` shown each PIL image resized to ~384 x 384 at its aspect (the pipeline's
        CONDITION_IMAGE_SIZE). max_sequence_length is unused: the edit pipeline keeps the whole
        prompt (its vision tokens included)."""
        from trainer.models.edit_geometry import QWEN_EDIT_CONDITION_AREA, area_dimensions

        pipe = prompt_encoder.pipe
        vl_images = []
        for image in images:
            cw, ch = area_dimensions(QWEN_EDIT_CONDITION_AREA, image.width / image.height)
            vl_images.append(pipe.image_processor.resize(image, ch, cw))
        return prompt_encoder([prompt], device, 0, images=vl_images)

    def encode_source(self, prompt_encoder, images: list, size: tuple[int, int],
                      device: torch.device) -> dict[str, torch.Tensor]:
        """{"image_latents" [1, n L, C]}: each PIL image resized to size = (height, width),
        VAE-encoded (the pipeline's _encode_vae_image: argmax, so deterministic, normalised) and
        packed 2 x 2, the sources one after the other. It does not depend on the prompt, so both
        CFG branches share it."""
        from trainer.models.edit_source import resized_source

        pipe = prompt_encoder.pipe
        install_single_frame_convs(pipe.vae)  # one frame: the 2-D convolutions it equals
        height, width = size
        latents = []
        for image in images:
            pixels = pipe.image_processor.preprocess(resized_source(image, height, width), height, width)
            pixels = pixels.unsqueeze(2).to(device=device, dtype=pipe.vae.dtype)
            z = pipe._encode_vae_image(pixels, generator=None)[:, :, 0]  # [1, C, h, w], normalised
            latents.append(pack_latents(z))
        return {IMAGE_LATENTS: torch.cat(latents, dim=1)}

    def batch_conditions(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The text rows zero-padded with their mask (pad_text) and the source latents stacked
        (one sequence length per rollout: every source at the output size)."""
        embeds, mask = pad_text([r["prompt_embeds"] for r in rows], [r.get("prompt_embeds_mask") for r in rows])
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if all(IMAGE_LATENTS in r for r in rows):
            out[IMAGE_LATENTS] = torch.stack([r[IMAGE_LATENTS] for r in rows])
        elif any(IMAGE_LATENTS in r for r in rows):
            raise ValueError("a batch mixes candidates with and without source images; an i2i rollout's records "
                             "all need images")
        return out

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                 geometry: Geometry, sampler: SamplerSettings, *,
                 rollout_dtype: torch.dtype | None = None) -> torch.Tensor:
        """edit_velocity: the DiT over the target and condition tokens, the target's velocity out."""
        if IMAGE_LATENTS not in conditions or not geometry.media:
            raise ValueError("Qwen-Image-Edit samples and replays with source images: the conditions lack "
                             "'image_latents' or the geometry names no media; give every record an image")
        return edit_velocity(transformer, x, t, conditions, geometry, sampler, rollout_dtype=rollout_dtype)

    def check_trajectory(self, traj: Trajectory, who: str) -> None:
        """Qwen-Image's checks, then the source latents: [B, n_sources * L, C] for the geometry's
        media."""
        super().check_trajectory(traj, who)
        lat = traj.conditions.get(IMAGE_LATENTS)
        if lat is None or not traj.geometry.media:
            raise ValueError(f"trajectory of {who}: an edit trajectory needs conditions['image_latents'] and "
                             f"geometry.media (got media {traj.geometry.media!r})")
        seq, ch = int(traj.latents.shape[2]), int(traj.latents.shape[3])
        if lat.dim() != 3 or int(lat.shape[1]) != seq * len(traj.geometry.media) or int(lat.shape[2]) != ch:
            raise ValueError(f"trajectory of {who}: image_latents {tuple(lat.shape)} do not fit {len(traj.geometry.media)} "
                             f"source(s) of {seq} tokens x {ch} channels")
