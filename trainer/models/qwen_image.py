"""The Qwen-Image adapter: everything Qwen-Image specific the trainer needs.

The actor loads only the transformer (`load_train_model`); the frozen text encoder and VAE
belong to the rollout engine. Rollout and replay share one DiT call (`dit_velocity`), so the
velocity the actor recomputes comes from exactly the kwargs the engine sampled with.

Trajectory batch (what `pack_trajectory` returns and `replay_transition` consumes), B
candidates, S trained steps, L packed image tokens of C channels, T text tokens of width D:

    latents, next_latents   [B, S, L, C]  packed latents before / after each trained step,
                                          in the dtype the sampler ran in
    sigmas, sigmas_next     [B, S] fp32   the step's sigma pair
    timesteps               [B, S] fp32   the scheduler timestep (sigma * num_train_timesteps)
    log_probs               [B, S] fp32   the sampler's transition log-prob
    prompt_embeds           [B, T, D]     frozen text conditioning, zero-padded to the batch max
    prompt_embeds_mask      [B, T] int64  1 = real token, 0 = padding
    sde_indices             [S] int64     which denoising steps the columns are (same for all)
    policy_versions, group_indices, slots   [B] int64
    height, width, vae_scale_factor          python ints (same for all candidates)
    sample_ids, prompts                      list[str]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from trainer.core.names import model_name, strip_wrapper_segments
from trainer.engine.base import RolloutRequest
from trainer.models.base import ModelFilesError

#: the eight attention projections of each block (image and text stream); SGLang's Qwen-Image
#: DiT uses the same names, so an adapter trained here loads there without a rename
QWEN_IMAGE_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

#: parameter-path prefixes, inside the last dual-stream block, that only produce discarded text outputs
_DEAD_IN_LAST_BLOCK = ("attn.add_q_proj.", "attn.norm_added_q.", "attn.to_add_out.", "txt_mlp.")

#: response keys a rollout must carry for the actor to replay it
REQUIRED_RESPONSE_KEYS = (
    "trajectory_latents",
    "trajectory_next_latents",
    "timesteps",
    "sigmas",
    "sigmas_next",
    "log_probs",
    "sde_indices",
    "prompt_embeds",
    "height",
    "width",
)

#: per-candidate tensors of a trajectory batch (leading dim B); the rest is shared geometry
BATCH_TENSOR_KEYS = (
    "latents",
    "next_latents",
    "sigmas",
    "sigmas_next",
    "timesteps",
    "log_probs",
    "prompt_embeds",
    "prompt_embeds_mask",
    "policy_versions",
    "group_indices",
    "slots",
)
BATCH_LIST_KEYS = ("sample_ids", "prompts")


# ----------------------------------------------------------------------------- loading


def check_model_dir(model_path: str | os.PathLike, subfolders: Sequence[str] = ("transformer",)) -> Path:
    """The model directory as a Path, after checking it is a local diffusers Qwen-Image
    directory holding `subfolders`. Raises FileNotFoundError naming --model-path."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model-path {str(model_path)!r} is not a directory; point it at a local diffusers "
            "Qwen-Image directory (nothing is downloaded; tools/make_tiny_model.py builds a tiny one)"
        )
    missing = [s for s in subfolders if not (path / s).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"--model-path {str(path)!r} has no {', '.join(s + '/' for s in missing)} subfolder: not a diffusers "
            "Qwen-Image pipeline directory (expected model_index.json, transformer/, vae/, text_encoder/, "
            "tokenizer/, scheduler/)"
        )
    return path


