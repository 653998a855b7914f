"""The SGLang rollout engine: the rollout engine protocol (trainer/engine/base.py) on top of
SGLang's diffusion runtime (`sglang.multimodal_gen`), in-process.

It runs inside the torchrun rank that owns it: no server, no HTTP, no second process. The
engine builds SGLang's own worker (`GPUWorker`: device, distributed state, the Qwen-Image
pipeline with SGLang's DiT, text encoder and VAE) in this process and hands it its requests
through `execute_forward`, as SGLang's scheduler would: one `Req` per geometry and batch of up to
max_batch_size candidates (one row each, the prompts' conditioning expanded to their rows by
SGLang), so a group of candidates shares one DiT forward per step, as in the native engine.

What the trainer replays is sampled exactly (trainer/engine/sglang_plugin.py does the work
inside SGLang's request path, through SGLang's plugin entry point and hook registry):

- x_T of every candidate is trainer.sampling.initial_noise(shape, generation_seed,
  sample_id), the same function the native engine uses, handed to SGLang as its row of
  `Req.latents`;
- SGLang steps on the driver's sigma list verbatim (no second shift);
- at the trained steps (sde_indices) the transition is trainer.flow_grpo.sde_step ("sde" or
  "dance", eta, sigma_max) with each row's trainer.sampling.step_noise; every other step is
  SGLang's own ODE update;
- the response has the native engine's keys and meaning (trajectory latents before / after
  each trained step, sigmas, timesteps, log-probs, the frozen text conditioning, ...).

Weights arrive as in-process tensors with diffusers names, like the native engine's: full /
merged syncs are copied into SGLang's DiT parameters (SGLang fuses the text-stream q/k/v
projections into one `to_added_qkv`; a diffusers name maps to its row block), LoRA adapters
are merged into the base weights (W = W0 + alpha / r * B @ A, W0 kept on the host), and
`get_weights_checksum` covers the diffusers names, dtypes and values the engine was given
(for LoRA: the base weights plus the adapter tensors, as the native engine's peft layers
hold them), so the syncer compares it with the sender's.

SGLang is an optional extra (`pip install .[sglang]`), imported only when an engine is built;
`check_sglang_contract()` runs first and names every upstream piece this engine relies on that
the installed SGLang lacks.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import time
from typing import Any, Iterable

import torch

from trainer.core.checksum import weights_checksum
from trainer.core.dtypes import engine_dtype
from trainer.core.manifest import verify_manifest
from trainer.core.names import strip_wrapper_segments
from trainer.engine.base import (ENGINE_MODULES, EngineCapabilities, EngineMemoryState, RolloutRequest, Trajectory,
                                 WeightManifest, WeightSyncError, check_names_shapes, check_one_geometry, check_request,
                                 rollout_trajectory)
from trainer.engine.native import _normalize_lora_config

log = logging.getLogger(__name__)

#: the one SGLang release the extension points below were checked against
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = ("pip install .[sglang] (sglang==" + SGLANG_VERSION + "); for the CPU test venv: "
                "bash run.sh setup-sglang")


#: (module, attribute path, why) the engine and its plugin use; check_sglang_contract checks them
CONTRACT = (
    ("sglang.multimodal_gen.runtime.server_args", "ServerArgs.from_kwargs", "engine configuration"),
    ("sglang.multimodal_gen.runtime.server_args", "set_global_server_args", "engine configuration"),
    ("sglang.multimodal_gen.runtime.managers.gpu_worker", "GPUWorker.execute_forward", "in-process worker"),
    ("sglang.multimodal_gen.runtime.managers.gpu_worker", "GPUWorker.release_memory_occupation", "release_memory"),
    ("sglang.multimodal_gen.runtime.managers.gpu_worker", "GPUWorker.resume_memory_occupation", "resume_memory"),
    ("sglang.multimodal_gen.runtime.entrypoints.openai.utils", "build_sampling_params", "request building"),
    ("sglang.multimodal_gen.runtime.entrypoints.utils", "prepare_request", "request building"),
    ("sglang.multimodal_gen.runtime.platforms.plugins", "load_plugins", "plugin entry point"),
    ("sglang.multimodal_gen.runtime.platforms.plugins", "apply_plugin_hooks", "plugin entry point"),
    ("sglang.multimodal_gen.runtime.platforms.plugins", "HookRegistry.register", "hooks"),
    ("sglang.multimodal_gen.runtime.platforms.plugins", "HookType.AROUND", "hooks"),
    ("sglang.multimodal_gen.runtime.post_training.rollout_hooks", "prepare_rollout_if_enabled",
     "trainer rollout controller hook target"),
    ("sglang.multimodal_gen.runtime.post_training.rollout_hooks", "VISUAL_STREAM", "rollout controller key"),
    ("sglang.multimodal_gen.runtime.post_training.flow_rollout_controller",
     "FlowRolloutController.flow_sde_sampling", "trained-step transition (sde / dance, driver noise)"),
    ("sglang.multimodal_gen.runtime.post_training.flow_rollout_controller",
     "FlowRolloutController.append_local_rollout_log_probs", "per-step log-prob bookkeeping"),
    ("sglang.multimodal_gen.runtime.pipelines_core.stages.timestep_preparation",
     "TimestepPreparationStage.forward", "driver sigmas hook target (no second shift)"),
    ("sglang.multimodal_gen.configs.pipeline_configs.qwen_image", "qwen_image_postprocess_text",
     "Qwen-Image text window hook target"),
    ("sglang.multimodal_gen.runtime.post_training.weights_updater", "_build_module_weight_name_mapper",
     "diffusers -> SGLang DiT parameter names"),
)
#: Req fields the engine sets / reads (driver x_T, plugin spec, rollout switches)
REQ_FIELDS = ("latents", "extra", "sigmas", "rollout_trajectory_data", "rollout_controllers")
#: SamplingParams fields of a rollout request
SAMPLING_FIELDS = ("rollout", "rollout_sde_type", "rollout_noise_level", "rollout_sde_step_indices",
                   "rollout_return_denoising_env", "rollout_log_prob_no_const", "rollout_debug_mode",
                   "generator_device", "num_inference_steps", "guidance_scale", "height", "width", "seed")
#: parameters of FlowRolloutController.flow_sde_sampling the trainer's controller overrides
SDE_SAMPLING_PARAMS = ("batch", "model_output", "sample", "current_sigma", "next_sigma", "step_index")
#: ServerArgs set explicitly: the engine keeps its modules resident and moves them itself
#: (release_memory / resume_memory); left unset, SGLang would offload the DiT and the text encoder
#: to the host for image generation on a GPU
RESIDENT_ARGS = {"dit_cpu_offload": False, "text_encoder_cpu_offload": False,
                 "image_encoder_cpu_offload": False, "vae_cpu_offload": False}


class SGLangContractError(RuntimeError):
    """The installed SGLang is not the one this engine's extension was written against."""


