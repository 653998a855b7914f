"""The Wan text-to-video adapter: diffusers' WanPipeline (WanTransformer3DModel, AutoencoderKLWan,
the UMT5 text encoder): Wan2.1 (1.3B, 14B: one DiT) and Wan2.2-T2V-A14B (two DiTs, "experts").

Wan2.2 A14B is the same WanPipeline with a second DiT: model_index.json declares `transformer_2`
and `boundary_ratio`. At a step with scheduler timestep t >= boundary_ratio x num_train_timesteps
the pipeline runs `transformer` (the high-noise expert) at guidance_scale, below it
`transformer_2` (the low-noise expert) at guidance_scale_2 (guidance_scale when unset). Here both
load into one `WanExperts` module, so the engine, the replay and the weight names see one DiT;
the expert of a step is a pure function of its recorded timestep and the boundary the trajectory
records (`expert_boundary`), so the replay runs the expert the sampler ran.

The actor loads only the transformer; the engine loads the UMT5 encoder, the VAE and the scheduler
config. Rollout and replay share one DiT call (`conditioned_velocity`), made as WanPipeline makes
it: the DiT patchifies itself, the timestep is the scheduler's (sigma x 1000), true CFG is
v_uncond + g * (v_cond - v_uncond) with no rescale (here both rows in one forward).

A trajectory of this family holds latents unpacked [B, S, C, F', H', W'] (C = 16 latent channels,
F' = (F - 1) // 4 + 1 latent frames of an F-frame video, H' = H / 8, W' = W / 8) and the
condition "prompt_embeds" [B, 512, 4096]: UMT5's last hidden state of every prompt, cut after its
real tokens and zero-padded to the fixed window (WanPipeline's `_get_t5_prompt_embeds`; the DiT
takes no mask, the zeros are its padding). True CFG adds "negative_prompt_embeds" (the empty
negative prompt's, WanPipeline's default). The engine decodes to videos [B, F, 3, H, W] in [0, 1]
(WanPipeline's output_type="pt" layout); a one-frame request decodes to an image [B, 3, H, W].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import torch

from trainer.models.base import (FamilyAdapter, GeometryBounds, check_pipeline_dir, load_checked_transformer,
                                 read_config_json, refuse_cfg_renorm, split_negative)
from trainer.sampling import SamplingConfig
from trainer.trajectory import Geometry, RolloutRequest, SamplerSettings, Trajectory

#: the attention projections of every block (self-attention attn1 and text cross-attention attn2
#: both have them): FlowGRPO's Wan LoRA targets (scripts/train_wan2_1.py; its list also names the
#: add_*_proj / to_add_out of joint blocks, which Wan2.1 T2V does not have)
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

#: the model directory's subfolders the engine loads
WAN_SUBFOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

#: the second expert's model_index.json entry and subfolder (Wan2.2 A14B's low-noise DiT)
WAN_SECOND_EXPERT = "transformer_2"

#: UMT5 tokens per prompt: WanPipeline's default window, what FlowGRPO's Wan training encodes with
WAN_MAX_SEQUENCE_LENGTH = 512


def check_model_dir(model_path, subfolders: Sequence[str] = ("transformer",)) -> Path:
    """The model directory as a Path after checking it is a local diffusers Wan directory holding
    `subfolders`, plus `transformer_2/` when its model_index.json declares that expert (read_boundary_ratio
    checks the declaration). Raises FileNotFoundError / ValueError naming --model-path."""
    extra = (WAN_SECOND_EXPERT,) if Path(model_path).is_dir() and read_boundary_ratio(model_path) is not None else ()
    return check_pipeline_dir(model_path, tuple(subfolders) + extra, family="Wan", family_flag=" --family wan",
                              pipeline="WanPipeline", expected=WAN_SUBFOLDERS + extra)


def _declared(entry: Any) -> bool:
    """Whether a model_index.json component entry names a class (diffusers writes [null, null]
    for an optional component the pipeline was saved without)."""
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(v, str) for v in entry)


#: largest model_index.json read (diffusers writes about 1 KB)
MAX_MODEL_INDEX_BYTES = 1 << 20


def read_model_index(model_path) -> dict | None:
    """`model_path`/model_index.json as a dict, None when the file does not exist (check_model_dir
    and the loaders name a missing one). ValueError naming the file and the fix when it exists but
    is no JSON object (or over MAX_MODEL_INDEX_BYTES): which experts a Wan directory has is read
    from it, so a broken one must stop the load, not make it take the one-DiT path."""
    import json

    path = Path(model_path) / "model_index.json"
    fix = "restore it from the model's Diffusers checkpoint (it names the pipeline and its components)"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MODEL_INDEX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"--model-path {str(model_path)!r}: {path} cannot be read ({e.strerror}); {fix}") from None
    if len(raw) > MAX_MODEL_INDEX_BYTES:
        raise ValueError(f"--model-path {str(model_path)!r}: {path} is over {MAX_MODEL_INDEX_BYTES} bytes; {fix}")
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"--model-path {str(model_path)!r}: {path} is not valid JSON ({str(e)[:120]}); "
                         f"{fix}") from None
    if not isinstance(index, dict):
        raise ValueError(f"--model-path {str(model_path)!r}: {path} holds a JSON {type(index).__name__}, not an "
                         f"object; {fix}")
    return index


def read_boundary_ratio(model_path) -> float | None:
    """The boundary_ratio of a two-expert Wan directory (Wan2.2 A14B: model_index.json declares
    `transformer_2` and a boundary_ratio in (0, 1)), None for a one-DiT (Wan2.1) directory or one
    without model_index.json (loading reports that). Raises ValueError naming --model-path and
    the fix for a model_index.json that is no JSON object (read_model_index), and for a
    declaration the pipeline could not run or that would drop an expert: a boundary_ratio without
    the second expert or outside (0, 1), a second expert without a boundary, no first expert, a
    `transformer_2/` subfolder the index does not declare, or timestep-per-token input
    (`expand_timesteps`: Wan2.2 TI2V-5B, not supported)."""
    import math

    index = read_model_index(model_path)
    if index is None:
        return None
    where = f"--model-path {str(model_path)!r}: model_index.json"
    if index.get("expand_timesteps"):
        raise ValueError(f"{where} sets expand_timesteps (Wan2.2 TI2V-5B, one timestep per token), which this "
                         "trainer does not run; use a Wan2.1 or Wan2.2-T2V-A14B Diffusers directory")
    ratio, second = index.get("boundary_ratio"), _declared(index.get(WAN_SECOND_EXPERT))
    if not _declared(index.get("transformer")) and (second or ratio is not None):
        raise ValueError(f"{where} declares no `transformer` (the high-noise expert); this trainer needs both "
                         "experts of Wan2.2-T2V-A14B: restore the transformer entry and transformer/")
    if ratio is None and not second:
        if (Path(model_path) / WAN_SECOND_EXPERT / "config.json").is_file():
            raise ValueError(f"{where} declares no {WAN_SECOND_EXPERT}, but the directory holds a {WAN_SECOND_EXPERT}/ "
                             "expert (Wan2.2-T2V-A14B's low-noise DiT) that would not be loaded; restore the "
                             f'"{WAN_SECOND_EXPERT}" and "boundary_ratio" entries of model_index.json from the '
                             f"model's Diffusers checkpoint, or remove {WAN_SECOND_EXPERT}/ for a one-DiT model")
        return None
    if not second:
        raise ValueError(f"{where} sets boundary_ratio {ratio} but declares no {WAN_SECOND_EXPERT} (the "
                         "low-noise expert WanPipeline switches to below the boundary); restore the "
                         f"{WAN_SECOND_EXPERT} entry and subfolder, or remove boundary_ratio for a one-DiT model")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or not 0 < ratio < 1:
        raise ValueError(f"{where} declares {WAN_SECOND_EXPERT} but its boundary_ratio is {ratio!r}: it must be a "
                         "number in (0, 1), the fraction of num_train_timesteps where WanPipeline switches from "
                         "the high-noise to the low-noise expert (Wan2.2-T2V-A14B ships 0.875); fix "
                         "model_index.json")
    return float(ratio)


def expert_boundary(boundary_ratio: float, scheduler_config: dict) -> float:
    """The timestep at and above which WanPipeline runs the high-noise expert, on the engine's
    recorded timesteps (sigma x num_train_timesteps in fp32): boundary_ratio x num_train_timesteps,
    rounded up to an integer under the UniPC scheduler, whose timesteps the pipeline compares are
    the integer parts of sigma x T (int(t) >= b exactly when t >= ceil(b)). The choice can differ
    from the stock pipeline's only for a sigma within fp32 rounding of the boundary."""
    import math

    b = float(boundary_ratio) * int(scheduler_config.get("num_train_timesteps", 1000))
    return float(math.ceil(b)) if scheduler_config.get("_class_name") == "UniPCMultistepScheduler" else b