def load_qwen_image_transformer(model_path, *, dtype: torch.dtype | None = None):
    """QwenImageTransformer2DModel from `<model_path>/transformer`, local files only, eval mode.
    `dtype` None keeps the stored dtype."""
    from diffusers import QwenImageTransformer2DModel

    path = check_model_dir(model_path, ("transformer",))
    kwargs: dict[str, Any] = {"subfolder": "transformer", "local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model, info = QwenImageTransformer2DModel.from_pretrained(str(path), output_loading_info=True, **kwargs)
    # diffusers leaves weights the files lack on the meta device and only warns; the first use
    # then fails with "Cannot copy out of meta tensor", which names nothing
    problems = [f"{len(info[k])} {what}, e.g. {sorted(info[k])[:3]}" for k, what in (
        ("missing_keys", "weights the config needs are absent from the files"),
        ("unexpected_keys", "weights in the files have no place in the config"),
        ("mismatched_keys", "weights have another shape than the config says")) if info.get(k)]
    if problems:
        raise ModelFilesError(f"{path / 'transformer' / 'config.json'} does not match the weight files in "
                         f"{path / 'transformer'}: {'; '.join(problems)}. Restore the config.json that was "
                         "saved with these weights (or the weights of this config)")
    return model.eval()


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


def vae_scale_factor_from_config(vae_config: dict) -> int:
    """Spatial compression of a Qwen-Image VAE: 2 ** len(temperal_downsample) (8 for the real
    model, 4 for the tiny test model) -- the same rule QwenImagePipeline uses."""
    return 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))


def read_vae_scale_factor(model_path) -> int:
    """vae_scale_factor from `<model_path>/vae/config.json`."""
    cfg_path = Path(model_path) / "vae" / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot read {cfg_path} ({e}); is --model-path a Qwen-Image directory?") from None
    return vae_scale_factor_from_config(cfg)


# ----------------------------------------------------------------------------- geometry


def packed_grid(height: int, width: int, vae_scale_factor: int, patch_size: int = 2) -> tuple[int, int]:
    """(rows, cols) of 2x2-packed latent patches for an image of height x width pixels:
    (H // (vsf * p), W // (vsf * p)); the DiT's sequence length is rows * cols.
    Matches QwenImagePipeline (img_shapes and _pack_latents)."""
    f = vae_scale_factor * patch_size
    return int(height) // f, int(width) // f


def img_shapes_for(batch_size: int, height: int, width: int, vae_scale_factor: int) -> list[list[tuple[int, int, int]]]:
    """The transformer's `img_shapes` kwarg: one [(frames=1, rows, cols)] per candidate."""
    rows, cols = packed_grid(height, width, vae_scale_factor)
    return [[(1, rows, cols)]] * batch_size


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] latents -> [B, (H/2)*(W/2), C*4] 2x2 patches, as QwenImagePipeline packs."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of pack_latents: [B, rows*cols, C*4] -> [B, C, 2*rows, 2*cols]."""
    b, n, c4 = latents.shape
    if n != rows * cols:
        raise ValueError(f"packed latents hold {n} tokens, expected {rows} x {cols} = {rows * cols}")
    x = latents.view(b, rows, cols, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, rows * 2, cols * 2)


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


def select_candidates(batch: dict[str, Any], index) -> dict[str, Any]:
    """The sub-batch of candidates `index` (a slice, a list of ints or an index tensor):
    per-candidate tensors and lists are indexed, shared geometry is copied as is.
    This is how the actor cuts micro-batches."""
    if isinstance(index, slice):
        idx = list(range(*index.indices(len(batch["sample_ids"]))))
    else:
        idx = [int(i) for i in (index.tolist() if torch.is_tensor(index) else index)]
    out = dict(batch)
    ind = torch.tensor(idx, dtype=torch.long)
    for key in BATCH_TENSOR_KEYS:
        if key in batch and torch.is_tensor(batch[key]):
            out[key] = batch[key].index_select(0, ind.to(batch[key].device))
    for key in BATCH_LIST_KEYS:
        if key in batch:
            out[key] = [batch[key][i] for i in idx]
    return out


def _as_list(x) -> list:
    if torch.is_tensor(x):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


