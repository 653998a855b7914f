"""The Qwen-Image adapter: everything Qwen-Image specific the trainer needs.

The actor loads only the transformer (`load_train_model`); the frozen text encoder and VAE
belong to the rollout engine. Rollout and replay share one DiT call (`dit_velocity`), so the
velocity the actor recomputes comes from exactly the kwargs the engine sampled with.

The trajectory a rollout records and the update replays is a trainer.trajectory.Trajectory;
for this family its latents are packed [B, S, L, C] (L image tokens of C = 4 x z_dim channels,
2 x 2 patches), and its conditions are "prompt_embeds" [B, T, D] (the text encoder's hidden states,
zero-padded to the batch's longest prompt) and "prompt_embeds_mask" [B, T] int64 (1 = real token).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from trainer.core.names import model_name
from trainer.models.causal_conv import install_single_frame_convs
# the 2 x 2 packing is every packed family's (models.base); importable from here too
from trainer.models.base import (ATTENTION_LORA_TARGETS, FamilyAdapter, GeometryBounds, check_pipeline_dir,  # noqa: F401
                                 load_checked_transformer, pack_latents, packed_grid, read_config_json,
                                 unpack_latents)
from trainer.trajectory import Geometry, SamplerSettings, Trajectory

#: the eight attention projections of each block (image and text stream); SGLang's Qwen-Image
#: DiT uses the same names, so an adapter trained here loads there without a rename
QWEN_IMAGE_LORA_TARGETS = ATTENTION_LORA_TARGETS

#: parameter-path prefixes, inside the last dual-stream block, that only produce discarded text outputs
_DEAD_IN_LAST_BLOCK = ("attn.add_q_proj.", "attn.norm_added_q.", "attn.to_add_out.", "txt_mlp.")

def check_model_dir(model_path: str | os.PathLike, subfolders: Sequence[str] = ("transformer",)) -> Path:
    """The model directory as a Path, after checking it is a local diffusers Qwen-Image
    directory holding `subfolders`. Raises FileNotFoundError naming --model-path."""
    return check_pipeline_dir(model_path, subfolders, family="Qwen-Image", family_flag="", pipeline="Qwen-Image pipeline",
                              expected=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"))


def load_qwen_image_transformer(model_path, *, dtype: torch.dtype | None = None):
    """QwenImageTransformer2DModel from `<model_path>/transformer`, local files only, eval mode.
    `dtype` None keeps the stored dtype."""
    from diffusers import QwenImageTransformer2DModel

    return load_checked_transformer(QwenImageTransformer2DModel, check_model_dir(model_path, ("transformer",)), dtype)


def never_trained_param_names(model: torch.nn.Module) -> list[str]:
    """Parameters (model names) whose output is discarded, so they can never receive a gradient.

    Qwen-Image style dual-stream DiTs drop the text stream after the LAST block, so in that block
    everything that only shapes text-token OUTPUTS feeds nothing: the text queries
    (`attn.add_q_proj`, `attn.norm_added_q`; text keys/values still reach the image tokens), the
    text-output projection `attn.to_add_out` and the text MLP `txt_mlp`. Left trainable,
    AdamW keeps no state for them (grad is None), which breaks a plain DCP load of model+optimizer
    ("Missing key ... to_add_out.weight.step") and misreports what is trained. We freeze them
    deliberately; _assert_trainable_boundary checks exactly this set is frozen (LoRA tensors on
    these modules included). A model without that structure returns []. Called before any wrapping (the actor's
    build step 2) and on a meta-device model (tools/export_checkpoint.py).
    """
    blocks = getattr(model, "transformer_blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return []
    last = blocks[len(blocks) - 1]
    inner = getattr(last, "_checkpoint_wrapped_module", last)
    if not (hasattr(inner, "txt_mlp") and hasattr(getattr(inner, "attn", None), "to_add_out")):
        return []
    prefix = None
    for name, module in model.named_modules():
        if module is last:
            prefix = model_name(name)
            break
    assert prefix is not None
    dead = []
    for name, _ in model.named_parameters():
        mname = model_name(name)
        if mname.startswith(prefix + "."):
            rest = mname[len(prefix) + 1:]
            if rest.startswith(_DEAD_IN_LAST_BLOCK):
                dead.append(mname)
    return dead


def prompt_template_start_idx(tokenizer, template: str) -> int:
    """Number of tokens of the prompt template's prefix (the system turn), which encode_prompt
    drops from the text encoder's output. Computed from the tokenizer because it depends on it
    (34 for the real Qwen-Image tokenizer; longer for the tiny byte-level one) and
    save_pretrained does not store it."""
    prefix = template.split("{}")[0]
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    probe = tokenizer(template.format("a photo"), add_special_tokens=False)["input_ids"]
    if probe[:len(ids)] != ids:
        raise ValueError("the tokenizer merges the prompt template's prefix with the prompt, so the prefix "
                         "cannot be dropped by position; the tokenizer/ of --model-path is not a Qwen2 one")
    return len(ids)


def rotary_real(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Qwen-Image's rotary embedding of q or k, in real arithmetic: x [B, S, H, D] with its last
    dimension read as D / 2 (re, im) pairs, freqs_cis [S, D / 2] complex64. The pairs are rotated
    as (a + bi)(c + di) = (ac - bd) + (ad + bc)i in fp32, then cast back to x's dtype: the
    arithmetic of diffusers' complex multiply, written so inductor can fuse it with the q / k
    norm around it (it leaves complex tensors to eager kernels)."""
    a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
    c, d = torch.view_as_real(freqs_cis).unsqueeze(1).unbind(-1)
    return torch.stack([a * c - b * d, a * d + b * c], dim=-1).flatten(3).type_as(x)


