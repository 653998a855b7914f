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

# the 2 x 2 packing is every packed family's (models.base); importable from here too
from trainer.models.base import (ATTENTION_LORA_TARGETS, FamilyAdapter, GeometryBounds, check_pipeline_dir,  # noqa: F401
                                 load_checked_transformer, pack_latents, packed_grid, read_config_json,
                                 unpack_latents)
from trainer.sampling import SamplingConfig
from trainer.trajectory import EMBEDDED_GUIDANCE, Geometry, RolloutRequest, SamplerSettings

#: the attention projections of every block, as diffusers names them: a double-stream block has
#: the image stream's to_q / to_k / to_v / to_out.0 and the text stream's add_*_proj / to_add_out;
#: a single-stream block's attention has to_q / to_k / to_v (suffix "attn.to_q" matches both kinds)
FLUX_LORA_TARGETS = ATTENTION_LORA_TARGETS

#: FluxPipeline's default guidance_scale: the embedded guidance FLUX.1-dev was distilled around
FLUX_DEV_GUIDANCE = 3.5


# ----------------------------------------------------------------------------- geometry


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
    img_ids: torch.Tensor | None = None,
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
    img_ids: the image tokens' ids when the sequence holds more than the rows x cols target grid
    (Kontext's condition tokens follow it); None: latent_image_ids(rows, cols).
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
        img_ids=latent_image_ids(rows, cols, dev, dt) if img_ids is None else img_ids.to(device=dev, dtype=dt),
        return_dict=False,
    )
    return out[0] if isinstance(out, (tuple, list)) else out.sample


# ----------------------------------------------------------------------------- loading


#: the model directory's subfolders the engine loads (FLUX.1-dev's diffusers layout)
FLUX_SUBFOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def check_model_dir(model_path, subfolders=("transformer",)):
    """The model directory as a Path, after checking it is a local diffusers FLUX.1 directory
    holding `subfolders`. Raises FileNotFoundError naming --model-path."""
    return check_pipeline_dir(model_path, subfolders, family="FLUX.1", family_flag=" --family flux",
                              pipeline="FLUX.1 pipeline", expected=FLUX_SUBFOLDERS)


def load_flux_transformer(model_path, *, dtype: torch.dtype | None = None):
    """FluxTransformer2DModel from `<model_path>/transformer`, local files only, eval mode;
    `dtype` None keeps the stored dtype. Weights the files lack, have extra or shape differently
    raise ModelFilesError naming the config (diffusers would leave them on meta and only warn)."""
    from diffusers import FluxTransformer2DModel

    return load_checked_transformer(FluxTransformer2DModel, check_model_dir(model_path, ("transformer",)), dtype)


def has_guidance_embedding(transformer) -> bool:
    """Whether the DiT takes the embedded guidance (FLUX.1-dev: yes; FLUX.1-schnell: no), read
    from its config through any peft / FSDP2 wrapping (both keep the diffusers class)."""
    inner = getattr(transformer, "base_model", None)
    inner = getattr(inner, "model", transformer) if inner is not None else transformer
    cfg = getattr(inner, "config", None) or getattr(transformer, "config", None)
    return bool(getattr(cfg, "guidance_embeds", False))


# ----------------------------------------------------------------------------- the adapter


#: what guidance_scale means for this family, in the words errors and docs use
_GUIDANCE_MEANING = ("for FLUX.1 --sampling-config guidance_scale is the embedded guidance (the guidance-distilled "
                     "DiT's `guidance` input, FluxPipeline's guidance_scale; 3.5 for FLUX.1-dev), not true CFG: a "
                     "FLUX rollout always runs one conditional row per candidate")


