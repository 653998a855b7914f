"""The trajectory batch: one typed shape for what an engine returns, what the update replays and
what a group sidecar stores.

B candidates, each recorded at the same S trained steps (the rollout's `sde_indices`):

    latents / next_latents   [B, S, *latent]  the latent before / after each trained step, in the
                                              engine's dtype (Qwen-Image: packed [L, C])
    timesteps                [B, S] fp32      the DiT's timestep input at each trained step
    sigmas / sigmas_next     [B, S] fp32      the schedule's sigma before / after it
    log_probs                [B, S] fp32      the sampler's log-prob of each recorded transition
    conditions               name -> [B, ...] the frozen conditioning the DiT saw (Qwen-Image:
                                              "prompt_embeds" [B, T, D], "prompt_embeds_mask" [B, T];
                                              with true CFG also "negative_prompt_embeds" / "_mask");
                                              an entry `X` with an `X_mask` partner is a padded
                                              token sequence
    images                   [B, 3, H, W] fp32 in [0, 1] on CPU ([B, F, 3, H, W] for a video,
                                              geometry.frames > 1), or None (dropped before the
                                              update; a sidecar stores none)

plus the per-candidate identity (prompt, sample id, group, slot, seed, policy version, prompt
metadata, provenance manifest) and what every row shares: the trained steps, the `Geometry` and
the `SamplerSettings` that produced them. A trajectory is self-describing: the replay reads both
from it (never from the run's recipe), so a sidecar replayed from disk or a run resumed with an
edited recipe still recomputes what its sampler computed. Row i of every field is candidate i; indexing a Trajectory with a slice
gives views (micro-batches cost no copy), with a list or an index tensor a copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

#: fields indexed along the candidate dimension
_ROW_TENSORS = ("group_indices", "slots", "policy_versions", "latents", "next_latents", "timesteps", "sigmas",
                "sigmas_next", "log_probs")
_ROW_LISTS = ("prompts", "sample_ids", "generation_seeds", "metadata")
#: fields with a trained-step column dimension ([B, S, ...])
COLUMN_FIELDS = ("latents", "next_latents", "timesteps", "sigmas", "sigmas_next", "log_probs")
#: what every row must agree on (Trajectory.cat refuses to mix them)
SHARED_FIELDS = ("sde_indices", "geometry", "sampler")


@dataclass(frozen=True)
class Geometry:
    """Where the latents live: the image size, the VAE's spatial factor, the frames of a video
    family and the conditioning media of an editing one (frames is 1 and media empty for every
    text-to-image trajectory)."""

    height: int
    width: int
    vae_scale_factor: int
    #: frames per sample (1: an image)
    frames: int = 1
    #: names of the conditioning media a candidate was generated from (e.g. a source image), in
    #: the order the family's velocity reads them; () for text-to-image
    media: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplerSettings:
    """The sampler settings a trajectory was generated with, all the replay needs beyond the
    recorded tensors: the SDE's eta / sde_type / sigma_max and true CFG (guidance_scale > 1 with
    negative_prompt and cfg_renorm; else negative_prompt None and cfg_renorm False)."""

    num_inference_steps: int
    eta: float
    sde_type: str = "sde"
    sigma_max: float = 0.99
    guidance_scale: float = 1.0
    negative_prompt: str | None = None
    cfg_renorm: bool = False
    #: a two-expert (Wan2.2 A14B) model's CFG scale of the low-noise expert; None: guidance_scale
    guidance_scale_2: float | None = None
    #: the timestep at and above which a two-expert model ran its high-noise expert (the replay
    #: picks each column's expert from its recorded timestep and this); None: one DiT
    expert_boundary: float | None = None

    @property
    def guided(self) -> bool:
        """True CFG: the conditional and unconditional rows of every candidate go through the DiT."""
        return float(self.guidance_scale) > 1.0


#: the condition name of a request's embedded_guidance: [B] fp32, one value per candidate
EMBEDDED_GUIDANCE = "guidance"


@dataclass
class RolloutRequest:
    """One candidate to generate, what a Trajectory row becomes. Built by the model adapter's
    build_rollout_request.

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
    #: > 1: true CFG with `negative_prompt` as the unconditional prompt (cfg_renorm: rescale the
    #: combined velocity to the conditional one's norm per token)
    guidance_scale: float = 1.0
    negative_prompt: str = " "
    cfg_renorm: bool = True
    #: the guidance a guidance-distilled DiT takes as an INPUT (FLUX.1-dev's `guidance`), not
    #: true CFG; None for a family without one. The engine records it as the condition
    #: EMBEDDED_GUIDANCE, so the replay feeds the DiT the value the candidate was sampled at
    embedded_guidance: float | None = None
    generation_seed: int = 1234
    metadata: dict[str, Any] = field(default_factory=dict)
    #: x_T shape override ([C, h, w] unpacked latent); None = [z_dim, *latent grid]
    init_noise_latent_shape: list[int] | None = None
    #: a two-expert model's low-noise CFG scale (None: guidance_scale) and expert boundary
    #: timestep (None: one DiT); the model adapter fills the boundary from the model directory
    guidance_scale_2: float | None = None
    expert_boundary: float | None = None
    #: the source image files of an editing candidate (absolute paths, record order); the engine
    #: encodes them with the prompt into the conditions the trajectory records. [] for t2i / t2v
    media: list[str] = field(default_factory=list)
    #: frames per candidate: 1 for an image, 4k + 1 for a video family (trainer.video)
    num_frames: int = 1

    def geometry(self, vae_scale_factor: int) -> Geometry:
        """The Geometry this candidate is sampled at under an engine's VAE factor (its frames, and
        one "image" entry in `media` per source image)."""
        return Geometry(int(self.height), int(self.width), int(vae_scale_factor), frames=int(self.num_frames),
                        media=tuple("image" for _ in self.media))

    def sampler_settings(self) -> SamplerSettings:
        """The SamplerSettings its trajectory records (negative_prompt / cfg_renorm only under true CFG)."""
        guided = float(self.guidance_scale) > 1.0
        return SamplerSettings(num_inference_steps=int(self.num_inference_steps), eta=float(self.eta),
                               sde_type=str(self.sde_type), sigma_max=float(self.sigma_max),
                               guidance_scale=float(self.guidance_scale),
                               negative_prompt=self.negative_prompt if guided else None,
                               cfg_renorm=bool(self.cfg_renorm) if guided else False,
                               guidance_scale_2=None if self.guidance_scale_2 is None or not guided
                               else float(self.guidance_scale_2),
                               expert_boundary=None if self.expert_boundary is None else float(self.expert_boundary))


