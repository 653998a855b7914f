"""The rollout engine protocol: what the loop, the actor's weight sync and the
rollout driver may call on an engine. Every engine (native diffusers, SGLang)
implements exactly this surface, in-process: no server, no IPC.

Weights arrive as in-process tensors plus a manifest and a version; an engine
commits the version only after the caller's verification succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

# the manifest and its error are part of this protocol's surface; they live in the bottom layer
from trainer.core.manifest import WeightManifest, WeightSyncError  # noqa: F401


@dataclass
class RolloutRequest:
    """One candidate to generate. Built by the model adapter's build_rollout_request.

    The candidate's x_T and per-step noise are a pure function of
    (generation_seed, sample_id, step); `sigmas` is the driver's schedule
    (num_inference_steps + 1 values, terminal 0 included).
    """

    prompt: str
    group_index: int
    slot: int
    sample_id: str
    height: int
    width: int
    num_inference_steps: int
    sigmas: list[float]
    sde_indices: list[int]
    eta: float
    sde_type: str = "sde"
    sigma_max: float = 0.99
    guidance_scale: float = 1.0
    generation_seed: int = 1234
    metadata: dict[str, Any] = field(default_factory=dict)
    #: x_T shape override ([C, h, w] unpacked latent); None = [z_dim, *latent grid]
    init_noise_latent_shape: list[int] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """In-process generation engine."""

    #: the policy version of the weights currently loaded (0 = as loaded from disk)
    policy_version: int

    def generate(self, requests: list[RolloutRequest]) -> list[dict[str, Any]]:
        """Generate every request; returns one response dict per request, same order.

        A response carries at least: image (float tensor [3, H, W] in [0, 1], CPU),
        trajectory_latents, trajectory_next_latents ([S, ...] latents before / after each
        trained step), timesteps, sigmas / sigmas_next ([S]), log_probs ([S], fp32),
        sde_indices, prompt_embeds, prompt_embeds_mask, height, width, policy_version.
        """

    def release_memory(self) -> None:
        """Move the engine's modules off the device (fatal on failure)."""

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Bring modules back; tags=("weights",) onloads only the transformer."""

    def update_weights_from_tensors(
        self, named_tensors: list[tuple[str, Any]], manifest: WeightManifest
    ) -> None:
        """Copy full (or merged) transformer tensors in; names are diffusers names.

        Raises WeightSyncError on any unknown name, shape mismatch, count/bytes mismatch,
        or when the engine's transformer holds LoRA layers (a full sync would be dropped).
        Does not change policy_version: see commit_weight_version.
        """

    def set_lora_tensors(
        self, named_tensors: list[tuple[str, Any]], manifest: WeightManifest, lora_config: dict[str, Any]
    ) -> None:
        """Install / replace the LoRA adapter tensors (peft names, e.g.
        "transformer_blocks.0.attn.to_q.lora_A.weight"); lora_config has rank, alpha,
        target_modules."""

    def get_weights_checksum(self) -> str:
        """A stable checksum of the weights the engine would sample with."""

    def commit_weight_version(self, version: int) -> None:
        """Make `version` the engine's policy_version (after verification)."""



def rollout_response(r: RolloutRequest, *, image: torch.Tensor, latents: torch.Tensor, next_latents: torch.Tensor,
                     sigmas: torch.Tensor, sigmas_next: torch.Tensor, timesteps: torch.Tensor,
                     log_probs: torch.Tensor, sde_indices: list[int], prompt_embeds: torch.Tensor,
                     prompt_embeds_mask: torch.Tensor, vae_scale_factor: int, policy_version: int,
                     dtype: torch.dtype) -> dict[str, Any]:
    """One candidate's response, as RolloutEngine.generate documents it: the request's identity
    and geometry echoed, the given tensors (trained steps only) stored as they are."""
    return {
        "prompt": r.prompt,
        "sample_id": r.sample_id,
        "group_index": r.group_index,
        "slot": r.slot,
        "generation_seed": r.generation_seed,
        "metadata": dict(r.metadata),
        "image": image,
        "trajectory_latents": latents,
        "trajectory_next_latents": next_latents,
        "sigmas": sigmas,
        "sigmas_next": sigmas_next,
        "timesteps": timesteps,
        "log_probs": log_probs,
        "sde_indices": list(sde_indices),
        "prompt_embeds": prompt_embeds,
        "prompt_embeds_mask": prompt_embeds_mask,
        "height": r.height,
        "width": r.width,
        "vae_scale_factor": vae_scale_factor,
        "num_inference_steps": r.num_inference_steps,
        "eta": r.eta,
        "sde_type": r.sde_type,
        "sigma_max": r.sigma_max,
        "policy_version": policy_version,
        "latent_dtype": str(dtype).replace("torch.", ""),
    }

