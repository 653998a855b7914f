"""The native rollout engine: an in-process pipeline built on diffusers components plus our own
SDE sampler (trainer/flow_grpo.py). The family's parts (modules, prompt encoding, latent layout,
velocity call, decode) come from the model adapter it is given; Qwen-Image's by default.

What one `generate` call does:

1. encodes every distinct prompt once (alone, so a prompt's conditioning never depends on
   which other prompts share the rollout), with the adapter's prompt encoder: a dict of named
   condition tensors per prompt;
2. runs the DiT on up to `max_batch_size` candidates of several prompts per forward (all the
   candidates of a call share one sampling geometry: size, schedule, trained steps, SDE settings), the
   conditions batched by the adapter (Qwen-Image: zero-padded to the chunk's longest prompt with its
   mask; its velocity call trims padding shared by every row and passes no all-ones mask, so SDPA can
   use flash);
3. per candidate, draws x_T and each trained step's noise on CPU from its seed recipe
   (trainer/sampling.py), so the randomness of a candidate is bit-identical in any batch, on
   any rank or device;
4. takes the SDE step (sde / dance) at the trained steps and the ODE (Euler) step elsewhere,
   recording per trained step the packed latents before / after (in the compute dtype), the
   sigma pair, the timestep and the log-prob (fp32);
5. decodes the final latents with the VAE into float [3, H, W] images in [0, 1] on CPU, and
   returns everything as one trainer.trajectory.Trajectory, rows in request order.

Batching is exact in the noise and in the math, but not bit-exact in the floats: on these CPUs
(MKL) a GEMM's rounding depends on its row count, and the attention's on the padded text
length, so a candidate alone and inside a mixed batch differ by ~1e-7 in a DiT output
(tests/test_engine.py measures it). Training never depends on that: the actor replays the
recorded latents.

Weights arrive as in-process tensors (`update_weights_from_tensors`, `set_lora_tensors`),
verified against a manifest before anything is copied; `commit_weight_version` labels them.
`release_memory` / `resume_memory` move modules to pinned host memory and back on CUDA; on CPU
they are bookkeeping, still verified.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from trainer.core.checksum import weights_checksum
from trainer.core.dtypes import engine_dtype
from trainer.core.manifest import build_manifest, verify_manifest
from trainer.core.modules import ModuleTreeSnapshot, compiled_graphs, model_has_lora
from trainer.core.names import is_lora_name, strip_wrapper_segments
from trainer.host_arena import HostArena, typed_view
from trainer.models.base import with_negative
from trainer.trajectory import Geometry
from trainer.engine.base import (ENGINE_MODULES, EngineCapabilities, EngineMemoryState, RolloutRequest,
                                 WeightManifest, WeightSyncError, Trajectory, check_names_shapes, check_one_geometry,
                                 check_request, embedded_guidance_condition, rollout_trajectory)

log = logging.getLogger(__name__)

#: distinct prompts per text-encoder call of a rollout (NativeEngine.encode_prompts)
PROMPT_BATCH = 16

def _default_adapter(adapter: Any) -> Any:
    """The adapter given, or an instance of the default family's (by its dotpath, so this module
    names no family)."""
    if adapter is not None:
        return adapter
    from trainer.config import DEFAULT_MODEL_ADAPTER
    from trainer.dotpath import import_dotpath

    return import_dotpath(DEFAULT_MODEL_ADAPTER, "the default model adapter")()


def _resolve_device(device) -> torch.device:
    """torch.device(device), or cuda when available else cpu for None."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class NativeEngine(EngineMemoryState):
    """In-process rollout engine (implements trainer.engine.base.RolloutEngine), generic over
    model families: what is the family's (its modules, prompt encoding, latent layout, velocity
    call, decode, LoRA targets) comes from the model adapter; the sampling loop is this file's.

    model_path: local diffusers directory of the adapter's family (nothing is downloaded).
    adapter: the model adapter (trainer/models/base.py); None: the default family's
      (config.DEFAULT_MODEL_ADAPTER, Qwen-Image).
    device: where the pipeline runs (default: cuda if available, else cpu); under torchrun pass
      the rank's own device.
    dtype: compute dtype of every module (default bf16 on CUDA, fp32 on CPU).
    max_batch_size: candidates per DiT forward / VAE decode; <= 0 means all candidates of a
      geometry at once.
    max_sequence_length: text tokens the prompt encoder keeps; None: the adapter's own
      (`max_sequence_length`; Qwen-Image's 512 window after the template prefix).
    compile_blocks: torch.compile each repeated DiT block (regional compilation; a static graph
      first, then one with the text length and batch dynamic once they vary, reused by every
      later rollout whatever its prompts' lengths; `last_stats["new_graphs"]` counts graphs
      compiled during a call). Off by default: it pays on a GPU, not on CPU.
    precision: "default" (every module in `dtype`) or "fp8": the DiT blocks' linear layers run
      as FP8 GEMMs (trainer/core/fp8.py), re-quantized after every weight sync. Once LoRA
      adapters are installed the base can no longer change (a full or merged sync is refused),
      so their weights in `dtype` are freed and only the FP8 copies stay: about half the DiT's
      memory in bf16 (`fp8_weights_dropped` counts the layers).
    fp8_fast_accum: the FP8 GEMMs with fast accumulation (--fp8-fast-accum, core.fp8.fp8_linear);
      only with precision "fp8".
    """

    #: every family, true CFG, every sde_type, compiled blocks and FP8 GEMMs
    capabilities = EngineCapabilities(name="the native engine")

    def __init__(self, model_path, *, device=None, dtype=None, max_batch_size: int = 0,
                 max_sequence_length: int | None = None, revision: str | None = None, adapter: Any = None,
                 compile_blocks: bool = False, precision: str = "default", fp8_fast_accum: bool = False):
        self.adapter = _default_adapter(adapter)
        dev = _resolve_device(device)
        dt = engine_dtype(dtype, dev)
        m = self.adapter.load_rollout_modules(model_path, dtype=dt, device=dev)
        self._set_up(m["transformer"], m["vae"], m["text_encoder"], m["tokenizer"], m["scheduler_config"],
                     device=dev, dtype=dt, max_batch_size=max_batch_size, max_sequence_length=max_sequence_length,
                     cast=False, compile_blocks=compile_blocks, precision=precision, fp8_fast_accum=fp8_fast_accum)
        self.model_path = str(m.get("path", model_path))
        self.revision = revision

    @classmethod
    def from_modules(cls, transformer, vae, text_encoder, tokenizer, scheduler_config: dict, *, device=None,
                     dtype=None, max_batch_size: int = 0, max_sequence_length: int | None = None,
                     adapter: Any = None, compile_blocks: bool = False,
                     precision: str = "default", fp8_fast_accum: bool = False) -> "NativeEngine":
        """An engine over modules already in memory (nothing is read from disk): the adapter's
        family's DiT, VAE, text encoder (one module; an nn.ModuleDict for several), tokenizer(s)
        and the scheduler config dict, as its load_rollout_modules returns them (Qwen-Image:
        QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2_5_VLForConditionalGeneration,
        a Qwen2 tokenizer). The modules are moved to `device` and cast to `dtype` in place (the
        engine owns them from then on); defaults as in __init__."""
        engine = cls.__new__(cls)
        engine.adapter = _default_adapter(adapter)
        dev = _resolve_device(device)
        engine._set_up(transformer, vae, text_encoder, tokenizer, dict(scheduler_config), device=dev,
                       dtype=engine_dtype(dtype, dev), max_batch_size=max_batch_size,
                       max_sequence_length=max_sequence_length, cast=True, compile_blocks=compile_blocks,
                       precision=precision, fp8_fast_accum=fp8_fast_accum)
        engine.model_path = "<in-memory modules>"
        engine.revision = None
        return engine

    def _set_up(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict, *, device: torch.device,
                dtype: torch.dtype, max_batch_size: int, max_sequence_length: int | None, cast: bool,
                compile_blocks: bool = False, precision: str = "default", fp8_fast_accum: bool = False) -> None:
        """Everything after loading: placement, frozen eval modules, the prompt-encoding pipeline,
        derived constants, state. cast: also cast the modules to `dtype` (loaders already did)."""
        self.device = device
        self.dtype = dtype
        self.max_batch_size = int(max_batch_size)
        self.max_sequence_length = int(max_sequence_length if max_sequence_length is not None
                                       else getattr(self.adapter, "max_sequence_length", 512))
        self.scheduler_config = scheduler_config
        for name, module in (("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)):
            module = module.to(device=self.device, dtype=self.dtype) if cast else module.to(self.device)
            setattr(self, name, module.eval())
        self.tokenizer = tokenizer
        for module in (self.transformer, self.vae, self.text_encoder):
            module.requires_grad_(False)

        #: the family's encode(prompts, device, max_sequence_length) (the adapter's prompt_encoder)
        self.prompt_encoder = self.adapter.prompt_encoder(self.transformer, self.vae, self.text_encoder, self.tokenizer,
                                                         self.scheduler_config)
        self.vae_scale_factor, self.latent_channels = self.adapter.latent_geometry(self.vae)
        self.num_train_timesteps = int(self.scheduler_config.get("num_train_timesteps", 1000))
        self.policy_version = 0
        self._resident = {name: True for name in ENGINE_MODULES}
        #: module name -> the host buffer its tensors go to when released (trainer.host_arena)
        self._host_arenas: dict[str, HostArena] = {}
        self._lora_config: dict[str, Any] | None = None
        self.last_stats: dict[str, float] = {}
        #: the source files of the last generate call (path -> edit_source.Source, each read once):
        #: what the loop hands the scorers, so they see the pixels the model was conditioned on
        #: without reading the files again
        self.last_sources: dict[str, Any] = {}
        #: the DiT's name -> parameter index, see _weight_index
        self._weights_index: _WeightIndex | None = None
        #: the speed options in force (enable_speedups adds them, never takes them away)
        self.precision, self.compile_blocks, self.fp8_fast_accum = "default", False, False
        #: id(weight parameter) -> its FP8Linear, to re-quantize exactly the layers a sync wrote
        self._fp8_of_weight: dict[int, Any] = {}
        #: FP8 layers whose weight in `dtype` was freed when LoRA came in (only their FP8 copy stays)
        self.fp8_weights_dropped = 0
        self.enable_speedups(compile_blocks, precision, fp8_fast_accum)

    def enable_speedups(self, compile_blocks: bool = False, precision: str = "default",
                        fp8_fast_accum: bool = False) -> None:
        """FP8 linears (precision "fp8", their GEMMs with fast accumulation under fp8_fast_accum)
        and regional compilation of the DiT's repeated blocks (see the class docstring); called by
        the constructor. All are one-way: a later call can add them, not take them away. FP8 goes
        first, so the compiled graphs hold the FP8 GEMMs and fuse the activation quantization into
        the surrounding kernels."""
        from trainer.core.fp8 import FP8Linear, convert_to_fp8, set_fp8_fast_accum
        from trainer.core.modules import REGIONAL_COMPILE_KWARGS, raise_recompile_limit, repeated_blocks

        if precision not in ("default", "fp8"):
            raise ValueError(f"precision must be 'default' or 'fp8' (--rollout-precision), got {precision!r}")
        if fp8_fast_accum and "fp8" not in (precision, self.precision):
            raise ValueError("fp8_fast_accum (--fp8-fast-accum) sets how FP8 GEMMs accumulate: it needs precision "
                             "'fp8' (--rollout-precision fp8)")
        blocks = repeated_blocks(self.transformer)
        if precision == "fp8" and self.precision != "fp8":
            if model_has_lora(self.transformer):
                raise ValueError("FP8 conversion after LoRA was installed would quantize the adapter too; "
                                 "enable precision 'fp8' when the engine is built")
            self.precision = "fp8"
            for block in blocks:
                convert_to_fp8(block)
            self._fp8_of_weight = {id(m.weight): m for m in self.transformer.modules() if isinstance(m, FP8Linear)}
        if fp8_fast_accum and not self.fp8_fast_accum:
            self.fp8_fast_accum = True
            for block in blocks:
                set_fp8_fast_accum(block, True)
        if compile_blocks and not self.compile_blocks:
            self.compile_blocks = True
            raise_recompile_limit()  # static + dynamic graphs, masked or not, one more set once LoRA is in
            prepare_family = getattr(self.adapter, "prepare_block_compile", None)
            if prepare_family is not None:
                prepare_family()
            for block in blocks:
                block.compile(**REGIONAL_COMPILE_KWARGS)

    # ------------------------------------------------------------------ generation

    def sigma_schedule(self, height: int, width: int, num_inference_steps: int) -> list[float]:
        """The driver's N + 1 sigmas for this model's scheduler config at height x width (the
        adapter's sigma_schedule: its pipeline's own rule)."""
        return self.adapter.sigma_schedule(self.scheduler_config, num_inference_steps,
                                           Geometry(int(height), int(width), self.vae_scale_factor))

    @torch.no_grad()
    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        """The conditioning of one prompt on the device: the adapter's condition tensors, row 0
        (no batch dimension), floating ones in the engine dtype (Qwen-Image: prompt_embeds [T, D],
        prompt_embeds_mask [T] int64)."""
        return self.encode_prompts([prompt])[prompt]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """encode_prompt of each distinct prompt, PROMPT_BATCH of them per text-encoder call (the
        adapter's split_prompt_batch cuts the call's rows back to what a prompt alone gives): one
        forward instead of one a prompt, whose launches dominate a short prompt's encoding. A
        prompt's values depend on its batch by summation order only."""
        distinct = list(dict.fromkeys(prompts))
        out: dict[str, dict[str, torch.Tensor]] = {}
        for start in range(0, len(distinct), PROMPT_BATCH):
            chunk = distinct[start:start + PROMPT_BATCH]
            encoded = self.prompt_encoder(chunk, self.device, self.max_sequence_length)
            for prompt, row in zip(chunk, self.adapter.split_prompt_batch(encoded), strict=True):
                out[prompt] = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in row.items()}
        return out

    @torch.no_grad()
    def generate(self, requests: list[RolloutRequest]) -> Trajectory | None:
        """Generate every request (one geometry); one Trajectory, rows in request order, or None
        for no request (see the protocol).

        Tensors are on CPU: images [B, 3, H, W] float32 in [0, 1]; latents / next_latents
        [B, S, L, C] in the engine dtype; sigmas / sigmas_next / timesteps / log_probs [B, S] fp32;
        conditions: the adapter's batch_conditions of each candidate's prompt (Qwen-Image:
        "prompt_embeds" [B, T, D] and "prompt_embeds_mask" [B, T] int64), plus the negative
        prompt's under "negative_<name>" with true CFG.
        """
        self._require_resident(ENGINE_MODULES, "generate")
        if not requests:
            return None
        for r in requests:
            check_request(r)
        check_one_geometry(requests)
        t0 = time.perf_counter()
        conds, keys, neg_keys, n_sources = self._encode_conditions(requests)
        split = {"encode_time": self._clock() - t0, "denoise_time": 0.0, "decode_time": 0.0}
        step = self.max_batch_size if self.max_batch_size > 0 else len(requests)
        graphs = compiled_graphs() if self.compile_blocks else 0
        parts = [self._generate_chunk(requests[start:start + step], conds, keys[start:start + step],
                                      neg_keys[start:start + step], split) for start in range(0, len(requests), step)]
        self.last_stats = {"candidates": float(len(requests)), "prompts_encoded": float(len(conds)),
                           "sources_encoded": float(n_sources),
                           "dit_forwards": float(len(parts) * requests[0].num_inference_steps),
                           "generate_time": time.perf_counter() - t0, **split}
        if self.compile_blocks:
            self.last_stats["new_graphs"] = float(compiled_graphs() - graphs)
        return Trajectory.cat(parts)

    def _clock(self) -> float:
        """time.perf_counter() once the device has done the work queued so far: the split of a
        generate call into encode / denoise / decode (`last_stats`) counts each part's own device
        time. The waits sit where the rollout waits anyway (the decoded images go to the host)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _encode_conditions(self, requests: list[RolloutRequest]) -> tuple[dict, list, list, int]:
        """(conditions by key, each request's key, each request's negative key under true CFG else
        None, the number of distinct sources VAE-encoded): every distinct condition encoded once per
        call. A text-only request's key is its prompt string (the negative prompt is then one
        condition per call), and those are encoded together after the others (encode_prompts);
        an editing request's is core.media_key's ConditionKey over prompt AND
        source content AND size, so two sources under one instruction are two conditions, a
        group's candidates share one, and the negative condition (which sees the source too) is
        one per source. Each source file is read once per call (edit_source.load_source): its key
        and its pixels come from one read; and the VAE encodes each distinct source once per call,
        the instruction's and the negative's conditions sharing its latents (only the text / VL
        encoder runs per prompt)."""
        conds: dict[Any, dict[str, torch.Tensor]] = {}
        loaded: dict[str, Any] = {}
        latents: dict[Any, dict[str, torch.Tensor]] = {}  # encode_source's, by (source keys, size)
        texts: list[str] = []  # the text-only conditions, encoded together after the loop
        guided = requests[0].guidance_scale > 1
        keys, neg_keys = [], []
        self.last_sources = loaded
        for r in requests:
            sources = self._load_sources(r, loaded)
            for prompt, out in ((r.prompt, keys), (r.negative_prompt if guided else None, neg_keys)):
                if prompt is None:
                    out.append(None)
                    continue
                key = self._condition_key(prompt, r, sources)
                if not sources:
                    texts.append(prompt)  # its key is the prompt itself
                elif key not in conds:
                    conds[key] = self._encode_with_sources(prompt, sources, (int(r.height), int(r.width)), latents)
                out.append(key)
        conds.update(self.encode_prompts(texts))
        return conds, keys, neg_keys, len(latents)

    def _load_sources(self, r: RolloutRequest, loaded: dict[str, Any]) -> list:
        """The request's sources (edit_source.Source), each file read at most once into `loaded`."""
        from trainer.models.edit_source import load_source

        if r.media:
            self._edit_encoder()  # a text family refuses sources before any file is read
        out = []
        for path in r.media:
            if path not in loaded:
                try:
                    loaded[path] = load_source(path)
                except FileNotFoundError as e:
                    raise FileNotFoundError(f"request {r.sample_id}: {e}") from None
            out.append(loaded[path])
        return out

    @staticmethod
    def _condition_key(prompt: str, r: RolloutRequest, sources: list) -> Any:
        if not sources:
            return prompt
        from trainer.core.media_key import condition_key

        return condition_key(prompt, [s.key for s in sources], (int(r.height), int(r.width)))

    @torch.no_grad()
    def encode_condition(self, prompt: str, media: list[str], size: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The conditioning of one prompt shown the source image files `media`, resized for a
        size = (height, width) output: the adapter's `encode_condition` (an editing family's),
        row 0, floating tensors in the engine dtype. ValueError naming the adapter when its
        family takes no source images."""
        from trainer.models.edit_source import load_source

        encode = self._edit_encoder()
        images = [load_source(p).image for p in media]
        return self._row(encode(self.prompt_encoder, prompt, images, size, self.device,
                                max_sequence_length=self.max_sequence_length))

    def _edit_encoder(self):
        encode = getattr(self.adapter, "encode_condition", None)
        if encode is None:
            raise ValueError(f"{type(self.adapter).__name__} takes no source images (a text-to-image family); an "
                             "editing record (with images) needs an editing family's --model-path")
        return encode

    def _encode_with_sources(self, prompt: str, sources: list, size: tuple[int, int],
                             latents: dict) -> dict[str, torch.Tensor]:
        """The adapter's encode_instruction of `prompt` shown the sources, beside its
        encode_source latents, which are encoded once per distinct (sources, size) into `latents`
        (the generate call's) and are the same tensors in every condition that shows them;
        _load_sources has checked that the family takes sources."""
        images = [s.image for s in sources]
        which = (tuple(s.key for s in sources), tuple(size))
        if which not in latents:
            latents[which] = self._row(self.adapter.encode_source(self.prompt_encoder, images, size, self.device))
        text = self._row(self.adapter.encode_instruction(self.prompt_encoder, prompt, images, self.device,
                                                         max_sequence_length=self.max_sequence_length))
        return {**text, **latents[which]}

    def _row(self, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Row 0 of each encoded tensor, floating ones in the engine dtype."""
        return {k: (v[0].to(self.dtype) if v.is_floating_point() else v[0]) for k, v in encoded.items()}

    def noise_shape(self, r: RolloutRequest) -> list[int]:
        """The initial noise's shape for one candidate of `r` (without the batch dimension): the
        family adapter's own rule where it has one (a video's [C, F', h, w]), else the image
        latent's [C, h, w] at r's size."""
        from trainer.sampling import init_noise_shape

        family_shape = getattr(self.adapter, "init_noise_shape", None)  # a video family's [C, F', h, w]
        if family_shape is not None:
            return family_shape(r, self.latent_channels, self.vae_scale_factor)
        return init_noise_shape(r, self.latent_channels, self.vae_scale_factor)

    def _generate_chunk(self, reqs: list[RolloutRequest], conds, keys: list, neg_keys: list,
                        split: dict[str, float] | None = None) -> Trajectory:
        """Denoise and decode candidates of one geometry together; the seconds of each part are
        added to `split`'s denoise_time / decode_time when given."""
        from trainer.flow_grpo import ode_step, sde_step
        from trainer.sampling import initial_noise, step_noise, timesteps_from_sigmas

        r0 = reqs[0]
        b = len(reqs)
        geom, sampler = r0.geometry(self.vae_scale_factor), r0.sampler_settings()
        shape = self.noise_shape(r0)
        x_t = torch.stack([initial_noise(shape, r.generation_seed, r.sample_id) for r in reqs])
        x = self.adapter.initial_latents(x_t, self.transformer, geom).to(device=self.device, dtype=self.dtype)
        conditions = self.adapter.batch_conditions([conds[k] for k in keys])
        conditions.update(embedded_guidance_condition(r0, b, self.device))  # a guidance-distilled DiT's input
        sigmas = [float(s) for s in r0.sigmas]
        timesteps = timesteps_from_sigmas(sigmas[:-1], self.num_train_timesteps)
        trained = set(int(i) for i in r0.sde_indices)
        if sampler.guided:
            negative = self.adapter.batch_conditions([conds[k] for k in neg_keys])
            # what both branches share (an edit's source latents) is recorded once, unprefixed
            shared = getattr(self.adapter, "shared_conditions", ())
            conditions = with_negative(conditions, {k: v for k, v in negative.items() if k not in shared})
        lat, nxt, logps = [], [], []
        t_denoise = self._clock()
        for i in range(r0.num_inference_steps):
            t = torch.full((b,), timesteps[i], dtype=torch.float32)
            v = self.adapter.velocity(self.transformer, x, t, conditions, geom, sampler)  # the replay's call too
            if i in trained:
                noise = torch.stack([step_noise(x.shape[1:], r.generation_seed, r.sample_id, i) for r in reqs])
                s = torch.full((b,), sigmas[i], dtype=torch.float32, device=self.device)
                s_next = torch.full((b,), sigmas[i + 1], dtype=torch.float32, device=self.device)
                x_next, logp = sde_step(x, v, s, s_next, r0.eta, noise.to(self.device), r0.sde_type, r0.sigma_max,
                                        out_dtype=self.dtype)
                lat.append(x.cpu())
                nxt.append(x_next.cpu())
                logps.append(logp.float().cpu())
                x = x_next
            else:
                x = ode_step(x, v, sigmas[i], sigmas[i + 1]).to(self.dtype)
        t_decode = self._clock()
        images = self.adapter.decode(self.vae, x, geom)
        t_done = self._clock()
        if split is not None:
            split["denoise_time"] += t_decode - t_denoise
            split["decode_time"] += t_done - t_decode

        steps = sorted(trained)
        sig = torch.tensor([sigmas[i] for i in steps], dtype=torch.float32)
        sig_next = torch.tensor([sigmas[i + 1] for i in steps], dtype=torch.float32)
        ts = torch.tensor([timesteps[i] for i in steps], dtype=torch.float32)
        return rollout_trajectory(
            reqs, images=images, latents=torch.stack(lat, 1), next_latents=torch.stack(nxt, 1), sigmas=sig,
            sigmas_next=sig_next, timesteps=ts, log_probs=torch.stack(logps, 1), sde_indices=steps,
            conditions=conditions, vae_scale_factor=self.vae_scale_factor,
            policy_version=self.policy_version)

    # ------------------------------------------------------------------ weights

    def holds_lora(self) -> bool:
        """True once LoRA layers are in the engine's transformer (the DiT's structure is re-checked)."""
        return self._weight_index(None).holds_lora

    def _weight_index(self, version: int | None) -> _WeightIndex:
        """The DiT's stripped diffusers name -> parameter index (and its LoRA part), rebuilt only when
        the DiT's structure changed.

        A named walk costs milliseconds at the real DiT size. The index keeps a ModuleTreeSnapshot
        of the transformer and is rebuilt when that changed (LoRA injected here, by load_lora_dir or
        by anyone else; a module or parameter object replaced); release/resume_memory swap .data and
        keep the objects, so the index stays. The snapshot check itself is ~1 us per module, so it
        runs once per sync version: the buckets of one version (their manifests carry it) reuse the
        index unchecked (the syncer's holds_lora() look before a full/merged sync checks); version
        None always checks."""
        cached = self._weights_index
        if cached is not None and version is not None and cached.version == version:
            return cached
        if cached is None or not cached.structure.unchanged(self.transformer):
            cached = _WeightIndex(self.transformer)
            self._weights_index = cached
        cached.version = version
        return cached

    def update_weights_from_tensors(self, named_tensors: list[tuple[str, Any]], manifest: WeightManifest) -> None:
        """Copy transformer tensors (diffusers names; all of them or one bucket of a sync) into
        the existing parameters. Everything is checked before anything is copied: the manifest
        (count / bytes / ordered name-shape hash), that the DiT holds no LoRA layers, that every
        name is known and every shape matches. Raises WeightSyncError naming the problem. The
        copy is one multi-tensor copy (dtype/device conversion included); the sent tensors are
        only read."""
        self._require_resident(("transformer",), "update_weights_from_tensors", WeightSyncError)
        index = self._weight_index(manifest.version)
        params = index.params
        if index.holds_lora:
            raise WeightSyncError(
                "full/merged weight sync into an engine whose transformer holds LoRA layers: the base weights "
                "are now *.base_layer.* and the adapter would keep its old values; use set_lora_tensors "
                "(--lora-adapter-mode) or a fresh engine, never both on one engine")
        verify_manifest(named_tensors, manifest)
        check_names_shapes(named_tensors, params, manifest.kind)
        dst = [params[n] for n, _ in named_tensors]
        _copy_into(dst, [t for _, t in named_tensors])
        for p in dst:  # FP8 copies follow their new weights (a LoRA sync leaves the base alone)
            layer = self._fp8_of_weight.get(id(p))
            if layer is not None:
                layer.requantize()


    def set_lora_tensors(self, named_tensors: list[tuple[str, Any]], manifest: WeightManifest,
                         lora_config: dict[str, Any]) -> None:
        """Install (first call: inject a peft LoRA with `lora_config` into the DiT) or replace the
        adapter tensors. Names are peft names without the adapter segment
        ("transformer_blocks.0.attn.to_q.lora_A.weight"); every LoRA tensor of the engine must be
        sent, with matching shapes. lora_config: rank (or r), alpha (or lora_alpha),
        target_modules (default: the adapter's eight attention projections)."""
        self._require_resident(("transformer",), "set_lora_tensors", WeightSyncError)
        verify_manifest(named_tensors, manifest)
        cfg = _normalize_lora_config(lora_config, self.adapter.lora_target_modules)
        if self._lora_config is None:
            if self.holds_lora():
                raise WeightSyncError("the engine's transformer already holds LoRA layers it did not install")
            self._inject_lora(cfg)
        elif cfg != self._lora_config:
            raise WeightSyncError(f"LoRA config {cfg} differs from the one installed in the engine "
                                  f"({self._lora_config}); rank, alpha and targets cannot change within a run")
        index = self._weight_index(None)  # one call per sync: always checked against the structure
        params = index.lora_params
        names = tuple(n for n, _ in named_tensors)
        if names == index.lora_names_checked:
            # the very names of an earlier accepted adapter sync into this index: known, distinct,
            # complete; only the shapes can differ
            dst = [params[n] for n in names]
            if any(t.shape != p.shape for (_, t), p in zip(named_tensors, dst)):
                check_names_shapes(named_tensors, params, "adapter")  # raises, with the usual message
        else:
            check_names_shapes(named_tensors, params, "adapter")
            missing = sorted(set(params) - set(names))
            if missing:
                raise WeightSyncError(f"adapter sync lacks {len(missing)} of the engine's {len(params)} LoRA "
                                      f"tensors, e.g. {missing[:3]}; every adapter tensor must be sent")
            index.lora_names_checked = names
            dst = [params[n] for n in names]
        _copy_into(dst, [t for _, t in named_tensors])

    def _inject_lora(self, cfg: dict[str, Any]) -> None:
        from peft import LoraConfig

        self.transformer.add_adapter(LoraConfig(r=cfg["rank"], lora_alpha=cfg["alpha"],
                                                target_modules=list(cfg["target_modules"]), lora_dropout=0.0,
                                                init_lora_weights=True), adapter_name="default")
        self.transformer.requires_grad_(False)
        # keep adapter tensors in the engine's dtype and device, like the base weights; only
        # theirs: a module-wide .to(dtype) would also cast the FP8 copies of an fp8 engine
        for name, p in self.transformer.named_parameters():
            if is_lora_name(name):
                p.data = p.data.to(device=self.device, dtype=self.dtype)
        self._lora_config = cfg
        self._weights_index = None  # new parameters: the next look walks the tree again
        if self.precision == "fp8":
            # from here on no sync writes the base (update_weights_from_tensors refuses a DiT with
            # LoRA layers), so the weights the FP8 copies were made from are never read again
            for layer in self._fp8_of_weight.values():
                layer.drop_weight()
            self.fp8_weights_dropped, self._fp8_of_weight = len(self._fp8_of_weight), {}
            # a host arena an earlier release (--offload-rollout) sized for them would keep their
            # bytes pinned: the next release lays out the smaller set afresh
            arena = self._host_arenas.pop("transformer", None)
            if arena is not None:
                arena.free()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def load_lora_dir(self, path) -> dict[str, Any]:
        """Install a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as
        peft's save_pretrained / tools/export_checkpoint.py --form adapter write it). Returns
        the LoRA config used."""
        d = Path(path)
        # a two-expert model's export: one adapter directory per transformer, loaded under the
        # names the engine's two-expert module gives them ("transformer.", "transformer_2.")
        parts = [(d / c, c + ".") for c in ("transformer", "transformer_2")]
        if all((p / "adapter_config.json").is_file() for p, _ in parts):
            cfg, named = None, []
            for part, prefix in parts:
                part_cfg, part_named = read_lora_dir(part)
                if cfg is not None and (cfg["rank"], cfg["alpha"]) != (part_cfg["rank"], part_cfg["alpha"]):
                    raise WeightSyncError(f"--lora {str(path)!r}: its transformer/ and transformer_2/ adapters have "
                                          "different r / lora_alpha; re-export the checkpoint")
                cfg = cfg or part_cfg
                named += [(prefix + n, t) for n, t in part_named]
        else:
            cfg, named = read_lora_dir(d)
            # a diffusers pipeline-level LoRA file also prefixes the component ("transformer.")
            named = [(n.removeprefix("transformer."), t) for n, t in named]
        self._check_adapter_rank(cfg, path)
        self.set_lora_tensors(named, build_manifest("adapter", named, self.policy_version), cfg)
        return dict(self._lora_config)  # normalised, as installed

    def _check_adapter_rank(self, cfg: dict[str, Any], path) -> None:
        """WeightSyncError naming the adapter directory `path` when its rank is above the width of
        the narrowest layer it targets. A file's rank, unlike a recipe's --lora-rank, is bounded by
        the model it is loaded into before peft allocates a layer: r x (in + out) per targeted
        layer then stays within the DiT's own size, whatever the file claims."""
        targets = _normalize_lora_config(cfg, self.adapter.lora_target_modules)["target_modules"]
        narrow = _narrowest_target(self.transformer, targets)
        if self._lora_config is None and narrow is not None and cfg["rank"] > narrow[1]:
            raise WeightSyncError(f"--lora {str(path)!r}: r = {cfg['rank']} is above the width {narrow[1]} of the "
                                  f"targeted layer {narrow[0]}; an adapter of this model has a rank of at most "
                                  f"{narrow[1]}: re-export it, or check that it belongs to this model")

    def get_weights_checksum(self) -> str:
        """core.checksum.weights_checksum over the DiT's parameters (diffusers names, wrapper
        segments stripped): the weights the engine samples with. Reads each parameter's bits once
        on the device; one host transfer. The parameter index is re-checked against the DiT's
        structure first (_weight_index)."""
        self._require_resident(("transformer",), "get_weights_checksum")
        return weights_checksum(self._weight_index(None).params.items())

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Move the modules (all, or those of `tags`) to pinned host memory (CUDA) and mark them
        released. Verified: raises RuntimeError if a tensor stayed on the device (fatal: a
        silently resident engine makes the colocated actor OOM much later)."""
        for name in self._modules_for(tags):
            if not self._resident[name]:
                continue
            module = getattr(self, name)
            if self.device.type != "cpu":
                arena = self._host_arenas.setdefault(name, HostArena(pin=self.device.type == "cuda"))
                move_module_to_host(module, arena)
            self._verify_placement(name, torch.device("cpu"))
            self._resident[name] = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Bring modules back to the device; tags=("weights",) onloads only the transformer.
        Verified like release_memory."""
        for name in self._modules_for(tags):
            if self._resident[name]:
                continue
            module = getattr(self, name)
            if self.device.type != "cpu":
                move_module_to_device(module, self.device)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self._verify_placement(name, self.device)
            self._resident[name] = True





class _WeightIndex:
    """NativeEngine's view of its DiT's parameters, valid while `structure` is unchanged."""

    __slots__ = ("structure", "params", "holds_lora", "lora_params", "lora_names_checked", "version")

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.structure = ModuleTreeSnapshot(transformer)
        #: stripped diffusers name -> parameter
        self.params = {strip_wrapper_segments(n): p for n, p in transformer.named_parameters()}
        self.holds_lora = model_has_lora(transformer)
        #: the LoRA part of params (set_lora_tensors' names)
        self.lora_params = {n: p for n, p in self.params.items() if ".lora_" in n}
        #: the ordered names of the last adapter sync that passed every name check against this index
        self.lora_names_checked: tuple[str, ...] | None = None
        #: the sync version this index was last checked for (None: a look outside a sync)
        self.version: int | None = None


def read_lora_dir(d: Path) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """(LoRA config, [(name, tensor)]) of one PEFT adapter directory, peft's "base_model.model."
    prefix and adapter-name segment removed as in a sync. adapter_config.json is checked first
    (core.adapter_config.read_adapter_config: bounded, r and lora_alpha in range, no field this
    loader would not apply), then every lora_A / lora_B tensor's shape against its r from the
    safetensors header, before a tensor is read or a layer allocated."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from trainer.core.adapter_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, FIX, read_adapter_config

    cfg_file, weights = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"--lora {str(d)!r} must be a PEFT adapter directory holding "
                                f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    cfg = read_adapter_config(d)  # AdapterConfigError (a ValueError) names the file and field
    unreadable = f"--lora: {weights} is not a readable safetensors file ({{}}); re-export the adapter"
    try:
        with safe_open(str(weights), framework="pt") as f:  # the header only
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated / garbled files
        raise ValueError(unreadable.format(e)) from None
    wrong = [f"{key} {shape}" for key, shape in shapes.items()
             if (".lora_A." in key and (len(shape) != 2 or shape[0] != cfg["rank"]))
             or (".lora_B." in key and (len(shape) != 2 or shape[1] != cfg["rank"]))]
    if wrong:
        raise ValueError(f"--lora: {cfg_file} says r = {cfg['rank']} but {weights} holds {len(wrong)} tensor(s) of "
                         f"another rank, e.g. {', '.join(wrong[:2])} (lora_A is [r, in], lora_B [out, r]); set r to "
                         f"the tensors' rank, or {FIX}")
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - as above
        raise ValueError(unreadable.format(e)) from None
    return cfg, [(strip_wrapper_segments(key), tensor) for key, tensor in tensors.items()]


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i as one multi-tensor copy (torch._foreach_copy_, which
    converts dtype/device like copy_), under no_grad. The sent tensors are only read."""
    if not dst:
        return
    with torch.no_grad():
        torch._foreach_copy_(dst, src)


def _narrowest_target(transformer: torch.nn.Module, targets) -> tuple[str, int] | None:
    """(name, min(in, out)) of the narrowest linear layer that peft's suffix rule adapts for the
    module names `targets`, None when none matches (peft's own error then names them)."""
    best = None
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            width = min(module.in_features, module.out_features)
            if best is None or width < best[1]:
                best = (name, width)
    return best


def _normalize_lora_config(cfg: dict[str, Any], default_targets=()) -> dict[str, Any]:
    """rank / alpha / sorted target_modules of a LoRA config in any of its spellings (ours or
    peft's); default_targets: the family's, when the config names none."""
    from trainer.core.adapter_config import lora_config_problems

    rank = cfg.get("rank", cfg.get("r"))
    alpha = cfg.get("alpha", cfg.get("lora_alpha"))
    targets = cfg.get("target_modules") or default_targets
    if isinstance(targets, str):
        targets = [targets]
    problems = lora_config_problems(rank, alpha, list(targets))
    if problems:
        raise WeightSyncError(f"lora_config {cfg}: {'; '.join(problems)}")
    return {"rank": int(rank), "alpha": float(alpha), "target_modules": tuple(sorted(targets))}


def move_module_to_host(module: torch.nn.Module, arena: HostArena) -> None:
    """Copy every parameter and buffer of `module` into slices of `arena` and point the module
    at them. Parameters swap their .data (the Parameter objects held elsewhere stay valid); a
    tensor shared by several modules is copied once. The arena is reused by the next release."""
    params: dict[int, torch.nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        params.update((id(p), p) for p in sub._parameters.values() if p is not None)
        buffers.update((id(b), b) for b in sub._buffers.values() if b is not None)
    tensors = [p.data for p in params.values()] + list(buffers.values())
    hosts = [typed_view(raw, t) for raw, t in zip(arena.slices([t.numel() * t.element_size() for t in tensors]),
                                                   tensors)]
    for t, host in zip(tensors, hosts):
        host.copy_(t)
    for p, host in zip(params.values(), hosts):
        p.data = host
    host_of_buffer = dict(zip(buffers, hosts[len(params):]))
    for sub in module.modules():
        for key, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[key] = host_of_buffer[id(b)]


def move_module_to_device(module: torch.nn.Module, device: torch.device) -> None:
    """The way back of move_module_to_host: every parameter (by .data swap) and buffer of `module`
    onto `device`; copies from a pinned arena are asynchronous (the caller synchronises)."""
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                p.data = _to_device(p.data, device)
        for key, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[key] = _to_device(b, device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device.type == device.type:  # a tensor shared by two modules moves once
        return t
    return t.to(device, non_blocking=t.is_pinned())