def _resolve(module_name: str, attr_path: str):
    import importlib

    obj = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def check_sglang_contract(required_version: str = SGLANG_VERSION) -> None:
    """Static check, before anything is built: the installed sglang is `required_version` and
    every upstream attribute, hook target, request field and overridden signature the engine
    and its plugin rely on exists. Raises SGLangContractError listing everything missing (a
    silent miss would train on log-probs that do not match the sampled trajectory)."""
    try:
        import sglang
    except ImportError as e:
        raise SGLangContractError(f"sglang is not installed ({e}); {INSTALL_HINT}") from None
    problems = []
    version = getattr(sglang, "__version__", None)
    if version != required_version:
        problems.append(f"sglang version {version}, the engine is pinned to {required_version}")
    for module_name, attr_path, why in CONTRACT:
        try:
            _resolve(module_name, attr_path)
        except Exception as e:  # ImportError, AttributeError, or an import-time failure
            problems.append(f"{module_name}.{attr_path} ({why}): {type(e).__name__}: {e}")
    try:
        from dataclasses import fields

        from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

        req_fields = {f.name for f in fields(Req)}
        problems += [f"Req.{n} (request field)" for n in REQ_FIELDS if n not in req_fields]
        sp_fields = {f.name for f in fields(SamplingParams)}
        problems += [f"SamplingParams.{n} (rollout request field)" for n in SAMPLING_FIELDS if n not in sp_fields]
        from sglang.multimodal_gen.runtime.server_args import ServerArgs

        sa_fields = {f.name for f in fields(ServerArgs)}
        problems += [f"ServerArgs.{n} (keeps the engine's modules resident)" for n in RESIDENT_ARGS
                     if n not in sa_fields]
    except Exception as e:
        problems.append(f"Req / SamplingParams / ServerArgs dataclasses: {type(e).__name__}: {e}")
    try:
        from sglang.multimodal_gen.runtime.post_training.flow_rollout_controller import FlowRolloutController

        params = inspect.signature(FlowRolloutController.flow_sde_sampling).parameters
        problems += [f"FlowRolloutController.flow_sde_sampling parameter {p!r}" for p in SDE_SAMPLING_PARAMS
                     if p not in params]
    except Exception as e:
        problems.append(f"FlowRolloutController.flow_sde_sampling signature: {type(e).__name__}: {e}")
    if problems:
        raise SGLangContractError(
            f"the installed sglang does not provide what the SGLang rollout engine relies on ({len(problems)} "
            "problem(s)):\n  - " + "\n  - ".join(problems)
            + f"\nInstall the pinned release: {INSTALL_HINT}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_SIZE")

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _numerics_state() -> dict[str, Any]:
    m = torch.backends.cuda.matmul
    return {"cudnn_tf32": torch.backends.cudnn.allow_tf32, "matmul_tf32": m.allow_tf32,
            "bf16_reduced": m.allow_bf16_reduced_precision_reduction,
            "fp16_reduced": m.allow_fp16_reduced_precision_reduction,
            "fp32_precision": torch.get_float32_matmul_precision()}


