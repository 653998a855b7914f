"""The Stable Diffusion 3 / 3.5 adapter: diffusers' SD3Transformer2DModel pipelines
(SD3.5-Medium's MMDiT-X with dual-attention layers, SD3.5-Large's MMDiT).

The actor loads only the transformer; the engine loads the three frozen text encoders (CLIP-L,
CLIP-G, T5, held as one nn.ModuleDict), the VAE and the scheduler config. Rollout and replay
share one DiT call (`dit_velocity` / `guided_velocity`), made exactly as StableDiffusion3Pipeline
makes it, so the velocity the actor recomputes comes from the kwargs the engine sampled with.

A trajectory of this family holds latents unpacked [B, S, C, h, w] (the DiT patchifies itself) and
the conditions "prompt_embeds" [B, 77 + T, 4096] (the CLIP-L and CLIP-G penultimate hidden states,
concatenated and zero-padded to T5's width, then the T5 tokens: every prompt is padded to the same
length by its tokenizers, so no mask is needed) and "pooled_prompt_embeds" [B, 2048] (the two CLIP
pooled projections); true CFG adds both under "negative_".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from trainer.core.names import model_name
from trainer.models.base import (ATTENTION_LORA_TARGETS, FamilyAdapter, GeometryBounds, check_pipeline_dir,
                                 load_checked_transformer, read_config_json, refuse_cfg_renorm,
                                 split_negative)
from trainer.sampling import SamplingConfig
from trainer.trajectory import Geometry, RolloutRequest, SamplerSettings, Trajectory

#: the attention projections of both streams of every joint block, as diffusers names them; the
#: target list of FlowGRPO's SD3 LoRA (scripts/train_sd3.py). The second, image-only attention of
#: SD3.5-Medium's dual-attention blocks ("attn2.*") is not among them, as there; name it in
#: --lora-target-modules to train it too
SD3_LORA_TARGETS = ATTENTION_LORA_TARGETS

#: parameter-path prefixes, inside the last (context_pre_only) joint block, that only shape the
#: text tokens' attention OUTPUT, which that block discards
_DEAD_IN_LAST_BLOCK = ("attn.add_q_proj.", "attn.norm_added_q.")

#: the model directory's subfolders the engine loads
SD3_SUBFOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                  "tokenizer_2", "tokenizer_3", "scheduler")

#: the text encoders' names in the pipeline (and in the engine's ModuleDict)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


def check_model_dir(model_path, subfolders: Sequence[str] = ("transformer",)) -> Path:
    """The model directory as a Path after checking it is a local diffusers SD3 directory
    holding `subfolders`. Raises FileNotFoundError naming --model-path."""
    return check_pipeline_dir(model_path, subfolders, family="Stable Diffusion 3", family_flag=" --family sd3",
                              pipeline="StableDiffusion3Pipeline", expected=SD3_SUBFOLDERS)


def load_sd3_transformer(model_path, *, dtype: torch.dtype | None = None):
    """SD3Transformer2DModel from `<model_path>/transformer`, local files only, eval mode; raises
    ModelFilesError when the weight files do not fill the config (diffusers only warns)."""
    from diffusers import SD3Transformer2DModel

    return load_checked_transformer(SD3Transformer2DModel, check_model_dir(model_path, ("transformer",)), dtype)


def never_trained_param_names(model: torch.nn.Module) -> list[str]:
    """Parameters (model names) whose output is discarded, so they can never receive a gradient.

    SD3's last joint block is `context_pre_only`: it reads the text tokens (their keys and values
    reach the image tokens) but returns no text output, so the text QUERIES of that block
    (`attn.add_q_proj`, and `attn.norm_added_q` under qk_norm) only shape attention rows that are
    thrown away. Their gradient is identically zero; frozen deliberately (LoRA tensors on them
    included) so the optimizer holds no state for them and the trained set is what changes. A
    model without that structure returns []. Works on a meta-device model.
    """
    blocks = getattr(model, "transformer_blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return []
    last = blocks[len(blocks) - 1]
    inner = getattr(last, "_checkpoint_wrapped_module", last)
    if not getattr(inner, "context_pre_only", False):
        return []
    prefix = next((model_name(n) for n, m in model.named_modules() if m is last), None)
    assert prefix is not None
    dead = []
    for name, _ in model.named_parameters():
        mname = model_name(name)
        if mname.startswith(prefix + ".") and mname[len(prefix) + 1:].startswith(_DEAD_IN_LAST_BLOCK):
            dead.append(mname)
    return dead


def vae_scale_factor_from_config(vae_config) -> int:
    """Spatial compression of an AutoencoderKL: 2 ** (len(block_out_channels) - 1), the rule of
    StableDiffusion3Pipeline (8 for SD3.5, 2 for the tiny model)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def image_seq_len(height: int, width: int, vae_scale_factor: int, patch_size: int) -> int:
    """Image tokens of the DiT: (H / vsf / p) * (W / vsf / p), as StableDiffusion3Pipeline counts
    them for a dynamic shift."""
    return (int(height) // vae_scale_factor // patch_size) * (int(width) // vae_scale_factor // patch_size)


# ----------------------------------------------------------------------------- the DiT call


def dit_velocity(transformer, latents: torch.Tensor, timesteps: torch.Tensor, prompt_embeds: torch.Tensor,
                 pooled_prompt_embeds: torch.Tensor) -> torch.Tensor:
    """Velocity [B, C, h, w] of the SD3 DiT, called as StableDiffusion3Pipeline calls it.

    latents [B, C, h, w] in the dtype the module computes in; timesteps [B] fp32 scheduler
    timesteps (sigma * 1000) passed as they are (the pipeline hands the scheduler's float32
    timesteps to the transformer, which embeds them in fp32); prompt_embeds [B, T, D] and
    pooled_prompt_embeds [B, D'] cast to the latents' dtype. A plain forward call: works for the
    bare module, a peft-injected one and an FSDP2-sharded one.
    """
    out = transformer(
        hidden_states=latents,
        timestep=timesteps.to(latents.device),
        encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=latents.dtype),
        pooled_projections=pooled_prompt_embeds.to(device=latents.device, dtype=latents.dtype),
        return_dict=False,
    )
    return out[0] if isinstance(out, (tuple, list)) else out.sample


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """v = v_uncond + g * (v_cond - v_uncond), StableDiffusion3Pipeline's guidance (no rescale);
    any shape, the inputs' dtype."""
    return uncond + float(guidance_scale) * (cond - uncond)