@dataclass
class Trajectory:
    """B candidates' recorded trajectories (module docstring)."""

    prompts: list[str]
    sample_ids: list[str]
    group_indices: torch.Tensor
    slots: torch.Tensor
    generation_seeds: list[int]
    policy_versions: torch.Tensor
    #: prompt metadata per candidate (the prompt set's "metadata" field)
    metadata: list[dict[str, Any]]
    latents: torch.Tensor
    next_latents: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    log_probs: torch.Tensor
    conditions: dict[str, torch.Tensor]
    sde_indices: list[int]
    geometry: Geometry
    sampler: SamplerSettings
    images: torch.Tensor | None = None
    #: provenance manifest per candidate (artifacts.candidate_manifest), set by the rollout
    train_metadata: list[dict[str, Any]] | None = None
    rollout_id: int | None = None

    # -- shape ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_steps(self) -> int:
        """S, the trained steps per candidate."""
        return len(self.sde_indices)

    @property
    def prompt_embeds(self) -> torch.Tensor:
        return self.conditions["prompt_embeds"]

    @property
    def prompt_embeds_mask(self) -> torch.Tensor | None:
        return self.conditions.get("prompt_embeds_mask")

    # read-only views of the geometry and the sampler settings (replace those to change them)
    height = property(lambda self: self.geometry.height)
    width = property(lambda self: self.geometry.width)
    vae_scale_factor = property(lambda self: self.geometry.vae_scale_factor)
    num_inference_steps = property(lambda self: self.sampler.num_inference_steps)
    eta = property(lambda self: self.sampler.eta)
    sde_type = property(lambda self: self.sampler.sde_type)
    sigma_max = property(lambda self: self.sampler.sigma_max)
    guidance_scale = property(lambda self: self.sampler.guidance_scale)
    negative_prompt = property(lambda self: self.sampler.negative_prompt)
    cfg_renorm = property(lambda self: self.sampler.cfg_renorm)
    guided = property(lambda self: self.sampler.guided, doc="True CFG: the replay runs the conditional and "
                                                              "unconditional rows of every candidate.")

    @property
    def latent_dtype(self) -> str:
        return str(self.latents.dtype).replace("torch.", "")

    def validate(self) -> "Trajectory":
        """Raise ValueError naming the first candidate of a field whose shape disagrees with B
        candidates and S trained steps; returns self."""
        b, s = len(self), self.num_steps
        who = self.sample_ids[0] if self.sample_ids else "<no candidate>"
        if s < 1:
            raise ValueError(f"trajectory of {who}: no trained step (empty sde_indices); the engine must record "
                             "at least one transition")
        for name in _ROW_LISTS:
            value = getattr(self, name)
            if len(value) != b:
                raise ValueError(f"trajectory of {who}: {name} holds {len(value)} entries for {b} candidates")
        if self.train_metadata is not None and len(self.train_metadata) != b:
            raise ValueError(f"trajectory of {who}: train_metadata holds {len(self.train_metadata)} entries for {b}")
        for name in ("group_indices", "slots", "policy_versions"):
            if tuple(getattr(self, name).shape) != (b,):
                raise ValueError(f"trajectory of {who}: {name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected ({b},)")
        lat, nxt = self.latents, self.next_latents
        if lat.shape != nxt.shape or lat.dim() < 3 or tuple(lat.shape[:2]) != (b, s):
            raise ValueError(f"trajectory of {who}: latents {tuple(lat.shape)} / next_latents {tuple(nxt.shape)} "
                             f"must both be [B={b}, S={s}, ...]")
        for name in ("timesteps", "sigmas", "sigmas_next", "log_probs"):
            if tuple(getattr(self, name).shape) != (b, s):
                raise ValueError(f"trajectory of {who}: {name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected ({b}, {s})")
        if "prompt_embeds" not in self.conditions:
            raise ValueError(f"trajectory of {who}: conditions lack 'prompt_embeds' (the frozen text conditioning "
                             "the DiT saw); the actor cannot replay without it")
        if self.guided and "negative_prompt_embeds" not in self.conditions:
            raise ValueError(f"trajectory of {who}: guidance_scale {self.guidance_scale} but conditions lack "
                             "'negative_prompt_embeds'; a CFG replay needs the unconditional rows' conditioning")
        for name, t in self.conditions.items():
            if t.dim() < 1 or int(t.shape[0]) != b:
                raise ValueError(f"trajectory of {who}: condition {name} has shape {tuple(t.shape)}, expected "
                                 f"[B={b}, ...]")
        # a video's frames sit after the candidate: [B, F, 3, H, W]
        dims, layout = (4, "3, H, W") if self.geometry.frames == 1 else (5, f"F={self.geometry.frames}, 3, H, W")
        if self.images is not None and (self.images.dim() != dims or int(self.images.shape[0]) != b):
            raise ValueError(f"trajectory of {who}: images {tuple(self.images.shape)} must be [B={b}, {layout}]")
        return self

    # -- rows and columns -------------------------------------------------------------------

    def __getitem__(self, index) -> "Trajectory":
        """The candidates `index` selects (a slice: views; a list of ints or an index tensor: a
        copy), every shared field as it is."""
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(index, None)
        if isinstance(index, slice):
            pick_t = lambda t: t[index]  # noqa: E731
            pick_l = lambda v: list(v[index])  # noqa: E731
        else:
            idx = [int(i) for i in (index.tolist() if torch.is_tensor(index) else index)]
            ind = torch.tensor(idx, dtype=torch.long)
            pick_t = lambda t: t.index_select(0, ind.to(t.device))  # noqa: E731
            pick_l = lambda v: [v[i] for i in idx]  # noqa: E731
        changes: dict[str, Any] = {n: pick_t(getattr(self, n)) for n in _ROW_TENSORS}
        changes.update({n: pick_l(getattr(self, n)) for n in _ROW_LISTS})
        changes["conditions"] = {k: pick_t(v) for k, v in self.conditions.items()}
        if self.images is not None:
            changes["images"] = pick_t(self.images)
        if self.train_metadata is not None:
            changes["train_metadata"] = pick_l(self.train_metadata)
        return dataclasses.replace(self, **changes)

    def columns(self, start: int, stop: int) -> "Trajectory":
        """Trained-step columns [start, stop) of every candidate (views)."""
        changes: dict[str, Any] = {n: getattr(self, n)[:, start:stop] for n in COLUMN_FIELDS}
        changes["sde_indices"] = list(self.sde_indices[start:stop])
        return dataclasses.replace(self, **changes)

    def rows_of_group(self, group_index: int) -> list[int]:
        """Row indices of group `group_index`'s candidates, by slot."""
        rows = [i for i, g in enumerate(self.group_indices.tolist()) if g == int(group_index)]
        return sorted(rows, key=lambda i: int(self.slots[i]))

    def without_images(self) -> "Trajectory":
        return dataclasses.replace(self, images=None)

    def to(self, device, non_blocking: bool = False) -> "Trajectory":
        """Every tensor but the images on `device` (the images stay where the scorer reads them)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        changes: dict[str, Any] = {n: move(getattr(self, n)) for n in _ROW_TENSORS}
        changes["conditions"] = {k: move(v) for k, v in self.conditions.items()}
        return dataclasses.replace(self, **changes)

    def with_provenance(self, rollout_id: int | None, train_metadata: list[dict[str, Any]]) -> "Trajectory":
        return dataclasses.replace(self, rollout_id=rollout_id, train_metadata=list(train_metadata))

    # -- joining ----------------------------------------------------------------------------

    @classmethod
    def cat(cls, parts: Sequence["Trajectory"]) -> "Trajectory":
        """Concatenate trajectories of one rollout, rows in order. They must share the trained steps,
        the geometry and the sampler settings (ValueError naming a candidate otherwise); padded
        token conditions (`X` with `X_mask`) are zero-padded to the longest, their masks with 0."""
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("Trajectory.cat got no candidate")
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        for p in parts[1:]:
            for name in SHARED_FIELDS:
                if getattr(p, name) != getattr(first, name):
                    raise ValueError(f"candidates of one batch differ in {name}: {getattr(first, name)!r} "
                                     f"({first.sample_ids[0]}) vs {getattr(p, name)!r} ({p.sample_ids[0]})")
            if set(p.conditions) != set(first.conditions):
                raise ValueError(f"candidates of one batch carry different conditions: {sorted(first.conditions)} "
                                 f"vs {sorted(p.conditions)} ({p.sample_ids[0]})")
        changes: dict[str, Any] = {n: torch.cat([getattr(p, n) for p in parts]) for n in _ROW_TENSORS}
        changes.update({n: [v for p in parts for v in getattr(p, n)] for n in _ROW_LISTS})
        changes["conditions"] = {k: _cat_padded([p.conditions[k] for p in parts], k in _padded_names(first.conditions))
                                 for k in first.conditions}
        changes["images"] = (torch.cat([p.images for p in parts]) if all(p.images is not None for p in parts)
                             else None)
        changes["train_metadata"] = ([m for p in parts for m in p.train_metadata]
                                     if all(p.train_metadata is not None for p in parts) else None)
        return dataclasses.replace(first, **changes)


def _padded_names(conditions: dict[str, torch.Tensor]) -> set[str]:
    """The token-sequence conditions (those with an `_mask` partner) and their masks."""
    out = set()
    for k in conditions:
        if f"{k}_mask" in conditions:
            out.update({k, f"{k}_mask"})
    return out


def _cat_padded(tensors: list[torch.Tensor], padded: bool) -> torch.Tensor:
    if not padded or len({int(t.shape[1]) for t in tensors}) == 1:
        return torch.cat(tensors)
    t_max = max(int(t.shape[1]) for t in tensors)
    out = []
    for t in tensors:
        pad = t_max - int(t.shape[1])
        if pad:
            t = torch.cat([t, t.new_zeros((t.shape[0], pad, *t.shape[2:]))], dim=1)
        out.append(t)
    return torch.cat(out)


def trimmed_condition(conditions: dict[str, torch.Tensor], name: str, row: int) -> torch.Tensor:
    """Row `row` of condition `name`, cut after the last real token when it is a padded token
    sequence or its mask (a sidecar stores a group's conditioning at its own length)."""
    t = conditions[name][row]
    base = name[:-5] if name.endswith("_mask") and name[:-5] in conditions else name
    mask = conditions.get(f"{base}_mask")
    if mask is None:
        return t
    real = torch.nonzero(mask[row].reshape(-1)).flatten()
    return t[: int(real[-1]) + 1 if real.numel() else 0]