class QwenImageAdapter:
    """GenerativeModelAdapter for Qwen-Image text-to-image (see trainer/models/base.py)."""

    family = "qwen_image"
    supported_tasks = ("t2i",)
    lora_target_modules = QWEN_IMAGE_LORA_TARGETS

    def __init__(self, vae_scale_factor: int | None = None):
        #: set from the model directory by load_train_model; responses carry it as well
        self.vae_scale_factor = vae_scale_factor

    # -- loading --------------------------------------------------------------------------

    def load_train_model(self, model_path: str, *, dtype: Any = None, revision: str | None = None):
        """Only the trainable transformer (frozen text encoder / VAE belong to the engine).
        `revision` only labels the run: loading is always from the local directory."""
        model = load_qwen_image_transformer(model_path, dtype=dtype)
        self.vae_scale_factor = read_vae_scale_factor(model_path)
        return model

    # -- the engine's side -----------------------------------------------------------------
    # What a generic engine (engine/native.py) asks of the family: its frozen modules, prompt
    # encoding, the latent layout, the velocity call and the decode. The SDE math is shared.

    #: the model directory's subfolders the engine loads
    rollout_subfolders = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

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
        """encode(prompts, device, max_sequence_length) -> (embeds [B, T, D], mask [B, T] or None),
        as QwenImagePipeline.encode_prompt does it (template, prefix drop, 512 window). The
        pipeline object only lends that; it shares the modules, so nothing is loaded twice.
        The callable also carries `template` and `template_start_idx` (tools/bench.py sizes its
        prompts with them)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
                                 vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        pipe.prompt_template_encode_start_idx = prompt_template_start_idx(tokenizer, pipe.prompt_template_encode)

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int):
            return pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=max_sequence_length)

        encode.template = pipe.prompt_template_encode
        encode.template_start_idx = pipe.prompt_template_encode_start_idx
        return encode

    def latent_geometry(self, vae) -> tuple[int, int]:
        """(vae_scale_factor, latent channels) of the engine's VAE."""
        return vae_scale_factor_from_config(vae.config), int(vae.config.z_dim)

    def initial_latents(self, x_t: torch.Tensor, transformer, height: int, width: int,
                        vae_scale_factor: int) -> torch.Tensor:
        """Unpacked x_T [B, C, h, w] -> the DiT's packed input [B, L, 4C], after checking the shape
        fits height x width on this transformer (a wrong init_noise_latent_shape names itself)."""
        rows, cols = packed_grid(height, width, vae_scale_factor)
        shape = list(x_t.shape[1:])
        in_ch = transformer.config.in_channels
        if len(shape) != 3 or shape[1] != 2 * rows or shape[2] != 2 * cols or shape[0] * 4 != in_ch:
            raise ValueError(
                f"x_T shape {shape} does not fit {height}x{width} on this model (expected "
                f"[{in_ch // 4}, {2 * rows}, {2 * cols}]); fix --sampling-config "
                "init_noise_latent_shape or height/width")
        return pack_latents(x_t)

    def pad_text(self, embeds, masks):
        """Per-prompt conditioning -> one zero-padded batch with its mask (module function pad_text)."""
        return pad_text(embeds, masks)

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor, mask: torch.Tensor,
                 height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
        """The DiT's velocity for packed latents x [B, L, C] at timesteps t [B] (dit_velocity, the
        call replay makes too)."""
        return dit_velocity(transformer, x, t, embeds, mask,
                            img_shapes_for(int(x.shape[0]), height, width, vae_scale_factor))

    def decode(self, vae, packed: torch.Tensor, height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
        """Packed final latents [B, L, C] -> images [B, 3, H, W] float32 in [0, 1] on CPU, as
        QwenImagePipeline decodes (un-normalise with latents_mean / latents_std, one frame)."""
        rows, cols = packed_grid(height, width, vae_scale_factor)
        z = unpack_latents(packed, rows, cols).unsqueeze(2).to(vae.dtype)
        cfg = vae.config
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, cfg.z_dim, 1, 1, 1)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()

    # -- rollout --------------------------------------------------------------------------

    def build_rollout_request(
        self,
        prompt: str,
        *,
        group_index: int,
        slot: int,
        sample_id: str,
        sampling: Any,
        sde_indices: list[int],
        sigmas: list[float],
        generation_seed: int,
        metadata: dict | None = None,
    ) -> RolloutRequest:
        """One candidate as an engine RolloutRequest.

        Raises ValueError when guidance_scale != 1.0 (the replay is a single positive-conditioned
        forward, so a CFG rollout would train against a policy it never sampled from), when the
        trained-step set is empty, out of range, or trains step 0 under sde_type "sde", and when
        `sigmas` is not num_inference_steps + 1 values.
        """
        guidance = float(getattr(sampling, "guidance_scale", 1.0))
        if guidance != 1.0:
            raise ValueError(
                f"--sampling-config guidance_scale is {guidance}, but must be 1.0: the actor replays a single "
                "positive-conditioned forward, so a CFG rollout would train against a policy it never sampled "
                "from (two-forward CFG replay is not implemented)"
            )
        n = int(sampling.num_inference_steps)
        steps = sorted({int(i) for i in sde_indices})
        if not steps:
            raise ValueError(
                "the resolved trained SDE step set is empty: set sde_indices, or num_sde_steps (with sde_pool or "
                "sde_timestep_fraction) in --sampling-config; generation injects SDE noise and records a "
                "trajectory only at trained steps"
            )
        if steps[0] < 0 or steps[-1] >= n:
            raise ValueError(f"trained SDE steps {steps} are outside 0..{n - 1} (num_inference_steps={n})")
        sde_type = getattr(sampling, "sde_type", "sde")
        if sde_type == "sde" and steps[0] == 0:
            raise ValueError(
                "trained SDE step 0 under sde_type 'sde' is singular (sigma == 1 divides by zero; only the "
                "sigma_max clamp keeps it finite): use e.g. sde_indices [1,3,5] / sde_pool [1,2,3,4,5], or "
                "sde_type 'dance'"
            )
        if len(sigmas) != n + 1:
            raise ValueError(f"sigmas must hold num_inference_steps + 1 = {n + 1} values (terminal 0 included), got {len(sigmas)}")
        shape = getattr(sampling, "init_noise_latent_shape", None)
        return RolloutRequest(
            prompt=prompt,
            group_index=int(group_index),
            slot=int(slot),
            sample_id=str(sample_id),
            height=int(sampling.height),
            width=int(sampling.width),
            num_inference_steps=n,
            sigmas=[float(s) for s in sigmas],
            sde_indices=steps,
            eta=float(sampling.eta),
            sde_type=sde_type,
            sigma_max=float(getattr(sampling, "sigma_max", 0.99)),
            guidance_scale=guidance,
            generation_seed=int(generation_seed),
            metadata=dict(metadata or {}),
            init_noise_latent_shape=None if shape is None else [int(v) for v in shape],
        )

    def validate_rollout_response(self, response: dict) -> None:
        """Raise ValueError naming the missing keys (trajectory latents, timesteps, sde indices,
        height, width, ...) or inconsistent shapes of one response."""
        missing = [k for k in REQUIRED_RESPONSE_KEYS if response.get(k) is None]
        if missing:
            who = response.get("sample_id", "<unknown sample>")
            raise ValueError(
                f"rollout response for {who} lacks {missing}: the engine must return the trajectory "
                "(latents before/after each trained step, timesteps, sigmas, log-probs, sde indices), the "
                "frozen conditioning and the echoed height/width, or the actor cannot replay it"
            )
        s = len(_as_list(response["sde_indices"]))
        lat = response["trajectory_latents"]
        nxt = response["trajectory_next_latents"]
        if lat.shape != nxt.shape or lat.dim() != 3 or lat.shape[0] != s:
            raise ValueError(
                f"rollout response for {response.get('sample_id')}: trajectory latents {tuple(lat.shape)} / next "
                f"{tuple(nxt.shape)} must both be [S={s}, L, C]"
            )
        for key in ("timesteps", "sigmas", "sigmas_next", "log_probs"):
            if tuple(response[key].shape) != (s,):
                raise ValueError(f"rollout response for {response.get('sample_id')}: {key} has shape "
                                 f"{tuple(response[key].shape)}, expected ({s},)")

    def pack_trajectory(self, responses: list[dict]) -> dict[str, Any]:
        """Collate candidates into one trajectory batch (module docstring), on CPU.

        All candidates must share the trained steps and the image geometry (they come from one
        rollout); the text conditioning is zero-padded to the longest prompt with its mask.
        """
        if not responses:
            raise ValueError("pack_trajectory got no responses")
        for r in responses:
            self.validate_rollout_response(r)
        first = responses[0]
        sde = _as_list(first["sde_indices"])
        geom = (int(first["height"]), int(first["width"]), int(first.get("vae_scale_factor") or self.vae_scale_factor or 8))
        for r in responses[1:]:
            if _as_list(r["sde_indices"]) != sde:
                raise ValueError(f"candidates of one batch trained different SDE steps: {sde} vs "
                                 f"{_as_list(r['sde_indices'])} ({r.get('sample_id')})")
            g = (int(r["height"]), int(r["width"]), int(r.get("vae_scale_factor") or geom[2]))
            if g != geom:
                raise ValueError(f"candidates of one batch differ in geometry (height, width, vae_scale_factor): "
                                 f"{geom} vs {g} ({r.get('sample_id')})")
        embeds, mask = pad_text([r["prompt_embeds"].cpu() for r in responses],
                                [None if r.get("prompt_embeds_mask") is None else r["prompt_embeds_mask"].cpu()
                                 for r in responses])
        rows, cols = packed_grid(geom[0], geom[1], geom[2])
        seq = int(first["trajectory_latents"].shape[1])
        if seq != rows * cols:
            raise ValueError(f"trajectory latents hold {seq} tokens but height x width = {geom[0]} x {geom[1]} with "
                             f"vae_scale_factor {geom[2]} gives {rows} x {cols}; the response's geometry is wrong")
        return {
            "latents": torch.stack([r["trajectory_latents"].cpu() for r in responses]),
            "next_latents": torch.stack([r["trajectory_next_latents"].cpu() for r in responses]),
            "sigmas": torch.stack([r["sigmas"].float().cpu() for r in responses]),
            "sigmas_next": torch.stack([r["sigmas_next"].float().cpu() for r in responses]),
            "timesteps": torch.stack([r["timesteps"].float().cpu() for r in responses]),
            "log_probs": torch.stack([r["log_probs"].float().cpu() for r in responses]),
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "sde_indices": torch.tensor(sde, dtype=torch.int64),
            "policy_versions": torch.tensor([int(r.get("policy_version", 0)) for r in responses], dtype=torch.int64),
            "group_indices": torch.tensor([int(r.get("group_index", -1)) for r in responses], dtype=torch.int64),
            "slots": torch.tensor([int(r.get("slot", -1)) for r in responses], dtype=torch.int64),
            "sample_ids": [str(r.get("sample_id", "")) for r in responses],
            "prompts": [str(r.get("prompt", "")) for r in responses],
            "height": geom[0],
            "width": geom[1],
            "vae_scale_factor": geom[2],
        }

    # -- replay ---------------------------------------------------------------------------

    def replay_transition(self, transformer: Any, batch: dict[str, Any], step: int, sampling: Any) -> torch.Tensor:
        """Log-prob [B] (fp32) of trained-step column `step` of `batch`, recomputed through
        `transformer` with the sampler's math (flow_grpo.replay_transition_logp).

        The DiT input is the recorded latents cast to the module's parameter dtype (under FSDP2
        mixed precision, its policy then casts to the compute dtype); the timestep is rounded
        through the rollout's dtype, as the sampler did. Exact at equal dtypes; a bf16 rollout
        replayed in fp32 differs by ~3e-4, so keep them equal. The log-prob math itself runs in
        fp32 on the recorded tensors. Tensors are moved to the transformer's device.
        Differentiable w.r.t. the transformer's parameters. `sampling` supplies eta, sde_type
        and sigma_max.
        """
        column = {k: (v[:, step:step + 1] if k in _TRAJECTORY_COLUMNS else v) for k, v in batch.items()}
        return self.replay_transitions(transformer, column, sampling)[:, 0]

    def replay_transitions(self, transformer: Any, batch: dict[str, Any], sampling: Any) -> torch.Tensor:
        """Log-probs [B, S] (fp32) of EVERY trained-step column of `batch`, in one DiT forward over
        B * S rows (row k * B + i = candidate i at column k), instead of S forwards of B rows.

        Each row carries its own timestep, sigmas and conditioning and the DiT treats rows
        independently, so the result is that of S one-column calls (`replay_transition`, which is
        this with S = 1) up to the GEMM's batch-size-dependent rounding. Fewer, larger launches: replay of a micro-batch is
        bound by the host's kernel-launch rate at real scale, so this is what makes it fast. The
        autograd graph holds the same activations as S separate forwards kept for one backward.
        """
        from trainer.flow_grpo import replay_transition_logp

        device, compute_dtype = _module_device_dtype(transformer)
        lat = batch["latents"]
        b, s = int(lat.shape[0]), int(lat.shape[1])

        def rows(t: torch.Tensor) -> torch.Tensor:  # [B, S, ...] -> [S * B, ...], column-major
            return t.transpose(0, 1).reshape(s * b, *t.shape[2:])

        # contiguous like the sampler's own latents: a strided input takes another GEMM path,
        # which in bf16 changes the velocity by an ulp and the log-prob by ~1e-4
        recorded = rows(lat).to(device).contiguous()
        next_latents = rows(batch["next_latents"]).to(device)
        mask = batch.get("prompt_embeds_mask")
        velocity = dit_velocity(
            transformer,
            recorded.to(compute_dtype or recorded.dtype),
            rows(batch["timesteps"]),
            batch["prompt_embeds"].repeat(s, *([1] * (batch["prompt_embeds"].dim() - 1))),
            None if mask is None else mask.repeat(s, *([1] * (mask.dim() - 1))),
            img_shapes_for(s * b, batch["height"], batch["width"], batch["vae_scale_factor"]),
            rollout_dtype=recorded.dtype,
        )
        logp = replay_transition_logp(
            recorded,
            next_latents,
            velocity,
            rows(batch["sigmas"]).to(device),
            rows(batch["sigmas_next"]).to(device),
            float(sampling.eta),
            getattr(sampling, "sde_type", "sde"),
            float(getattr(sampling, "sigma_max", 0.99)),
        )
        return logp.view(s, b).transpose(0, 1)

    # -- misc -----------------------------------------------------------------------------

    def artifact_tracks(self) -> tuple[str, ...]:
        return ("image",)

    def never_trained_param_names(self, model: torch.nn.Module) -> list[str]:
        """The last block's text-output parameters (module function never_trained_param_names)."""
        return never_trained_param_names(model)

    def weight_name_map(self, name: str) -> str:
        """Training-side parameter name -> engine name. The actor's names are already diffusers
        names once wrapper segments are stripped (core.names.strip_wrapper_segments), so
        this also strips them, idempotently."""
        return strip_wrapper_segments(name)


#: batch entries with a trained-step column dimension ([B, S, ...])
_TRAJECTORY_COLUMNS = ("latents", "next_latents", "timesteps", "sigmas", "sigmas_next")


def _module_device_dtype(module) -> tuple[torch.device, torch.dtype | None]:
    """(device, dtype) of the first floating parameter; a DTensor's local shard under FSDP2
    (whose MixedPrecisionPolicy then casts the inputs to its compute dtype). CPU / None if none."""
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point():
            return local.device, local.dtype
    return torch.device("cpu"), None