def install_compiled_rope() -> bool:
    """Route diffusers' Qwen-Image rotary embedding (apply_rotary_emb_qwen, complex form) through
    `rotary_real` while torch.compile traces it; eager calls run diffusers' own function, so
    an uncompiled forward is unchanged to the bit. Process-wide and idempotent (the engine and
    the actor compile the same blocks); QwenImageAdapter.prepare_block_compile calls it before
    blocks are compiled. Returns whether it installed it now (diffusers' own function stays
    reachable as its `.original`)."""
    from diffusers.models.transformers import transformer_qwenimage as qwen_dit

    original = qwen_dit.apply_rotary_emb_qwen
    if getattr(original, "compiled_rope", False):
        return False

    def apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        if not use_real and torch.compiler.is_compiling() and torch.is_tensor(freqs_cis) and freqs_cis.is_complex():
            return rotary_real(x, freqs_cis)
        return original(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim)

    apply_rotary_emb_qwen.compiled_rope, apply_rotary_emb_qwen.original = True, original
    qwen_dit.apply_rotary_emb_qwen = apply_rotary_emb_qwen
    return True


def vae_scale_factor_from_config(vae_config: dict) -> int:
    """Spatial compression of a Qwen-Image VAE: 2 ** len(temperal_downsample) (8 for the real
    model, 4 for the tiny test model) -- the same rule QwenImagePipeline uses."""
    return 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))


# ----------------------------------------------------------------------------- geometry


def img_shapes_for(batch_size: int, height: int, width: int, vae_scale_factor: int) -> list[list[tuple[int, int, int]]]:
    """The transformer's `img_shapes` kwarg: one [(frames=1, rows, cols)] per candidate."""
    rows, cols = packed_grid(height, width, vae_scale_factor)
    return [[(1, rows, cols)]] * batch_size


# ----------------------------------------------------------------------------- the DiT call