class WanExperts(torch.nn.Module):
    """Wan2.2 A14B's two DiTs as one module: `transformer` (high noise, t >= boundary) and
    `transformer_2` (low noise), under the names WanPipeline gives them, so parameter names, the
    sync, checkpoints and LoRA cover both ("transformer.blocks.0...", "transformer_2.blocks.0...").
    `boundary_ratio` is model_index.json's, `boundary` expert_boundary's timestep; its forward
    runs each row through its expert (pick_experts)."""

    _no_split_modules = ["WanTransformerBlock"]
    _repeated_blocks = ["WanTransformerBlock"]

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, boundary_ratio: float,
                 boundary: float):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.boundary = float(boundary)

    @property
    def config(self):
        """The high-noise expert's config (both experts share in_channels and the patch size)."""
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def add_adapter(self, config, adapter_name: str = "default") -> None:
        """The same peft LoRA on both experts (the engine installs a synced adapter through this)."""
        for expert in (self.transformer, self.transformer_2):
            expert.add_adapter(config, adapter_name=adapter_name)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False):
        """Each row through the expert WanPipeline runs at its timestep (pick_experts): a batch of one
        expert goes through it whole (the one-DiT call, bit for bit); a mixed one (the replay's
        columns on both sides of the boundary) as two sub-batches put back in row order. Being the
        module's forward, it is the FSDP2 root's: both experts' non-block weights are gathered
        here, and only the blocks of an expert that has rows run."""
        high = pick_experts(timestep, self.boundary)
        # one host sync per DiT call: which experts run is a choice of modules, made on the host
        n_high = int(high.sum())
        if n_high in (0, high.numel()):
            expert = self.transformer if n_high else self.transformer_2
            return expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                          return_dict=False)
        out = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            idx = rows.nonzero().squeeze(1).to(hidden_states.device)
            v = expert(hidden_states=hidden_states[idx], timestep=timestep[idx.to(timestep.device)],
                       encoder_hidden_states=encoder_hidden_states[idx], return_dict=False)[0]
            if out is None:
                out = v.new_empty((hidden_states.shape[0], *v.shape[1:]))
            out = out.index_copy(0, idx, v)
        return (out,)


