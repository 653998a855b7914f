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
# the request lives beside the Trajectory it becomes (the families build it); re-exported here
from trainer.trajectory import EMBEDDED_GUIDANCE, RolloutRequest, Trajectory  # noqa: F401


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine class can sample, declared on the class (`capabilities`) so that preflight
    asks the engine instead of knowing each engine's limits. Every missing capability carries the
    reason preflight quotes (`reasons`, keyed "families", "true_cfg", "sde_types", "kernels",
    "ode_final_latents")."""

    #: the engine's name in messages
    name: str
    #: the --model-adapter-path dotpaths it serves; None: every family
    families: tuple[str, ...] | None = None
    #: true CFG (guidance_scale > 1: conditional and unconditional rows)
    true_cfg: bool = True
    #: the --sampling-config sde_type values it samples
    sde_types: tuple[str, ...] = ("sde", "dance", "cps", "wan")
    #: the native kernels options --rollout-compile / --rollout-precision fp8
    compile: bool = True
    fp8: bool = True
    #: takes an attention backend of its own (--sglang-attention-backend)
    attention_backend: bool = False
    #: an ODE rollout whose last step is recorded under sde_type "cps" (std 0 there), so the
    #: trajectory's last next_latents are the clean final latents --algorithm nft trains on
    ode_final_latents: bool = True
    reasons: dict[str, str] = field(default_factory=dict, hash=False)


@runtime_checkable
class RolloutEngine(Protocol):
    """In-process generation engine."""

    #: the policy version of the weights currently loaded (0 = as loaded from disk)
    policy_version: int
    #: what it can sample (a class attribute: preflight reads it without building the engine)
    capabilities: EngineCapabilities

    def generate(self, requests: list[RolloutRequest]) -> Trajectory:
        """Generate every request; one trajectory row per request, same order (trainer.trajectory:
        images, the latents before / after each trained step, timesteps, sigmas, log-probs, the
        frozen conditioning, the echoed identity and geometry, the engine's policy_version).
        The requests of one call share a geometry (check_one_geometry)."""

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



def embedded_guidance_condition(r: RolloutRequest, batch_size: int, device: Any = None) -> dict[str, torch.Tensor]:
    """{EMBEDDED_GUIDANCE: [B] fp32 filled with r.embedded_guidance} for a request that sets one,
    else {} (the entry a guidance-distilled family's velocity reads)."""
    if r.embedded_guidance is None:
        return {}
    return {EMBEDDED_GUIDANCE: torch.full((int(batch_size),), float(r.embedded_guidance), dtype=torch.float32,
                                          device=device)}


def geometry_key(r: RolloutRequest) -> tuple:
    """Candidates with equal keys can share a DiT forward and one Trajectory (same grid, schedule,
    trained steps and SDE settings)."""
    guided = float(r.guidance_scale) > 1.0
    return (r.height, r.width, r.num_inference_steps, tuple(float(s) for s in r.sigmas), tuple(r.sde_indices),
            float(r.eta), r.sde_type, float(r.sigma_max),
            None if r.init_noise_latent_shape is None else tuple(r.init_noise_latent_shape),
            float(r.guidance_scale), r.negative_prompt if guided else None, bool(r.cfg_renorm) if guided else None,
            None if r.embedded_guidance is None else float(r.embedded_guidance), len(r.media),
            int(r.num_frames))


def check_one_geometry(requests: list[RolloutRequest]) -> None:
    """Raise ValueError naming two candidates whose geometry (geometry_key) differs: one generate
    call returns one Trajectory, whose rows share it; generate once per geometry."""
    first = geometry_key(requests[0])
    for r in requests[1:]:
        if geometry_key(r) != first:
            raise ValueError(f"requests {requests[0].sample_id} and {r.sample_id} differ in geometry (size, schedule, "
                             "trained steps or SDE settings); one generate call samples one geometry, so call it "
                             "once per geometry")


def rollout_trajectory(reqs: list[RolloutRequest], *, images: torch.Tensor, latents: torch.Tensor,
                       next_latents: torch.Tensor, sigmas: torch.Tensor, sigmas_next: torch.Tensor,
                       timesteps: torch.Tensor, log_probs: torch.Tensor, sde_indices: list[int],
                       conditions: dict[str, torch.Tensor], vae_scale_factor: int,
                       policy_version: int) -> Trajectory:
    """The Trajectory of candidates `reqs` (one geometry): their identity and geometry echoed, the
    given tensors (trained steps only; sigmas / sigmas_next / timesteps [S], shared) stored as
    they are, on CPU."""
    r0, b = reqs[0], len(reqs)
    i64 = torch.int64
    return Trajectory(
        prompts=[r.prompt for r in reqs],
        sample_ids=[r.sample_id for r in reqs],
        group_indices=torch.tensor([r.group_index for r in reqs], dtype=i64),
        slots=torch.tensor([r.slot for r in reqs], dtype=i64),
        generation_seeds=[int(r.generation_seed) for r in reqs],
        policy_versions=torch.full((b,), int(policy_version), dtype=i64),
        metadata=[dict(r.metadata) for r in reqs],
        latents=latents.cpu(),
        next_latents=next_latents.cpu(),
        timesteps=timesteps.float().cpu().repeat(b, 1),
        sigmas=sigmas.float().cpu().repeat(b, 1),
        sigmas_next=sigmas_next.float().cpu().repeat(b, 1),
        log_probs=log_probs.float().cpu(),
        conditions={k: v.cpu() for k, v in conditions.items()},
        sde_indices=[int(i) for i in sde_indices],
        geometry=r0.geometry(vae_scale_factor),
        sampler=r0.sampler_settings(),
        images=images.float().cpu(),
    ).validate()


def check_request(r: RolloutRequest) -> None:
    """Raise ValueError naming the candidate if `r` is not something an engine may sample: CFG
    (the actor replays one positive-conditioned forward), no trained step, a sigma list of the
    wrong length, trained steps out of range, an unknown SDE type."""
    from trainer.sampling import SDE_TYPES, guidance_scale_problem, sigma_count_problem, trained_steps_problem

    guidance = guidance_scale_problem(r.guidance_scale)
    if guidance:
        raise ValueError(f"request {r.sample_id}: guidance_scale is {r.guidance_scale}, but {guidance}")
    for problem in (trained_steps_problem(r.sde_indices, r.num_inference_steps),
                    sigma_count_problem(r.sigmas, r.num_inference_steps)):
        if problem:
            raise ValueError(f"request {r.sample_id}: {problem}")
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