def text_conditioning(prompt_embeds: torch.Tensor,
                      prompt_embeds_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The text conditioning the DiT actually needs: (embeds [B, T', D], mask [B, T'] or None).

    T' = 1 + the last column that is a real token in ANY row (padding columns that every row
    masks are dropped: a key masked in every row gets softmax weight exactly 0, so they only
    cost work; text RoPE positions count from 0 either way, and padded text-stream outputs are
    discarded). The mask becomes None when it is all ones, which lets torch SDPA pick its flash
    kernel (any attn_mask rules flash out) -- mathematically the same attention. Micro-batches
    of one prompt (a GRPO group's candidates) therefore run mask-free even when the rollout's
    prompts differ in length. Reads the mask on the host: free for a CPU mask (replay), one
    tiny device-to-host copy for a device mask.
    """
    if prompt_embeds_mask is None:
        return prompt_embeds, None
    real = prompt_embeds_mask.detach().cpu() != 0  # [B, T], read once
    cols = real.any(dim=0).nonzero()
    t_keep = int(cols.max()) + 1 if cols.numel() else 1
    if t_keep < real.shape[1]:
        prompt_embeds, prompt_embeds_mask, real = (prompt_embeds[:, :t_keep], prompt_embeds_mask[:, :t_keep],
                                                   real[:, :t_keep])
    return prompt_embeds, (None if bool(real.all()) else prompt_embeds_mask)


def dit_velocity(
    transformer,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor | None,
    img_shapes,
    *,
    rollout_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Velocity [B, L, C] predicted by the Qwen-Image DiT, called exactly as the engine calls it.

    latents [B, L, C] in the dtype the module computes in; timesteps [B] fp32 scheduler
    timesteps (sigma * 1000), rounded through `rollout_dtype` (default: the latents' dtype)
    and divided by 1000 as QwenImagePipeline does (sampling.transformer_timestep), so a replay
    in another dtype still sees the timestep the sampler saw; prompt_embeds [B, T, D] (cast to
    the latents' dtype); prompt_embeds_mask [B, T] (1 = token) goes through text_conditioning:
    padding columns shared by every row are dropped and an all-ones mask is not passed, so
    SDPA can use its flash kernel (bit-identical output in fp32 on CPU, tested; on GPU the
    flash kernel rounds differently from the masked one). Engine and replay both call this, so
    they take the same path for the same rows. A plain forward call: works for the bare
    module, a peft-injected one and an FSDP2-sharded one.
    """
    from trainer.sampling import transformer_timestep

    t = transformer_timestep(timesteps, dtype=rollout_dtype or latents.dtype).to(latents.device, latents.dtype)
    embeds, mask = text_conditioning(prompt_embeds, prompt_embeds_mask)
    out = transformer(
        hidden_states=latents,
        encoder_hidden_states=embeds.to(device=latents.device, dtype=latents.dtype),
        encoder_hidden_states_mask=None if mask is None else mask.to(device=latents.device),
        timestep=t,
        img_shapes=img_shapes,
        return_dict=False,
    )
    return out[0] if isinstance(out, (tuple, list)) else out.sample


def guided_velocity(
    transformer,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_embeds_mask: torch.Tensor | None,
    negative_embeds: torch.Tensor,
    negative_mask: torch.Tensor | None,
    img_shapes,
    guidance_scale: float,
    renorm: bool,
    *,
    rollout_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """True classifier-free guidance in ONE DiT forward of 2B rows (conditional rows first, then
    the unconditional ones, the two text conditionings zero-padded to a common length):

        v = v_neg + g * (v_cond - v_neg)
        renorm: v = v * ||v_cond|| / ||v||   (per token, over channels; QwenImagePipeline's rescale)

    latents [B, L, C]; timesteps [B]; prompt / negative embeds [B, T, D] / [B, T', D] with
    masks; img_shapes for B rows. Rollout and replay both call this, so the replay's velocity is
    the sampler's; gradients reach the policy through both rows. Returns [B, L, C].
    """
    b = int(latents.shape[0])
    t_max = max(int(prompt_embeds.shape[1]), int(negative_embeds.shape[1]))

    def padded(e, m):
        if m is None:
            m = torch.ones(e.shape[:2], dtype=torch.int64, device=e.device)
        pad = t_max - int(e.shape[1])
        if pad:
            e = torch.cat([e, e.new_zeros((e.shape[0], pad, e.shape[2]))], dim=1)
            m = torch.cat([m, m.new_zeros((m.shape[0], pad))], dim=1)
        return e, m.to(torch.int64)

    pe, pm = padded(prompt_embeds, prompt_embeds_mask)
    ne, nm = padded(negative_embeds.to(device=pe.device, dtype=pe.dtype), negative_mask.to(pe.device)
                    if negative_mask is not None else None)
    both = dit_velocity(transformer, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                        torch.cat([pe, ne]), torch.cat([pm, nm]), list(img_shapes) * 2, rollout_dtype=rollout_dtype)
    cond, uncond = both[:b], both[b:]
    out = uncond + float(guidance_scale) * (cond - uncond)
    if renorm:
        out = out * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
    return out


# ----------------------------------------------------------------------------- batches


def pad_text(embeds: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-candidate conditioning [T_i, D] into [B, T_max, D] (zero padding) and the
    masks into [B, T_max] int64 (1 = token). A None mask means all T_i tokens are real."""
    t_max = max(int(e.shape[0]) for e in embeds)
    d = int(embeds[0].shape[1])
    out = embeds[0].new_zeros((len(embeds), t_max, d))
    mask = torch.zeros((len(embeds), t_max), dtype=torch.int64, device=embeds[0].device)
    for i, (e, m) in enumerate(zip(embeds, masks)):
        n = int(e.shape[0])
        out[i, :n] = e
        mask[i, :n] = 1 if m is None else m.to(torch.int64).reshape(-1)[:n]
    return out, mask


class QwenImageAdapter(FamilyAdapter):
    """The Qwen-Image family (trainer/models/base.py: FamilyAdapter holds the shared part)."""

    family = "qwen_image"
    lora_target_modules = QWEN_IMAGE_LORA_TARGETS
    #: QwenImagePipeline's text window after the template prefix
    max_sequence_length = 512
    #: the most --max-sequence-length may ask (QwenImagePipeline's own limit)
    max_sequence_length_limit = 1024
    #: the model directory's subfolders the engine loads
    rollout_subfolders = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

    load_transformer = staticmethod(load_qwen_image_transformer)
    vae_scale_factor_from_config = staticmethod(vae_scale_factor_from_config)

    @classmethod
    def geometry_bounds(cls, model_path) -> GeometryBounds:
        """Sizes are multiples of the VAE scale factor x 2 (QwenImagePipeline packs 2 x 2 latent
        patches); the rotary embedding has no practical size limit. From vae/config.json."""
        vae = read_config_json(model_path, "vae")
        vsf = None if vae is None else vae_scale_factor_from_config(vae)
        return GeometryBounds(multiple=None if vsf is None else 2 * vsf,
                              max_sequence_length=cls.max_sequence_length_limit,
                              why_multiple=f"vae/config.json's scale factor {vsf} x 2 for the 2 x 2 latent packing")

    def prepare_block_compile(self) -> None:
        """Compiled blocks rotate q / k in real arithmetic (install_compiled_rope)."""
        install_compiled_rope()

    def never_trained_param_names(self, model: torch.nn.Module) -> list[str]:
        """The last block's text-output parameters (module function never_trained_param_names)."""
        return never_trained_param_names(model)

    # -- the engine's side -----------------------------------------------------------------

    def load_rollout_modules(self, model_path, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """transformer, vae, text_encoder, tokenizer and scheduler_config from a local diffusers
        directory, each module moved to `device` as soon as it is loaded (host memory holds one at
        a time)."""
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        from trainer.sampling import load_scheduler_config

        path = check_model_dir(model_path, self.rollout_subfolders)
        return {
            "scheduler_config": load_scheduler_config(str(path)),
            "transformer": load_qwen_image_transformer(path, dtype=dtype).to(device),
            "vae": AutoencoderKLQwenImage.from_pretrained(str(path), subfolder="vae", dtype=dtype,
                                                          local_files_only=True).to(device),
            "text_encoder": Qwen2_5_VLForConditionalGeneration.from_pretrained(
                str(path / "text_encoder"), dtype=dtype, local_files_only=True).to(device),
            "tokenizer": Qwen2Tokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True),
            "path": path,
        }

    def prompt_encoder(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict):
        """encode(prompts, device, max_sequence_length) -> {"prompt_embeds": [B, T, D],
        "prompt_embeds_mask": [B, T] int64 (all ones when the pipeline returns no mask)}, as
        QwenImagePipeline.encode_prompt does it (template, prefix drop, 512 window). The
        pipeline object only lends that; it shares the modules, so nothing is loaded twice.
        The callable also carries `template` and `template_start_idx` (tools/bench.py sizes its
        prompts with them)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
                                 vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        pipe.prompt_template_encode_start_idx = prompt_template_start_idx(tokenizer, pipe.prompt_template_encode)

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int) -> dict[str, torch.Tensor]:
            embeds, mask = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=max_sequence_length)
            mask = (torch.ones(embeds.shape[:2], dtype=torch.int64, device=embeds.device) if mask is None
                    else mask.to(torch.int64))
            return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

        encode.template = pipe.prompt_template_encode
        encode.template_start_idx = pipe.prompt_template_encode_start_idx
        return encode

    def split_prompt_batch(self, encoded: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each prompt's row cut to its own tokens: the pipeline pads a batch of prompts at the end
        to the longest one (prompt_embeds_mask's zeros), and a prompt alone is not padded."""
        rows = []
        for row in super().split_prompt_batch(encoded):
            mask = row["prompt_embeds_mask"]
            n = int(mask.sum())
            if not bool(mask[:n].all()):
                raise ValueError("prompt_embeds_mask of a batched prompt encoding is not its tokens then padding; "
                                 "encode the prompts one at a time")
            rows.append({k: v[:n] for k, v in row.items()})
        return rows

    def latent_geometry(self, vae) -> tuple[int, int]:
        """(vae_scale_factor, latent channels) of the engine's VAE."""
        return vae_scale_factor_from_config(vae.config), int(vae.config.z_dim)

    def batch_conditions(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-candidate {"prompt_embeds": [T_i, D], "prompt_embeds_mask": [T_i]} -> one zero-padded
        batch with its mask [B, T_max] int64 (module function pad_text)."""
        embeds, mask = pad_text([r["prompt_embeds"] for r in rows], [r.get("prompt_embeds_mask") for r in rows])
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def sigma_schedule(self, scheduler_config: dict, num_inference_steps: int, geometry: Geometry) -> list[float]:
        """QwenImagePipeline's sigmas: linspace(1, 1/N, N) passed to the scheduler, shifted by its
        resolution-dependent mu (sampling.sigma_schedule at the image's token count)."""
        from trainer.sampling import image_seq_len, sigma_schedule

        return sigma_schedule(scheduler_config, num_inference_steps,
                              image_seq_len(geometry.height, geometry.width, geometry.vae_scale_factor))

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                 geometry: Geometry, sampler: SamplerSettings, *,
                 rollout_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The DiT's velocity for packed latents x [B, L, C] at timesteps t [B]: dit_velocity, or
        under true CFG guided_velocity (both rows in one forward; the unconditional rows'
        conditioning is conditions["negative_prompt_embeds"] and its mask)."""
        shapes = img_shapes_for(int(x.shape[0]), geometry.height, geometry.width, geometry.vae_scale_factor)
        if sampler.guided:
            return guided_velocity(transformer, x, t, conditions["prompt_embeds"], conditions.get("prompt_embeds_mask"),
                                   conditions["negative_prompt_embeds"], conditions.get("negative_prompt_embeds_mask"),
                                   shapes, sampler.guidance_scale, sampler.cfg_renorm, rollout_dtype=rollout_dtype)
        return dit_velocity(transformer, x, t, conditions["prompt_embeds"], conditions.get("prompt_embeds_mask"),
                            shapes, rollout_dtype=rollout_dtype)

    def decode(self, vae, packed: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Packed final latents [B, L, C] -> images [B, 3, H, W] float32 in [0, 1] on CPU, as
        QwenImagePipeline decodes (un-normalise with latents_mean / latents_std, one frame); the
        VAE's causal convolutions run as the 2-D ones they equal on one frame (causal_conv)."""
        install_single_frame_convs(vae)
        rows, cols = packed_grid(geometry.height, geometry.width, geometry.vae_scale_factor)
        z = unpack_latents(packed, rows, cols).unsqueeze(2).to(vae.dtype)
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, cfg.z_dim, 1, 1, 1)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()

    def check_trajectory(self, traj: Trajectory, who: str) -> None:
        """Packed latents [B, S, L, C] of the geometry's grid (FamilyAdapter) and the text mask."""
        super().check_trajectory(traj, who)
        if "prompt_embeds_mask" not in traj.conditions:
            raise ValueError(f"trajectory of {who}: conditions lack 'prompt_embeds_mask'; the engine must record the "
                             "text conditioning's mask with it")