def pick_experts(timesteps: torch.Tensor, boundary: float) -> torch.Tensor:
    """Bool [B]: True where a row runs the high-noise expert (timestep >= boundary), WanPipeline's
    rule on the recorded fp32 timesteps."""
    return timesteps.float() >= float(boundary)


def load_wan_transformer(model_path, *, dtype: torch.dtype | None = None):
    """WanTransformer3DModel from `<model_path>/transformer`, local files only, eval mode; raises
    ModelFilesError when the weight files do not fill the config. A two-expert directory
    (read_boundary_ratio) gives a WanExperts of both DiTs (transformer_2 checked the same way).

    With a `dtype`, every parameter is in it: diffusers keeps the time embedder, the norms and the
    modulation tables in fp32 when loading in bf16 (`_keep_in_fp32_modules`), but the actor's FSDP2
    computes every parameter in --fsdp-param-dtype, and the engine (which loads through here too)
    must compute what the replay recomputes."""
    from diffusers import WanTransformer3DModel

    path = check_model_dir(model_path, ("transformer",))
    model = _uniform_dtype(load_checked_transformer(WanTransformer3DModel, path, dtype), dtype)
    ratio = read_boundary_ratio(path)
    if ratio is None:
        return model
    from trainer.sampling import load_scheduler_config

    low = _uniform_dtype(load_checked_transformer(WanTransformer3DModel, path, dtype, subfolder=WAN_SECOND_EXPERT),
                         dtype)
    return WanExperts(model, low, ratio, expert_boundary(ratio, load_scheduler_config(str(path)))).eval()