class FluxAdapter(FamilyAdapter):
    """The FLUX.1 family (trainer/models/base.py: FamilyAdapter holds the shared part).

    Conditions (a Trajectory's `conditions`): "prompt_embeds" [B, T, D] T5 states (T =
    max_sequence_length: the tokenizer pads every prompt to it, so no mask and no re-padding),
    "pooled_prompt_embeds" [B, P] CLIP's pooled output and "guidance" [B] fp32, the embedded
    guidance the candidate was sampled at (recorded, so the replay feeds the DiT the same
    value). Latents are packed [B, S, L, 4C]. There is no true CFG: guidance_scale is the
    embedded guidance (`_GUIDANCE_MEANING`).
    """

    family = "flux"
    lora_target_modules = FLUX_LORA_TARGETS
    #: FluxPipeline's default T5 window (and its maximum); every prompt is padded to it
    max_sequence_length = 512
    #: the most --max-sequence-length may ask (FluxPipeline's own limit)
    max_sequence_length_limit = 512
    #: the recipe geometry tools/sample.py uses without --sampling-config (configs/flux1dev_t2i_lora_pickscore.toml)
    sampling_defaults = {"height": 512, "width": 512, "num_inference_steps": 6, "guidance_scale": FLUX_DEV_GUIDANCE,
                         "eta": 0.9, "sde_type": "sde", "sde_indices": [1, 2, 3, 4]}
    #: the model directory's subfolders the engine loads
    rollout_subfolders = FLUX_SUBFOLDERS
    #: cuDNN's fused attention is turned off in the training process (base.apply_attention_policy):
    #: on an H200 (torch 2.11, CUDA 13) its backward failed in the LoRA replay at FLUX.1-dev's shape
    #: (an illegal memory access with checkpointing, "mha_graph.execute ... is_good()" without);
    #: with flash / memory-efficient attention the same replay and update ran
    cudnn_attention = False
    # never_trained_param_names is FamilyAdapter's []: the double-stream blocks' text outputs feed
    # the single-stream blocks, and a single-stream block runs ONE set of weights over the joined
    # text + image sequence, so even the last block's weights shape image tokens
    # (tests/test_family_flux.py trains every parameter)

    load_transformer = staticmethod(load_flux_transformer)
    vae_scale_factor_from_config = staticmethod(vae_scale_factor_from_config)

    @classmethod
    def geometry_bounds(cls, model_path) -> GeometryBounds:
        """Sizes are multiples of the VAE scale factor x 2 (FluxPipeline packs 2 x 2 latent patches);
        the rotary embedding has no practical size limit. From vae/config.json."""
        vae = read_config_json(model_path, "vae")
        vsf = None if vae is None or "block_out_channels" not in vae else vae_scale_factor_from_config(vae)
        return GeometryBounds(multiple=None if vsf is None else 2 * vsf,
                              max_sequence_length=cls.max_sequence_length_limit,
                              why_multiple=f"vae/config.json's scale factor {vsf} x 2 for the 2 x 2 latent packing")

    # -- the engine's side -----------------------------------------------------------------

    def load_rollout_modules(self, model_path, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """transformer, vae, text_encoder (an nn.ModuleDict: "clip" CLIPTextModel, "t5"
        T5EncoderModel), tokenizer ({"clip", "t5"}) and scheduler_config from a local diffusers
        FLUX.1 directory, each module moved to `device` as soon as it is loaded."""
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

        path = check_model_dir(model_path, self.rollout_subfolders)
        encoders = torch.nn.ModuleDict({
            "clip": CLIPTextModel.from_pretrained(str(path / "text_encoder"), dtype=dtype,
                                                  local_files_only=True).to(device),
            "t5": T5EncoderModel.from_pretrained(str(path / "text_encoder_2"), dtype=dtype,
                                                 local_files_only=True).to(device)})
        tokenizers = {"clip": CLIPTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True),
                      "t5": AutoTokenizer.from_pretrained(str(path / "tokenizer_2"), local_files_only=True)}
        return self.autoencoder_kl_modules(path, dtype=dtype, device=device, text_encoder=encoders,
                                           tokenizer=tokenizers)

    def prompt_encoder(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict):
        """encode(prompts, device, max_sequence_length) -> {"prompt_embeds": [B, T, D] (T5, padded
        to max_sequence_length), "pooled_prompt_embeds": [B, P] (CLIP pooled)}, as
        FluxPipeline.encode_prompt does it (a pipeline object over the same modules lends it).
        The callable carries `tokenizer` (T5's; tools/bench.py sizes prompts with it)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

        pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config), vae=vae,
                            text_encoder=text_encoder["clip"], tokenizer=tokenizer["clip"],
                            text_encoder_2=text_encoder["t5"], tokenizer_2=tokenizer["t5"], transformer=transformer)

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int) -> dict[str, torch.Tensor]:
            embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device,
                                                   max_sequence_length=max_sequence_length)
            return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

        encode.tokenizer = tokenizer["t5"]
        return encode

    def batch_conditions(self, rows) -> dict[str, torch.Tensor]:
        """Per-candidate {"prompt_embeds": [T, D], "pooled_prompt_embeds": [P]} -> stacked
        [B, T, D] / [B, P]. Every prompt is padded to the same T by the T5 tokenizer, so nothing is
        re-padded (and there is no mask: FluxPipeline passes none); unequal lengths raise."""
        lengths = sorted({int(r["prompt_embeds"].shape[0]) for r in rows})
        if len(lengths) > 1:
            raise ValueError(f"FLUX prompt conditionings of one batch have lengths {lengths}; the T5 tokenizer pads "
                             "every prompt to max_sequence_length, so they must be equal")
        return {"prompt_embeds": torch.stack([r["prompt_embeds"] for r in rows]),
                "pooled_prompt_embeds": torch.stack([r["pooled_prompt_embeds"] for r in rows])}

    def sigma_schedule(self, scheduler_config: dict, num_inference_steps: int, geometry: Geometry) -> list[float]:
        """FluxPipeline's sigmas: linspace(1, 1/N, N) passed to the scheduler with mu =
        calculate_shift(packed image tokens, the scheduler's base/max seq len and shifts)
        (sampling.sigma_schedule; bit-exact, tests/test_family_flux.py)."""
        from trainer.sampling import image_seq_len, sigma_schedule

        return sigma_schedule(scheduler_config, num_inference_steps,
                              image_seq_len(geometry.height, geometry.width, geometry.vae_scale_factor))

    def latent_geometry(self, vae) -> tuple[int, int]:
        """(vae_scale_factor, latent channels) of the engine's AutoencoderKL."""
        return vae_scale_factor_from_config(vae.config), int(vae.config.latent_channels)

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                 geometry: Geometry, sampler: SamplerSettings, *,
                 rollout_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The DiT's velocity for packed latents x [B, L, 4C] at scheduler timesteps t [B]
        (flux_velocity); the guidance input is conditions["guidance"] when the DiT has a
        guidance embedding. True CFG is refused (`_GUIDANCE_MEANING`)."""
        if sampler.guided:
            raise ValueError(f"true CFG was asked of the FLUX adapter, but {_GUIDANCE_MEANING}")
        rows, cols = packed_grid(geometry.height, geometry.width, geometry.vae_scale_factor)
        guidance = conditions.get(EMBEDDED_GUIDANCE) if has_guidance_embedding(transformer) else None
        if guidance is None and has_guidance_embedding(transformer):
            raise ValueError("this FLUX DiT has a guidance embedding but the conditions carry no 'guidance'; "
                             "the rollout request must set the embedded guidance (--sampling-config guidance_scale)")
        return flux_velocity(transformer, x, t, conditions["prompt_embeds"], conditions["pooled_prompt_embeds"],
                             guidance, rows, cols, rollout_dtype=rollout_dtype)

    def decode(self, vae, packed: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Packed final latents -> images [B, 3, H, W] float32 in [0, 1] on CPU (decode_latents)."""
        return decode_latents(vae, packed, geometry.height, geometry.width, geometry.vae_scale_factor)

    # -- rollout --------------------------------------------------------------------------

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: SamplingConfig, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None):
        """One candidate as an engine RolloutRequest: guidance_scale becomes the request's
        embedded_guidance and its true-CFG scale stays 1.0 (`_GUIDANCE_MEANING`). Raises
        ValueError for a guidance below 1, an empty / out-of-range trained-step set, a trained
        step 0 under sde_type "sde", and a sigma list that is not num_inference_steps + 1 long."""
        import dataclasses

        # the shared invariants (guidance >= 1, trained steps, step 0, sigma count) are checked on
        # the embedded guidance; the request then carries it there, with one DiT row (no true CFG)
        request = super().build_rollout_request(prompt, group_index=group_index, slot=slot, sample_id=sample_id,
                                                sampling=sampling, sde_indices=sde_indices, sigmas=sigmas,
                                                generation_seed=generation_seed, metadata=metadata)
        defaults = {f.name: f.default for f in dataclasses.fields(RolloutRequest)}
        return dataclasses.replace(request, guidance_scale=1.0, embedded_guidance=request.guidance_scale,
                                   negative_prompt=defaults["negative_prompt"], cfg_renorm=defaults["cfg_renorm"])

    def check_trajectory(self, traj, who: str) -> None:
        """Packed latents [B, S, L, C] of the geometry's grid (FamilyAdapter), the CLIP pooled
        embedding and the embedded guidance in the conditions, and no true CFG."""
        super().check_trajectory(traj, who)
        for name in ("pooled_prompt_embeds", EMBEDDED_GUIDANCE):
            if name not in traj.conditions:
                raise ValueError(f"trajectory of {who}: conditions lack {name!r}; a FLUX replay needs the CLIP pooled "
                                 "embedding and the embedded guidance the candidate was sampled with")
        if traj.guided:
            raise ValueError(f"trajectory of {who}: guidance_scale {traj.guidance_scale} (true CFG), but "
                             f"{_GUIDANCE_MEANING}")