def check_request(r: RolloutRequest) -> None:
    """Raise ValueError naming the candidate if `r` is not something an engine may sample: CFG
    (the actor replays one positive-conditioned forward), no trained step, a sigma list of the
    wrong length, trained steps out of range, an unknown SDE type."""
    from trainer.sampling import SDE_TYPES

    if float(r.guidance_scale) != 1.0:
        raise ValueError(f"request {r.sample_id}: guidance_scale {r.guidance_scale} != 1.0; the engines sample "
                         "without CFG because the actor replays a single positive-conditioned forward")
    if not r.sde_indices:
        raise ValueError(f"request {r.sample_id}: empty sde_indices; a rollout needs at least one trained SDE step")
    if len(r.sigmas) != r.num_inference_steps + 1:
        raise ValueError(f"request {r.sample_id}: {len(r.sigmas)} sigmas for {r.num_inference_steps} steps "
                         "(need num_inference_steps + 1, terminal 0 included)")
    if any(not 0 <= i < r.num_inference_steps for i in r.sde_indices):
        raise ValueError(f"request {r.sample_id}: sde_indices {r.sde_indices} outside 0..{r.num_inference_steps - 1}")
    if r.sde_type not in SDE_TYPES:
        raise ValueError(f"request {r.sample_id}: sde_type {r.sde_type!r} not one of {SDE_TYPES}")


def check_names_shapes(named_tensors: list[tuple[str, Any]], known: dict[str, Any], kind: str) -> None:
    """Raise WeightSyncError unless every sent name is one of `known` (name -> tensor of the engine,
    or anything with a .shape), with the same shape, and no name is sent twice."""
    unknown = [n for n, _ in named_tensors if n not in known]
    if unknown:
        raise WeightSyncError(f"{kind} sync: {len(unknown)} tensor name(s) the engine's transformer does not have, "
                              f"e.g. {unknown[:3]}; strip wrapper segments (core.names.strip_wrapper_segments) "
                              "and map names with the adapter's weight_name_map")
    bad = [(n, tuple(t.shape), tuple(known[n].shape)) for n, t in named_tensors
           if tuple(t.shape) != tuple(known[n].shape)]
    if bad:
        raise WeightSyncError(f"{kind} sync: shape mismatch for {len(bad)} tensor(s), e.g. "
                              + "; ".join(f"{n}: got {g}, engine {e}" for n, g, e in bad[:3]))
    seen: set[str] = set()
    dup = [n for n, _ in named_tensors if n in seen or seen.add(n)]
    if dup:
        raise WeightSyncError(f"{kind} sync: duplicate tensor names {dup[:3]}")

#: memory tags -> module names, for release_memory / resume_memory ("weights" = the transformer)
MEMORY_TAGS = {"weights": "transformer", "transformer": "transformer", "text_encoder": "text_encoder", "vae": "vae"}
ENGINE_MODULES = ("transformer", "text_encoder", "vae")


class EngineMemoryState:
    """The residency bookkeeping both shipped engines share: which of their modules
    (`transformer`, `text_encoder`, `vae` attributes) are on the device (`self._resident`), tag
    resolution, placement verification and the policy-version label."""

    _resident: dict[str, bool]
    policy_version: int

    def commit_weight_version(self, version: int) -> None:
        """Make `version` the engine's policy_version (after the caller's verification)."""
        self.policy_version = int(version)

    def _modules_for(self, tags: Iterable[str] | None) -> list[str]:
        if tags is None:
            return list(ENGINE_MODULES)
        out = []
        for tag in tags:
            if tag not in MEMORY_TAGS:
                raise ValueError(f"unknown memory tag {tag!r}; use {sorted(MEMORY_TAGS)}")
            if MEMORY_TAGS[tag] not in out:
                out.append(MEMORY_TAGS[tag])
        return out

    def memory_state(self) -> dict[str, bool]:
        """module name -> resident on the device."""
        return dict(self._resident)

    def _verify_placement(self, name: str, device: torch.device) -> None:
        module = getattr(self, name)
        wrong = [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
                 if t.device.type != device.type]
        if wrong:
            raise RuntimeError(f"engine {name}: {len(wrong)} tensor(s) not on {device} after a memory move, "
                               f"e.g. {wrong[:3]}; the release/resume failed (fatal)")

    def _require_resident(self, names, what: str, exc=RuntimeError) -> None:
        off = [n for n in names if not self._resident[n]]
        if off:
            raise exc(f"{what}: engine module(s) {off} are released; call resume_memory() first")