def vae_scale_factor_from_config(vae_config) -> int:
    """Spatial compression of an AutoencoderKLWan: its config's scale_factor_spatial (8), WanPipeline's
    rule, else 2 ** len(temperal_downsample) for a config written before that key existed."""
    value = vae_config.get("scale_factor_spatial") if hasattr(vae_config, "get") else None
    if value is None:
        value = 2 ** len(vae_config["temperal_downsample"])
    return int(value)


def vae_temporal_factor_from_config(vae_config) -> int:
    """Temporal compression of an AutoencoderKLWan: scale_factor_temporal (4), else 2 ** (levels
    that halve time)."""
    value = vae_config.get("scale_factor_temporal") if hasattr(vae_config, "get") else None
    if value is None:
        value = 2 ** sum(bool(v) for v in vae_config["temperal_downsample"])
    return int(value)


def unipc_flow_sigmas(scheduler_config: dict, num_inference_steps: int) -> list[float]:
    """The N + 1 sigmas (terminal 0 included) of UniPCMultistepScheduler.set_timesteps(N) with
    use_flow_sigmas (the scheduler the published Wan2.1 Diffusers checkpoints ship):
    s = linspace(1, 1/T, N + 1)[:-1] in float64, the static flow shift
    shift * s / (1 + (shift - 1) * s), s[0] lowered by 1e-6 when it is 1 (the scheduler's guard
    against log(0)), then float32 and a terminal 0. FlowGRPO's Wan sampler reads these sigmas."""
    import numpy as np

    cfg = dict(scheduler_config)
    if not cfg.get("use_flow_sigmas", False):
        raise ValueError("scheduler/scheduler_config.json is a UniPCMultistepScheduler without use_flow_sigmas: not a "
                         "flow-matching schedule this sampler can run; use the Wan2.1 Diffusers checkpoint's scheduler")
    if cfg.get("use_dynamic_shifting") or cfg.get("shift_terminal") or cfg.get("final_sigmas_type", "zero") != "zero":
        raise ValueError("scheduler/scheduler_config.json sets use_dynamic_shifting / shift_terminal / a final sigma "
                         "other than zero, which this sampler does not implement")
    n = int(num_inference_steps)
    if n < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {n}")
    t_train = int(cfg.get("num_train_timesteps", 1000))
    shift = float(cfg.get("flow_shift", 1.0))
    s = np.linspace(1, 1 / t_train, n + 1)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    if abs(s[0] - 1) < 1e-6:
        s[0] -= 1e-6
    return [float(v) for v in s.astype(np.float32)] + [0.0]


def wan_sigma_schedule(scheduler_config: dict, num_inference_steps: int) -> list[float]:
    """WanPipeline's sigmas for the directory's scheduler: the UniPC flow sigmas of the published
    checkpoints (unipc_flow_sigmas), or FlowMatchEulerDiscreteScheduler.set_timesteps(N) without
    sigmas (sampling.scheduler_sigma_schedule; the static shift needs no sequence length)."""
    from trainer.sampling import scheduler_sigma_schedule

    if scheduler_config.get("_class_name") == "UniPCMultistepScheduler":
        return unipc_flow_sigmas(scheduler_config, num_inference_steps)
    return scheduler_sigma_schedule(scheduler_config, num_inference_steps, 0)


# ----------------------------------------------------------------------------- the DiT call