def guided_velocity(transformer, latents: torch.Tensor, timesteps: torch.Tensor, prompt_embeds: torch.Tensor,
                    pooled_prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor,
                    negative_pooled_prompt_embeds: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """True CFG in ONE DiT forward of 2B rows, unconditional rows first as
    StableDiffusion3Pipeline orders them (torch.cat([negative, positive])), then cfg_combine.
    Gradients reach the policy through both rows. Returns [B, C, h, w]."""
    b = int(latents.shape[0])
    both = dit_velocity(transformer, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                        torch.cat([negative_prompt_embeds.to(prompt_embeds.device, prompt_embeds.dtype), prompt_embeds]),
                        torch.cat([negative_pooled_prompt_embeds.to(pooled_prompt_embeds.device,
                                                                    pooled_prompt_embeds.dtype),
                                   pooled_prompt_embeds]))
    return cfg_combine(both[:b], both[b:], guidance_scale)


def conditioned_velocity(transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor], *,
                         guidance_scale: float = 1.0) -> torch.Tensor:
    """The engine's and the replay's one velocity call: dit_velocity at guidance 1, else
    guided_velocity with the "negative_" entries of `conditions`."""
    pos, neg = split_negative(conditions)
    if float(guidance_scale) > 1.0:
        return guided_velocity(transformer, x, t, pos["prompt_embeds"], pos["pooled_prompt_embeds"],
                               neg["prompt_embeds"], neg["pooled_prompt_embeds"], guidance_scale)
    return dit_velocity(transformer, x, t, pos["prompt_embeds"], pos["pooled_prompt_embeds"])