def _restore_numerics(state: dict[str, Any]) -> None:
    """Put back what changed (only that: torch objects to mixing its TF32 APIs needlessly)."""
    now = _numerics_state()
    m = torch.backends.cuda.matmul
    if now["fp32_precision"] != state["fp32_precision"]:
        torch.set_float32_matmul_precision(state["fp32_precision"])
    elif now["matmul_tf32"] != state["matmul_tf32"]:
        m.allow_tf32 = state["matmul_tf32"]
    if now["cudnn_tf32"] != state["cudnn_tf32"]:
        torch.backends.cudnn.allow_tf32 = state["cudnn_tf32"]
    if now["bf16_reduced"] != state["bf16_reduced"]:
        m.allow_bf16_reduced_precision_reduction = state["bf16_reduced"]
    if now["fp16_reduced"] != state["fp16_reduced"]:
        m.allow_fp16_reduced_precision_reduction = state["fp16_reduced"]


def _proctitle() -> str | None:
    try:
        import setproctitle
    except ImportError:
        return None
    return setproctitle.getproctitle()


class SGLangEngine(EngineMemoryState):
    """In-process SGLang Qwen-Image rollout engine (implements trainer.engine.base.RolloutEngine).

    Arguments as NativeEngine's: max_batch_size caps the candidates of one SGLang request
    (0: every candidate of a geometry in one request). attention_backend: SGLang's
    ServerArgs.attention_backend (e.g. "torch_sdpa"); None leaves SGLang's own choice (on a
    Hopper GPU its FlashAttention 3, which needs sglang-kernel's flash_ops library)."""

    #: declared here, read by preflight without sglang (this module imports it only when built)
    capabilities = EngineCapabilities(
        name="the SGLang engine", families=("trainer.models.qwen_image.QwenImageAdapter",), true_cfg=False,
        sde_types=("sde", "dance"), compile=False, fp8=False, attention_backend=True, ode_final_latents=False,
        reasons={"families": "bridges SGLang's Qwen-Image pipeline only",
                 "true_cfg": "samples without CFG (its bridge runs one conditional row per candidate)",
                 "sde_types": "bridge is checked for",
                 "kernels": "SGLang brings its own kernels",
                 "ode_final_latents": "does not sample the 'cps' last step that returns them"})

    def __init__(self, model_path, *, device=None, dtype=None, max_batch_size: int = 0,
                 max_sequence_length: int = 512, revision: str | None = None, adapter: Any = None,
                 attention_backend: str | None = None):
        # adapter: accepted like NativeEngine's; this bridge serves Qwen-Image only, through
        # SGLang's own Qwen-Image pipeline, so it has nothing to ask of it
        del adapter
        check_sglang_contract()
        from safetensors import safe_open
        from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins
        from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args

        from trainer.engine import sglang_plugin
        from trainer.models.qwen_image import check_model_dir, prompt_template_start_idx, vae_scale_factor_from_config
        from trainer.sampling import load_scheduler_config

        path = check_model_dir(model_path, ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"))
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = engine_dtype(dtype, self.device)
        self.model_path = str(path)
        self.revision = revision
        self.max_batch_size = int(max_batch_size)
        self.max_sequence_length = int(max_sequence_length)
        self.scheduler_config = load_scheduler_config(str(path))
        self.num_train_timesteps = int(self.scheduler_config.get("num_train_timesteps", 1000))
        vae_cfg = json.loads((path / "vae" / "config.json").read_text())
        self.vae_scale_factor = vae_scale_factor_from_config(vae_cfg)
        self.latent_channels = int(vae_cfg.get("z_dim", 16))
        self.in_channels = int(json.loads((path / "transformer" / "config.json").read_text())["in_channels"])

        # SGLang's own plugin mechanism loads trainer.engine.sglang_plugin (setup.cfg entry
        # point); a checkout without the installed entry point still gets it registered.
        load_plugins()
        from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

        if sglang_plugin.PREPARE_ROLLOUT_TARGET not in HookRegistry._hooks:
            log.warning("the flowgrpo_trainer SGLang plugin entry point is not installed (pip install -e .); "
                        "registering it directly")
            sglang_plugin.register()
        from transformers import Qwen2Tokenizer

        tokenizer = Qwen2Tokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
        template = sglang_plugin.qwen_image_template()
        sglang_plugin.set_text_window(prompt_template_start_idx(tokenizer, template), self.max_sequence_length)
        apply_plugin_hooks()
        missing = sglang_plugin.unapplied_hooks()
        if missing:
            raise SGLangContractError(f"SGLang did not apply the trainer's hooks on {missing}")

        name = _DTYPE_NAMES[self.dtype]
        # Under torchrun every rank owns one engine: to SGLang the ranks are data-parallel
        # replicas of one GPU each, so its groups (built on the trainer's default process group,
        # which SGLang reuses) are one rank wide and consistent on every rank.
        world, self._rank = 1, 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world, self._rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        # SGLang's ServerArgs reconfigures the root logger (handlers, level) for its server
        # process; this process is the trainer's, so its logging is put back, and SGLang's
        # per-request stage logs are kept at WARNING.
        root = logging.getLogger()
        saved_handlers, saved_level = list(root.handlers), root.level
        try:
            self.server_args = ServerArgs.from_kwargs(
                model_path=str(path), model_id="Qwen-Image", num_gpus=world, dp_size=world, dit_precision=name,
                vae_precision=name, text_encoder_precisions=(name,), warmup_mode="off", log_level="warning",
                **RESIDENT_ARGS, **({"attention_backend": attention_backend} if attention_backend else {}))
        finally:
            root.handlers[:] = saved_handlers
            root.setLevel(saved_level)
        logging.getLogger("sglang").setLevel(logging.WARNING)
        set_global_server_args(self.server_args)
        self.worker = self._build_worker()
        modules = self.worker.pipeline.modules
        self.transformer, self.vae, self.text_encoder = modules["transformer"], modules["vae"], modules["text_encoder"]
        for m in (self.transformer, self.vae, self.text_encoder):
            m.requires_grad_(False)

        # diffusers name -> (SGLang parameter, row block or None), from the checkpoint's own names
        names_shapes = {}
        for f in sorted((path / "transformer").glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    names_shapes[k] = tuple(h.get_slice(k).get_shape())
        self._index = self._build_index(names_shapes, source=str(path / "transformer"))
        self.policy_version = 0
        self._resident = {n: True for n in ENGINE_MODULES}
        self._lora_config: dict[str, Any] | None = None
        self._lora: dict[str, torch.Tensor] = {}
        self._lora_base: dict[str, torch.Tensor] = {}
        self.last_stats: dict[str, float] = {}

    def _build_worker(self):
        """SGLang's GPUWorker in this process. A worker normally owns its process, so its set-up
        changes process-wide state: the torch.distributed env variables, the CPU intra-op thread
        count, torch's TF32 / reduced-precision switches and the process title. All of it is put
        back afterwards: the rank stays the trainer's, and SGLang's DiT computes with the
        numerics the actor replays with. An existing default process group is reused by SGLang."""
        from sglang.multimodal_gen.runtime.managers.gpu_worker import GPUWorker

        saved_env = {k: os.environ.get(k) for k in _DIST_ENV}
        saved_numerics = _numerics_state()
        saved_threads = torch.get_num_threads()
        saved_title = _proctitle()
        local_rank = (self.device.index or 0) if self.device.type == "cuda" else int(os.environ.get("LOCAL_RANK", 0))
        port = int(os.environ.get("MASTER_PORT", 0)) or _free_port()  # unused when a process group exists
        try:
            return GPUWorker(local_rank, self._rank, port, self.server_args)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _restore_numerics(saved_numerics)
            if torch.get_num_threads() != saved_threads:
                torch.set_num_threads(saved_threads)
            if saved_title is not None:
                import setproctitle

                setproctitle.setproctitle(saved_title)

    def _build_index(self, names_shapes: dict[str, tuple],
                     source: str = "the checkpoint") -> dict[str, tuple[torch.nn.Parameter, tuple | None]]:
        """diffusers name -> (SGLang parameter, row block or None) for the checkpoint's tensors
        (`names_shapes`, read from `source`); SGLangContractError naming `source` if any does not fit."""
        from sglang.multimodal_gen.runtime.post_training.weights_updater import _build_module_weight_name_mapper

        params = dict(self.transformer.named_parameters())
        mapper = _build_module_weight_name_mapper(self.transformer)
        index, problems = {}, []
        for name, shape in names_shapes.items():
            target, shard = (name, None) if name in params else (mapper(name) if mapper else (name, None))
            if target not in params:
                problems.append(f"{name}: no SGLang parameter (mapped to {target})")
                continue
            p = params[target]
            if shard is None:
                if tuple(p.shape) != shape:
                    problems.append(f"{name}: shape {shape}, SGLang {tuple(p.shape)}")
                index[name] = (p, None)
            else:
                rows = shape[0]
                block = (int(shard) * rows, (int(shard) + 1) * rows)
                if block[1] > p.shape[0] or tuple(p.shape[1:]) != shape[1:]:
                    problems.append(f"{name}: shard {shard} of {target} {tuple(p.shape)} does not fit {shape}")
                index[name] = (p, block)
        if problems:
            raise SGLangContractError(
                f"SGLang's DiT does not hold the tensors of {source} ({len(problems)} problem(s)): "
                + "; ".join(problems[:5]) + "; --model-path must be a Qwen-Image diffusers directory")
        return index

    def _view(self, name: str) -> torch.Tensor:
        p, block = self._index[name]
        return p.data if block is None else p.data[block[0]:block[1]]

    # ------------------------------------------------------------------ generation

    def sigma_schedule(self, height: int, width: int, num_inference_steps: int) -> list[float]:
        from trainer.sampling import image_seq_len, sigma_schedule

        return sigma_schedule(self.scheduler_config, num_inference_steps,
                              image_seq_len(height, width, self.vae_scale_factor))

    def generate(self, requests: list[RolloutRequest]) -> Trajectory | None:
        """A Trajectory as NativeEngine.generate's, rows in request order (None for no request).
        The candidates (one geometry) share SGLang requests of up to max_batch_size candidates
        (0: all of them), one row each, several prompts per request."""
        self._require_resident(ENGINE_MODULES, "generate")
        if not requests:
            return None
        for r in requests:
            check_request(r)
            if r.guidance_scale > 1.0:
                raise ValueError(f"request {r.sample_id}: guidance_scale {r.guidance_scale}; the SGLang engine samples "
                                 "without CFG: use the native engine for true CFG")
        check_one_geometry(requests)
        t0 = time.perf_counter()
        step = self.max_batch_size if self.max_batch_size > 0 else len(requests)
        self._sglang_requests = 0
        parts = [self._generate_chunk(requests[start:start + step]) for start in range(0, len(requests), step)]
        self.last_stats = {"candidates": float(len(requests)), "sglang_requests": float(self._sglang_requests),
                           "dit_forwards": float(self._sglang_requests * requests[0].num_inference_steps),
                           "generate_time": time.perf_counter() - t0}
        return Trajectory.cat(parts)

    def _generate_chunk(self, reqs: list[RolloutRequest]) -> Trajectory:
        """One SGLang request for candidates of one geometry; rows in the order of `reqs`.

        The rows are ordered prompt by prompt (SGLang expands each prompt's conditioning to its
        consecutive rows): with the same number of candidates for every prompt the request names
        each prompt once with num_outputs_per_prompt = that number, otherwise one prompt per row."""
        from sglang.multimodal_gen.runtime.entrypoints.openai.utils import build_sampling_params
        from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request

        from trainer.engine.sglang_plugin import SPEC_KEY, TrainerRolloutSpec
        from trainer.models.qwen_image import packed_grid
        from trainer.sampling import init_noise_shape, initial_noise, timesteps_from_sigmas

        r = reqs[0]
        rows, cols = packed_grid(r.height, r.width, self.vae_scale_factor)
        shape = init_noise_shape(r, self.latent_channels, self.vae_scale_factor)
        in_ch = self.in_channels
        if len(shape) != 3 or shape[1] != 2 * rows or shape[2] != 2 * cols or shape[0] * 4 != in_ch:
            raise ValueError(f"x_T shape {shape} does not fit {r.height}x{r.width} on this model (expected "
                             f"[{in_ch // 4}, {2 * rows}, {2 * cols}]); fix --sampling-config init_noise_latent_shape "
                             "or height/width")
        by_prompt: dict[str, list[int]] = {}
        for j, q in enumerate(reqs):
            by_prompt.setdefault(q.prompt, []).append(j)
        if len(by_prompt) > 1 and not self.server_args.pipeline_config.supports_dynamic_batching():
            # one request per prompt, rows put back in the order of `reqs`
            joined = Trajectory.cat([self._generate_chunk([reqs[j] for j in js]) for js in by_prompt.values()])
            order = [j for js in by_prompt.values() for j in js]
            return joined[[order.index(j) for j in range(len(reqs))]]
        order = [j for js in by_prompt.values() for j in js]  # row b of the request is reqs[order[b]]
        counts = {len(js) for js in by_prompt.values()}
        if len(counts) == 1:
            prompts, per_prompt = list(by_prompt), counts.pop()
        else:
            prompts, per_prompt = [reqs[j].prompt for j in order], 1
        steps = sorted(int(i) for i in r.sde_indices)
        sp = build_sampling_params(
            f"{r.sample_id}", prompt=prompts[0], seed=int(r.generation_seed),
            generator_device="cpu", width=int(r.width), height=int(r.height),
            num_inference_steps=int(r.num_inference_steps), num_outputs_per_prompt=per_prompt,
            guidance_scale=1.0, rollout=True, rollout_sde_type="sde", rollout_noise_level=float(r.eta) or 1.0,
            rollout_log_prob_no_const=False, rollout_debug_mode=False, rollout_return_denoising_env=True,
            rollout_return_dit_trajectory=False, rollout_sde_step_indices=steps, save_output=False,
            return_trajectory_latents=False, return_trajectory_decoded=False, suppress_logs=True)
        req = prepare_request(server_args=self.server_args, sampling_params=sp)
        if len(prompts) > 1:
            # several prompts in one request, as SGLang's scheduler merges compatible requests
            # (dynamic batching): the prompt list and one base seed per prompt
            req.prompt = list(prompts)
            req.extra["dynamic_batch_seeds"] = [int(r.generation_seed)] * len(prompts)
        if req.batch_size != len(reqs):
            raise RuntimeError(f"SGLang made a request of {req.batch_size} rows for {len(reqs)} candidates")
        spec = TrainerRolloutSpec(sample_ids=[reqs[j].sample_id for j in order],
                                  generation_seeds=[int(reqs[j].generation_seed) for j in order],
                                  sigmas=[float(s) for s in r.sigmas], sde_indices=steps, eta=float(r.eta),
                                  sde_type=r.sde_type, sigma_max=float(r.sigma_max), latent_dtype=self.dtype)
        req.extra[SPEC_KEY] = spec
        x_t = torch.stack([initial_noise(shape, reqs[j].generation_seed, reqs[j].sample_id) for j in order])
        req.latents = x_t[:, None].to(self.dtype)  # [B, frames=1, C, h, w], packed by SGLang
        result = self.worker.execute_forward([req])
        self._sglang_requests += 1
        if getattr(result, "error", None):
            raise RuntimeError(f"SGLang failed on request {r.sample_id}: {result.error}")
        if [rec["step"] for rec in spec.records] != steps:
            raise RuntimeError(f"SGLang ran the trained transition at steps {[rec['step'] for rec in spec.records]}, "
                               f"the request trains {steps}; the trainer's SGLang hooks are not in effect")
        env = result.rollout_trajectory_data.denoising_env
        embeds = env.pos_cond_kwargs["encoder_hidden_states"]
        embeds = embeds[0] if isinstance(embeds, (list, tuple)) else embeds
        mask = env.pos_cond_kwargs.get("encoder_hidden_states_mask")
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        images = result.output
        if len(images) != len(reqs):
            raise RuntimeError(f"SGLang returned {len(images)} images for {len(reqs)} candidates")
        from trainer.models.qwen_image import pad_text

        sigmas = [float(s) for s in r.sigmas]
        timesteps = timesteps_from_sigmas(sigmas[:-1], self.num_train_timesteps)
        conds = [self._row_conditioning(embeds, mask, b, len(reqs), prompts.index(reqs[j].prompt))
                 for b, j in enumerate(order)]
        cond_embeds, cond_mask = pad_text([e.to(self.dtype).cpu() for e, _ in conds], [m for _, m in conds])
        frames = [img[:, 0] if img.dim() == 4 else img for img in images]  # [3, frames=1, H, W] -> [3, H, W]
        records = spec.records
        rows = rollout_trajectory(
            [reqs[j] for j in order], images=torch.stack([f.float().clamp(0, 1).cpu() for f in frames]),
            latents=torch.stack([rec["latents"] for rec in records], 1),
            next_latents=torch.stack([rec["next_latents"] for rec in records], 1),
            sigmas=torch.tensor([sigmas[i] for i in steps], dtype=torch.float32),
            sigmas_next=torch.tensor([sigmas[i + 1] for i in steps], dtype=torch.float32),
            timesteps=torch.tensor([timesteps[i] for i in steps], dtype=torch.float32),
            log_probs=torch.stack([rec["log_probs"] for rec in records], 1).to(torch.float32), sde_indices=steps,
            conditions={"prompt_embeds": cond_embeds, "prompt_embeds_mask": cond_mask},
            vae_scale_factor=self.vae_scale_factor, policy_version=self.policy_version)
        return rows if order == list(range(len(reqs))) else rows[[order.index(j) for j in range(len(reqs))]]

    @staticmethod
    def _row_conditioning(embeds: torch.Tensor, mask, row: int, rows: int, prompt_index: int):
        """Row `row`'s text conditioning [T, D] and mask [T], cut to its own tokens (a request of
        several prompts pads them to the longest; SGLang's mask marks the valid prefix)."""
        if embeds.dim() == 2:
            embeds = embeds[None]
        i = row if embeds.shape[0] == rows else prompt_index if embeds.shape[0] > prompt_index else 0
        e = embeds[i]
        t = e.shape[0]
        if mask is None:
            return e, torch.ones(t, dtype=torch.int64)
        m = mask.reshape(-1, mask.shape[-1])
        m = m[i if m.shape[0] > i else 0][:t].to(torch.int64).cpu()
        n = int(m.sum())
        if n < t and bool(m[:n].all()):  # padding after the prompt's tokens
            return e[:n], m[:n]
        return e, m

    # ------------------------------------------------------------------ weights

    def holds_lora(self) -> bool:
        return self._lora_config is not None


    def update_weights_from_tensors(self, named_tensors: list[tuple[str, Any]], manifest: WeightManifest) -> None:
        """Copy full / merged transformer tensors (diffusers names) into SGLang's DiT; checked
        as NativeEngine's (manifest, names, shapes; refused once a LoRA adapter is installed)."""
        self._require_resident(("transformer",), "update_weights_from_tensors", WeightSyncError)
        if self.holds_lora():
            raise WeightSyncError(
                "full/merged weight sync into an engine that holds a LoRA adapter: the adapter would be dropped "
                "or applied twice; use set_lora_tensors (--lora-adapter-mode) or a fresh engine, never both on one "
                "engine")
        verify_manifest(named_tensors, manifest)
        views = {n: self._view(n) for n, _ in named_tensors if n in self._index}
        check_names_shapes(named_tensors, views, manifest.kind)
        with torch.inference_mode():
            torch._foreach_copy_([views[n] for n, _ in named_tensors], [t for _, t in named_tensors])

    def set_lora_tensors(self, named_tensors: list[tuple[str, Any]], manifest: WeightManifest,
                         lora_config: dict[str, Any]) -> None:
        """Install / replace a LoRA adapter (peft names without the adapter segment). The adapter
        is merged into SGLang's DiT weights: W = W0 + alpha / rank * B @ A, with W0 (the base
        weights at the first install) kept on the host; the given adapter tensors are kept (in
        the engine dtype) for the checksum."""
        self._require_resident(("transformer",), "set_lora_tensors", WeightSyncError)
        verify_manifest(named_tensors, manifest)
        from trainer.models.qwen_image import QWEN_IMAGE_LORA_TARGETS  # SGLang's bridge serves Qwen-Image only

        cfg = _normalize_lora_config(lora_config, QWEN_IMAGE_LORA_TARGETS)
        if self._lora_config is not None and cfg != self._lora_config:
            raise WeightSyncError(f"LoRA config {cfg} differs from the one installed in the engine "
                                  f"({self._lora_config}); rank, alpha and targets cannot change within a run")
        expected = self._lora_shapes(cfg)
        known = {n: torch.empty(s, device="meta") for n, s in expected.items()}
        check_names_shapes(named_tensors, known, "adapter")
        missing = sorted(set(expected) - {n for n, _ in named_tensors})
        if missing:
            raise WeightSyncError(f"adapter sync lacks {len(missing)} of the engine's {len(expected)} LoRA tensors, "
                                  f"e.g. {missing[:3]}; every adapter tensor must be sent")
        if self._lora_config is None:
            self._lora_base = {m + ".weight": self._view(m + ".weight").detach().to("cpu", copy=True)
                               for m in self._lora_modules(cfg)}
            self._lora_config = cfg
        self._lora = {n: t.detach().to(device="cpu", dtype=self.dtype).clone() for n, t in named_tensors}
        scale = cfg["alpha"] / cfg["rank"]
        with torch.inference_mode():
            for m in self._lora_modules(cfg):
                a, b = self._lora[m + ".lora_A.weight"].float(), self._lora[m + ".lora_B.weight"].float()
                w = self._lora_base[m + ".weight"].float() + scale * (b @ a)
                self._view(m + ".weight").copy_(w.to(self.dtype))

    def _lora_modules(self, cfg) -> list[str]:
        """Module names (diffusers) the LoRA targets cover, as peft matches target_modules
        (a name equal to the target or ending in ".<target>")."""
        mods = sorted({n[:-len(".weight")] for n in self._index if n.endswith(".weight")})
        targets = cfg["target_modules"]
        out = [m for m in mods if any(m == t or m.endswith("." + t) for t in targets)]
        if not out:
            raise WeightSyncError(f"LoRA target_modules {targets} match no linear layer of the engine's transformer")
        return out

    def _lora_shapes(self, cfg) -> dict[str, tuple]:
        out = {}
        for m in self._lora_modules(cfg):
            w = self._view(m + ".weight")
            out[m + ".lora_A.weight"] = (cfg["rank"], int(w.shape[1]))
            out[m + ".lora_B.weight"] = (int(w.shape[0]), cfg["rank"])
        return out

    def _check_adapter_rank(self, cfg: dict[str, Any], path) -> None:
        """Nothing beyond set_lora_tensors' own checks: this engine merges the adapter into its
        weights and allocates nothing before every sent tensor's shape is checked against the
        DiT's layers, so a file's rank costs no more memory than the file itself."""

    def load_lora_dir(self, path) -> dict[str, Any]:
        """Install a PEFT adapter directory, as NativeEngine.load_lora_dir."""
        from trainer.engine.native import NativeEngine

        return NativeEngine.load_lora_dir(self, path)

    def _checksum_items(self):
        """(diffusers name, tensor) the engine samples with, named as the sender names them:
        without LoRA the DiT's tensors; with LoRA the base weights (W0) and the adapter."""
        for name in self._index:
            if self._lora_config is not None and name in self._lora_base:
                yield name, self._lora_base[name].to(self.dtype)
            else:
                yield name, self._view(name)
        for name, t in self._lora.items():
            yield strip_wrapper_segments(name), t

    def get_weights_checksum(self) -> str:
        self._require_resident(("transformer",), "get_weights_checksum")
        return weights_checksum(self._checksum_items())

    # ------------------------------------------------------------------ memory

    def release_memory(self, tags: Iterable[str] | None = None) -> None:
        """Release the engine's device memory through SGLang's release_memory_occupation (all
        modules: SGLang releases its pipeline as a whole; `tags` are accepted for the protocol
        and must name known modules). On CPU this is bookkeeping, verified."""
        names = self._modules_for(tags)
        if not any(self._resident[n] for n in names):
            return
        if self.device.type == "cuda":
            result = self.worker.release_memory_occupation()
            if isinstance(result, dict) and result.get("success") is False:
                raise RuntimeError(f"SGLang release_memory_occupation failed (fatal): {result}")
        for n in ENGINE_MODULES:
            self._resident[n] = False

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Bring the engine back (SGLang resumes its whole pipeline; tags as release_memory)."""
        names = self._modules_for(tags)
        if all(self._resident[n] for n in names):
            return
        if self.device.type == "cuda":
            result = self.worker.resume_memory_occupation()
            if isinstance(result, dict) and result.get("success") is False:
                raise RuntimeError(f"SGLang resume_memory_occupation failed (fatal): {result}")
        for n in ENGINE_MODULES:
            self._verify_placement(n, self.device)
            self._resident[n] = True