def dit_velocity(transformer, latents: torch.Tensor, timesteps: torch.Tensor,
                 prompt_embeds: torch.Tensor) -> torch.Tensor:
    """Velocity [B, C, F', H', W'] of the Wan DiT, called as WanPipeline calls it: latents in the
    dtype the module computes in, the fp32 scheduler timesteps [B] as they are (the DiT embeds
    them in its fp32 time embedder), prompt_embeds [B, T, D] cast to the latents' dtype. A plain
    forward call: works for the bare module, a peft-injected one and an FSDP2-sharded one."""
    out = transformer(hidden_states=latents, timestep=timesteps.to(latents.device),
                      encoder_hidden_states=prompt_embeds.to(device=latents.device, dtype=latents.dtype),
                      return_dict=False)
    return out[0] if isinstance(out, (tuple, list)) else out.sample


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, guidance_scale: float | torch.Tensor) -> torch.Tensor:
    """v = v_uncond + g * (v_cond - v_uncond), WanPipeline's guidance (no rescale); g a float or a
    per-row tensor broadcastable to the velocity."""
    g = guidance_scale if isinstance(guidance_scale, torch.Tensor) else float(guidance_scale)
    return uncond + g * (cond - uncond)


def row_guidance(t: torch.Tensor, guidance_scale: float, guidance_scale_2: float | None,
                 boundary: float | None) -> float | torch.Tensor:
    """The CFG scale of every row: guidance_scale for the high-noise expert's rows and
    guidance_scale_2 (guidance_scale when None) for the low-noise expert's (WanPipeline's
    current_guidance_scale). A float when every row has the same one (the one-DiT case and every
    sampler step), else a [B] fp32 tensor."""
    g2 = float(guidance_scale if guidance_scale_2 is None else guidance_scale_2)
    if boundary is None or g2 == float(guidance_scale):
        return float(guidance_scale)
    high = pick_experts(t, boundary)
    if bool(high.all()) or not bool(high.any()):
        return float(guidance_scale) if bool(high.all()) else g2
    return torch.where(high, float(guidance_scale), g2)


def conditioned_velocity(transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor], *,
                         guidance_scale: float = 1.0, guidance_scale_2: float | None = None) -> torch.Tensor:
    """The engine's and the replay's one velocity call: dit_velocity at guidance 1, else true CFG
    in ONE forward of 2B rows (unconditional first), then cfg_combine. WanPipeline runs the two
    branches as two forwards; every row is independent in the DiT, so the result is the same up
    to the GEMM's batch-size-dependent rounding. Gradients reach the policy through both rows.
    As in WanPipeline, CFG runs when guidance_scale > 1; a WanExperts transformer then combines
    the low-noise expert's rows at guidance_scale_2 (row_guidance)."""
    pos, neg = split_negative(conditions)
    if float(guidance_scale) <= 1.0:
        return dit_velocity(transformer, x, t, pos["prompt_embeds"])
    b = int(x.shape[0])
    embeds = pos["prompt_embeds"]
    both = dit_velocity(transformer, torch.cat([x, x]), torch.cat([t, t]),
                        torch.cat([neg["prompt_embeds"].to(embeds.device, embeds.dtype), embeds]))
    g = row_guidance(t, guidance_scale, guidance_scale_2, getattr(transformer, "boundary", None))
    if isinstance(g, torch.Tensor):
        g = g.to(device=both.device, dtype=both.dtype).view(b, *([1] * (both.dim() - 1)))
    return cfg_combine(both[:b], both[b:], g)


def check_expert_boundary(transformer, sampler: SamplerSettings) -> None:
    """Raise ValueError unless the trajectory's recorded expert boundary (sampler.expert_boundary)
    is the transformer's (WanExperts.boundary; None for one DiT): a replay must pick each column's
    expert as the sampler did, and guidance_scale_2 exists only with two experts."""
    have = getattr(transformer, "boundary", None)
    want = getattr(sampler, "expert_boundary", None)
    if (have is None) != (want is None) or (have is not None and float(have) != float(want)):
        raise ValueError(f"the trajectory was sampled with expert boundary {want} (timestep where Wan2.2 switches "
                         f"experts; None: one DiT) but this transformer's is {have}: replay it with the --model-path "
                         "it was sampled from")
    if have is None and getattr(sampler, "guidance_scale_2", None) is not None:
        raise ValueError("--sampling-config guidance_scale_2 is set, but --model-path has one DiT: it is the "
                         "low-noise expert's scale of a two-expert (Wan2.2 A14B) model; remove it")