class SD3Adapter(FamilyAdapter):
    """The Stable Diffusion 3 / 3.5 family (trainer/models/base.py: FamilyAdapter holds the shared part)."""

    family = "sd3"
    lora_target_modules = SD3_LORA_TARGETS
    #: T5 tokens per prompt: FlowGRPO's SD3 training and evaluation encode with 128
    #: (StableDiffusion3Pipeline's own default is 256)
    max_sequence_length = 128
    #: the most --max-sequence-length may ask (StableDiffusion3Pipeline's own limit)
    max_sequence_length_limit = 512
    rollout_subfolders = SD3_SUBFOLDERS

    load_transformer = staticmethod(load_sd3_transformer)
    vae_scale_factor_from_config = staticmethod(vae_scale_factor_from_config)

    @classmethod
    def geometry_bounds(cls, model_path) -> GeometryBounds:
        """Sizes are multiples of the VAE scale factor x the DiT's patch size, and at most
        pos_embed_max_size patches a side (the DiT's position-embedding table; diffusers refuses
        more with "Height (...) cannot be greater than pos_embed_max_size"). From vae/config.json
        and transformer/config.json."""
        vae, dit = read_config_json(model_path, "vae"), read_config_json(model_path, "transformer")
        vsf = None if vae is None or "block_out_channels" not in vae else vae_scale_factor_from_config(vae)
        patch = int(dit.get("patch_size", 2)) if dit else None
        table = dit.get("pos_embed_max_size") if dit else None
        known = vsf is not None and patch is not None
        return GeometryBounds(
            multiple=vsf * patch if known else None,
            max_size=int(table) * patch * vsf if known and table else None,
            max_sequence_length=cls.max_sequence_length_limit,
            why_multiple=f"vae/config.json's scale factor {vsf} x transformer/config.json's patch_size {patch}",
            why_max=(f"transformer/config.json's pos_embed_max_size {table} x patch_size {patch} x vae/config.json's "
                     f"scale factor {vsf}"))

    # -- loading --------------------------------------------------------------------------

    def load_rollout_modules(self, model_path, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """transformer, vae, the three text encoders as one nn.ModuleDict, the three tokenizers
        (a dict) and scheduler_config from a local diffusers SD3 directory; each module moved to
        `device` as it is loaded."""
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        path = check_model_dir(model_path, self.rollout_subfolders)
        encoders = torch.nn.ModuleDict()
        for name, cls in zip(TEXT_ENCODERS, (CLIPTextModelWithProjection, CLIPTextModelWithProjection,
                                             T5EncoderModel)):
            encoders[name] = cls.from_pretrained(str(path / name), dtype=dtype, local_files_only=True).to(device)
        tokenizers = {name: AutoTokenizer.from_pretrained(str(path / name), local_files_only=True)
                      for name in TOKENIZERS}
        return self.autoencoder_kl_modules(path, dtype=dtype, device=device, text_encoder=encoders,
                                           tokenizer=tokenizers)

    # -- the engine's side -----------------------------------------------------------------

    def prompt_encoder(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict):
        """encode(prompts, device, max_sequence_length) -> {"prompt_embeds": [B, 77 + T, D],
        "pooled_prompt_embeds": [B, D']}: StableDiffusion3Pipeline.encode_prompt (all three
        encoders see the same prompt, no clip skip, no CFG pairing: the negative prompt is encoded
        the same way as a prompt of its own). The pipeline object only lends that; it shares the
        engine's modules."""
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline(
            transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
            **{name: text_encoder[name] for name in TEXT_ENCODERS}, **dict(tokenizer))

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int) -> dict[str, torch.Tensor]:
            embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                                      do_classifier_free_guidance=False,
                                                      max_sequence_length=max_sequence_length)
            return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

        encode.pipeline = pipe
        return encode

    def batch_conditions(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-candidate {"prompt_embeds": [T, D], "pooled_prompt_embeds": [D']} -> stacked [B, ...]
        (every prompt has the same T: the tokenizers pad to fixed lengths)."""
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        lengths = {tuple(r["prompt_embeds"].shape) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"SD3 prompt_embeds of one batch have different shapes {sorted(lengths)}; the engine "
                             "must encode every prompt with one max_sequence_length")
        return {k: torch.stack([r[k] for r in rows]) for k in keys}

    def sigma_schedule(self, scheduler_config: dict, num_inference_steps: int, geometry: Geometry) -> list[float]:
        """StableDiffusion3Pipeline's sigmas: the scheduler's own set_timesteps(N), no sigmas passed
        (sampling.scheduler_sigma_schedule; SD3.5's static shift 3 is applied twice there)."""
        from trainer.sampling import scheduler_sigma_schedule

        return scheduler_sigma_schedule(scheduler_config, num_inference_steps,
                                        image_seq_len(geometry.height, geometry.width, geometry.vae_scale_factor, 2))

    def latent_geometry(self, vae) -> tuple[int, int]:
        return vae_scale_factor_from_config(vae.config), int(vae.config.latent_channels)

    def initial_latents(self, x_t: torch.Tensor, transformer, geometry: Geometry) -> torch.Tensor:
        """x_T [B, C, h, w] is already the DiT's layout (it patchifies itself); checked against
        height x width, the VAE factor and the DiT's in_channels and patch size."""
        height, width = geometry.height, geometry.width
        h, w = int(height) // geometry.vae_scale_factor, int(width) // geometry.vae_scale_factor
        cfg = transformer.config
        p = int(cfg.patch_size)
        if (list(x_t.shape[1:]) != [int(cfg.in_channels), h, w]) or h % p or w % p:
            raise ValueError(f"x_T shape {list(x_t.shape[1:])} does not fit {height}x{width} on this model (expected "
                             f"[{cfg.in_channels}, {h}, {w}] with h, w multiples of patch size {p}); fix "
                             "--sampling-config init_noise_latent_shape or height/width")
        return x_t

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                 geometry: Geometry, sampler: SamplerSettings, *, rollout_dtype: Any = None) -> torch.Tensor:
        """conditioned_velocity: the DiT called as StableDiffusion3Pipeline calls it (the fp32
        timestep as it is, so rollout_dtype plays no part), true CFG as that pipeline does it. A
        cfg_renorm under CFG raises (build_rollout_request refuses it: the SD3 pipelines have no
        rescale)."""
        refuse_cfg_renorm(sampler.guidance_scale, sampler.cfg_renorm, "StableDiffusion3Pipeline")
        return conditioned_velocity(transformer, x, t, conditions,
                                    guidance_scale=sampler.guidance_scale if sampler.guided else 1.0)

    def decode(self, vae, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Final latents [B, C, h, w] -> images [B, 3, H, W] float32 in [0, 1] on CPU, as
        StableDiffusion3Pipeline decodes: z / scaling_factor + shift_factor, then (x / 2 + 0.5)."""
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()

    # -- rollout --------------------------------------------------------------------------

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: SamplingConfig, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None) -> RolloutRequest:
        """One candidate as an engine RolloutRequest (models.base.standard_rollout_request) after
        refusing cfg_renorm under CFG, a rescale this family's pipeline does not have."""
        refuse_cfg_renorm(sampling.guidance_scale, sampling.cfg_renorm, "StableDiffusion3Pipeline")
        return super().build_rollout_request(prompt, group_index=group_index, slot=slot, sample_id=sample_id,
                                             sampling=sampling, sde_indices=sde_indices, sigmas=sigmas,
                                             generation_seed=generation_seed, metadata=metadata)

    def check_trajectory(self, traj: Trajectory, who: str) -> None:
        """Raise ValueError unless the latents are unpacked [B, S, C, h, w] of the height x width
        grid and the conditions carry the pooled embeddings (and their negative partners under CFG)."""
        lat = traj.latents
        h, w = traj.height // traj.vae_scale_factor, traj.width // traj.vae_scale_factor
        if lat.dim() != 5 or tuple(lat.shape[3:]) != (h, w):
            raise ValueError(f"trajectory of {who}: latents {tuple(lat.shape)} must be [B, S, C, {h}, {w}] for "
                             f"{traj.height}x{traj.width} at vae_scale_factor {traj.vae_scale_factor}")
        wanted = ["pooled_prompt_embeds"] + (["negative_prompt_embeds", "negative_pooled_prompt_embeds"]
                                             if traj.guided else [])
        missing = [k for k in wanted if k not in traj.conditions]
        if missing:
            raise ValueError(f"trajectory of {who}: conditions lack {missing}; the SD3 DiT needs the pooled CLIP "
                             "embeddings (and under CFG the negative prompt's)")

    def never_trained_param_names(self, model: torch.nn.Module) -> list[str]:
        """The last block's text-query parameters (module function never_trained_param_names)."""
        return never_trained_param_names(model)