class WanAdapter(FamilyAdapter):
    """The Wan2.1 text-to-video family (trainer/models/base.py: FamilyAdapter holds the shared part)."""

    family = "wan"
    lora_target_modules = WAN_LORA_TARGETS
    max_sequence_length = WAN_MAX_SEQUENCE_LENGTH
    rollout_subfolders = WAN_SUBFOLDERS
    #: tools/sample.py's geometry when none is given: FlowGRPO's Wan recipe (33 x 240 x 416,
    #: 20 steps, CFG 4.5 with the empty negative prompt)
    sampling_defaults = {"height": 240, "width": 416, "num_frames": 33, "num_inference_steps": 20,
                         "guidance_scale": 4.5, "negative_prompt": "", "cfg_renorm": False, "eta": 1.0,
                         "sde_type": "wan", "sde_indices": [0]}
    #: the generation task this family trains (its runs' and tools' task)
    generation_task = "t2v"

    load_transformer = staticmethod(load_wan_transformer)
    vae_scale_factor_from_config = staticmethod(vae_scale_factor_from_config)
    #: the loaded model's expert boundary (WanExperts.boundary; None: one DiT): what the requests
    #: this adapter builds record, set whenever it loads a transformer
    expert_boundary: float | None = None

    def load_train_model(self, model_path: str, *, dtype: Any = None, revision: str | None = None) -> Any:
        """FamilyAdapter.load_train_model, remembering the model's expert boundary."""
        model = super().load_train_model(model_path, dtype=dtype, revision=revision)
        self.expert_boundary = getattr(model, "boundary", None)
        return model

    @classmethod
    def geometry_bounds(cls, model_path) -> GeometryBounds:
        """Sizes are multiples of the VAE's spatial factor x the DiT's patch (16: WanPipeline's
        check_inputs); no size limit (3-D RoPE); the UMT5 window of 512 tokens. From vae/ and
        transformer/config.json."""
        vae, dit = read_config_json(model_path, "vae"), read_config_json(model_path, "transformer")
        vsf = vae_scale_factor_from_config(vae) if vae and ("scale_factor_spatial" in vae or
                                                             "temperal_downsample" in vae) else None
        patch = dit.get("patch_size") if dit else None
        ph = int(patch[1]) if isinstance(patch, list) and len(patch) == 3 else None
        known = vsf is not None and ph is not None
        return GeometryBounds(multiple=vsf * ph if known else None, max_sequence_length=WAN_MAX_SEQUENCE_LENGTH,
                              why_multiple=f"vae/config.json's spatial factor {vsf} x transformer/config.json's "
                                           f"patch_size {patch}")

    # -- loading --------------------------------------------------------------------------

    def load_rollout_modules(self, model_path, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """transformer and UMT5 encoder in `dtype`, the VAE in fp32 (as FlowGRPO's Wan training and
        diffusers' Wan examples keep it: its decode is where bf16 shows), the tokenizer and
        scheduler_config, from a local diffusers Wan directory; each module moved to `device`."""
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        from trainer.sampling import load_scheduler_config

        path = check_model_dir(model_path, self.rollout_subfolders)
        transformer = self.load_transformer(path, dtype=dtype).to(device)
        self.expert_boundary = getattr(transformer, "boundary", None)
        return {
            "scheduler_config": load_scheduler_config(str(path)),
            "transformer": transformer,
            "vae": AutoencoderKLWan.from_pretrained(str(path), subfolder="vae", dtype=torch.float32,
                                                    local_files_only=True).to(device),
            "text_encoder": UMT5EncoderModel.from_pretrained(str(path / "text_encoder"), dtype=dtype,
                                                             local_files_only=True).to(device),
            "tokenizer": AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True),
            "path": path,
        }

    # -- the engine's side -----------------------------------------------------------------

    def prompt_encoder(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict):
        """encode(prompts, device, max_sequence_length) -> {"prompt_embeds": [B, T, D]}:
        WanPipeline._get_t5_prompt_embeds (the prompt cleaned as there, UMT5 over the padded
        window, each row cut after its real tokens and zero-padded back to T). The pipeline object
        only lends that; it shares the engine's modules."""
        from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

        experts = ({"transformer": transformer.transformer, "transformer_2": transformer.transformer_2,
                    "boundary_ratio": transformer.boundary_ratio} if isinstance(transformer, WanExperts)
                   else {"transformer": transformer})
        pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                           scheduler=FlowMatchEulerDiscreteScheduler(), **experts)

        def encode(prompts: list[str], device: torch.device, max_sequence_length: int) -> dict[str, torch.Tensor]:
            embeds = pipe._get_t5_prompt_embeds(prompt=prompts, max_sequence_length=max_sequence_length,
                                                device=device, dtype=text_encoder.dtype)
            return {"prompt_embeds": embeds}

        encode.pipeline = pipe
        return encode

    def batch_conditions(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-candidate {"prompt_embeds": [T, D]} -> [B, T, D] (every prompt fills the same window)."""
        shapes = {tuple(r["prompt_embeds"].shape) for r in rows}
        if len(shapes) != 1:
            raise ValueError(f"Wan prompt_embeds of one batch have different shapes {sorted(shapes)}; the engine "
                             "must encode every prompt with one max_sequence_length")
        return {"prompt_embeds": torch.stack([r["prompt_embeds"] for r in rows])}

    def sigma_schedule(self, scheduler_config: dict, num_inference_steps: int, geometry: Geometry) -> list[float]:
        """WanPipeline's sigmas for the directory's scheduler (wan_sigma_schedule: static shift 3.0,
        so the geometry plays no part)."""
        return wan_sigma_schedule(scheduler_config, num_inference_steps)

    def latent_geometry(self, vae) -> tuple[int, int]:
        return vae_scale_factor_from_config(vae.config), int(vae.config.z_dim)

    def init_noise_shape(self, request: Any, latent_channels: int, vae_scale_factor: int) -> list[int]:
        """One candidate's x_T shape: init_noise_latent_shape when set, else [C, F', H / vsf, W / vsf]
        with F' = (num_frames - 1) // 4 + 1 (trainer.video.candidate_noise_shape, WanPipeline's
        prepare_latents without the batch)."""
        from trainer.video import candidate_noise_shape

        if request.init_noise_latent_shape is not None:
            return [int(v) for v in request.init_noise_latent_shape]
        return list(candidate_noise_shape(int(request.num_frames), int(request.height), int(request.width),
                                          channels=int(latent_channels), spatial=int(vae_scale_factor)))

    def initial_latents(self, x_t: torch.Tensor, transformer, geometry: Geometry) -> torch.Tensor:
        """x_T [B, C, F', H', W'] is already the DiT's layout; checked against the geometry and the
        DiT's in_channels."""
        want = [int(transformer.config.in_channels), *_latent_grid(geometry)]
        if list(x_t.shape[1:]) != want:
            raise ValueError(f"x_T shape {list(x_t.shape[1:])} does not fit {geometry.frames} x {geometry.height} x "
                             f"{geometry.width} on this model (expected {want}); fix --sampling-config "
                             "init_noise_latent_shape or num_frames/height/width")
        return x_t

    def velocity(self, transformer, x: torch.Tensor, t: torch.Tensor, conditions: dict[str, torch.Tensor],
                 geometry: Geometry, sampler: SamplerSettings, *, rollout_dtype: Any = None) -> torch.Tensor:
        """conditioned_velocity: the DiT called as WanPipeline calls it (the fp32 timestep as it is,
        so rollout_dtype plays no part), true CFG as that pipeline does it. cfg_renorm under CFG
        raises (build_rollout_request refuses it: WanPipeline has no rescale)."""
        refuse_cfg_renorm(sampler.guidance_scale, sampler.cfg_renorm, "WanPipeline")
        check_expert_boundary(transformer, sampler)
        return conditioned_velocity(transformer, x, t, conditions,
                                    guidance_scale=sampler.guidance_scale if sampler.guided else 1.0,
                                    guidance_scale_2=sampler.guidance_scale_2)

    def decode(self, vae, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Final latents [B, C, F', H', W'] -> videos [B, F, 3, H, W] float32 in [0, 1] on CPU (an
        image [B, 3, H, W] for a one-frame geometry), as WanPipeline decodes: z * latents_std +
        latents_mean per channel, the VAE's decode, then (x / 2 + 0.5) clamped."""
        cfg = vae.config
        z = latents.to(vae.dtype)
        shape = (1, int(cfg.z_dim), 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean).view(shape).to(z.device, z.dtype)
        # the pipeline's own arithmetic (a division by 1 / std), so the frames are its bits
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(shape).to(z.device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # [B, 3, F, H, W]
        video = (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).cpu().contiguous()
        return video[:, 0] if int(geometry.frames) == 1 else video

    # -- rollout --------------------------------------------------------------------------

    def build_rollout_request(self, prompt: str, *, group_index: int, slot: int, sample_id: str,
                              sampling: SamplingConfig, sde_indices: list[int], sigmas: list[float],
                              generation_seed: int, metadata: dict | None = None) -> RolloutRequest:
        """One candidate as an engine RolloutRequest (models.base.standard_rollout_request) after
        refusing an invalid video geometry (trainer.video.video_geometry_problems: num_frames 4k+1,
        sizes multiples of 16) and cfg_renorm under CFG, a rescale WanPipeline does not have."""
        from trainer.video import video_geometry_problems

        problems = video_geometry_problems(getattr(sampling, "num_frames", 1), sampling.height, sampling.width)
        if problems:
            raise ValueError("; ".join(problems))
        refuse_cfg_renorm(sampling.guidance_scale, sampling.cfg_renorm, "WanPipeline")
        g2 = getattr(sampling, "guidance_scale_2", None)
        if g2 is not None and self.expert_boundary is None:
            raise ValueError("--sampling-config guidance_scale_2 is set, but --model-path has one DiT: it is the "
                             "low-noise expert's scale of a two-expert (Wan2.2 A14B) model; remove it")
        if g2 is not None and float(sampling.guidance_scale) <= 1.0:
            raise ValueError(f"--sampling-config guidance_scale_2 is {g2} but guidance_scale is "
                             f"{sampling.guidance_scale}: WanPipeline runs CFG (for both experts) only when "
                             "guidance_scale > 1; set guidance_scale > 1 or remove guidance_scale_2")
        request = super().build_rollout_request(prompt, group_index=group_index, slot=slot, sample_id=sample_id,
                                                sampling=sampling, sde_indices=sde_indices, sigmas=sigmas,
                                                generation_seed=generation_seed, metadata=metadata)
        return dataclasses.replace(request, guidance_scale_2=None if g2 is None else float(g2),
                                   expert_boundary=self.expert_boundary)

    def check_trajectory(self, traj: Trajectory, who: str) -> None:
        """Raise ValueError unless the latents are unpacked [B, S, C, F', H', W'] of the geometry."""
        lat = traj.latents
        grid = _latent_grid(traj.geometry)
        if lat.dim() != 6 or list(lat.shape[3:]) != grid:
            raise ValueError(f"trajectory of {who}: latents {tuple(lat.shape)} must be "
                             f"[B, S, C, {', '.join(map(str, grid))}] for {traj.geometry.frames} frames of {traj.height}x{traj.width} at vae_scale_factor "
                             f"{traj.vae_scale_factor}")


def _uniform_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    """Every floating parameter of `model` in `dtype` (None: as loaded), as FSDP2's param_dtype
    gathers them; buffers (the RoPE tables) stay as they are, as FSDP2 leaves them. Through the
    tensors, not Module.to, whose diffusers override warns about the fp32-kept modules it casts."""
    if dtype is not None:
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def _latent_grid(geometry: Geometry) -> list[int]:
    """[F', H', W'] of a geometry: (frames - 1) // 4 + 1 latent frames, H / vsf, W / vsf."""
    from trainer.video import latent_frames

    vsf = int(geometry.vae_scale_factor)
    return [latent_frames(int(geometry.frames)), int(geometry.height) // vsf, int(geometry.width) // vsf]
