"""Rollout artifacts: trajectory sidecars, PNGs, layout and retention.

Layout::

    <root>/<task>/rollout_<7 digits>/group_<8 digits>.safetensors          one sidecar per group
    <root>/<task>/rollout_<7 digits>/group_<8 digits>_sample_<4 digits>.png one image per candidate
    <root>/eval/<task>/rollout_<7 digits>/...                               evaluation, same layout
    <root>/<task>/rollout_<7 digits>/index.jsonl, index.html                which file shows which prompt

The index (write_rollout_index) names each candidate's file beside its prompt, group, slot,
reward components (and advantage, for a training rollout) and, for an edit, its source files'
names: one JSON line per group, and the same as an HTML page that shows the candidates under their
prompt in a browser. Rank 0 writes it once the rollout is scored.

A sidecar is one safetensors file with flattened namespaces (K candidates of the group, S
trained steps, L packed tokens of C channels, T text tokens of width D):

    common.slots / common.policy_versions / common.seed_hashes   [K] int64
    common.sde_indices                                          [S] int64
    common.sigmas / common.sigmas_next / common.timesteps        [S] fp32
    common.height / common.width / common.vae_scale_factor      0-d int64
    conditions.<name>                                          the group's conditioning, one row, at its own
                                                               length (Qwen-Image: prompt_embeds [T, D],
                                                               prompt_embeds_mask [T] int64; true CFG adds
                                                               negative_prompt_embeds / _mask; SD3:
                                                               prompt_embeds [T, D], pooled_prompt_embeds
                                                               [D'] and their negative_ partners)
    tracks.latents / tracks.next_latents [K, S, L, C] (sampler dtype), tracks.log_probs [K, S] fp32

and string metadata: the format tag, task, rollout id, group index, prompt, sample ids, the
sampler settings the trajectory was generated with (num_inference_steps, eta, sde_type, sigma_max,
guidance_scale, negative_prompt, cfg_renorm: what the replay reads), the geometry's frames and media
(absent in older sidecars: 1 and none), the sampling config and its fingerprint, the weight-manifest
hash, and `candidates`: one small JSON manifest per candidate (policy version, sampling
fingerprint, weight-manifest hash, sample id).

Every file is written to an exclusively created `<name>.<random>.tmp`, fsynced, then atomically
renamed (and the directory fsynced), so a crash never leaves a file under its real name that is
not complete, and a link planted in the directory is never followed.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import re
from glob import escape as glob_escape
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from trainer.core.files import TMP_SUFFIX, atomic_writer, fsync_dir
from trainer.data import recorded_metadata
from trainer.trajectory import Geometry, SamplerSettings, Trajectory, trimmed_condition

log = logging.getLogger(__name__)

SIDECAR_FORMAT = "flowgrpo-trajectory-sidecar/1"
_ROLLOUT_RE = re.compile(r"^rollout_(\d{7,})$")
REQUIRED_SIDECAR_KEYS = (
    "common.slots", "common.policy_versions", "common.seed_hashes", "common.sde_indices", "common.sigmas",
    "common.sigmas_next", "common.timesteps", "common.height", "common.width", "common.vae_scale_factor",
    "conditions.prompt_embeds",
    "tracks.latents", "tracks.next_latents", "tracks.log_probs",
)


class ArtifactError(RuntimeError):
    """An artifact file is missing, partial, corrupt or of another format; names the file."""


# ----------------------------------------------------------------------------- layout


def task_root(root, task: str, *, eval: bool = False) -> Path:
    """<root>/<task> for training rollouts, <root>/eval/<task> for evaluation.

    `task` is a relative path of plain names ("t2i", or "t2i/<eval set>" for one of several
    eval sets); anything that could leave the root ("..", an absolute path, an empty part) is
    refused, since retention deletes rollout directories under what this returns."""
    parts = str(task).replace("\\", "/").split("/")
    if str(task).startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"artifact task path {task!r} must be relative names without '.' or '..' parts: it "
                         f"would leave the artifact root {root}")
    return Path(root) / "eval" / task if eval else Path(root) / task


def rollout_dir(root, task: str, rollout_id: int, *, eval: bool = False) -> Path:
    """<root>/<task>/rollout_<7 digits> (eval: under <root>/eval/<task>)."""
    if int(rollout_id) < 0:
        raise ValueError(f"rollout id must be >= 0, got {rollout_id}")
    return task_root(root, task, eval=eval) / f"rollout_{int(rollout_id):07d}"


def sidecar_name(group_index: int) -> str:
    return f"group_{int(group_index):08d}.safetensors"


def image_name(group_index: int, slot: int) -> str:
    return f"group_{int(group_index):08d}_sample_{int(slot):04d}.png"


def sidecar_path(root, task: str, rollout_id: int, group_index: int, *, eval: bool = False) -> Path:
    return rollout_dir(root, task, rollout_id, eval=eval) / sidecar_name(group_index)


def image_path(root, task: str, rollout_id: int, group_index: int, slot: int, *, eval: bool = False) -> Path:
    return rollout_dir(root, task, rollout_id, eval=eval) / image_name(group_index, slot)


# ----------------------------------------------------------------------------- atomic writes


def atomic_write_bytes(path, data: bytes, *, overwrite: bool = False) -> Path:
    """Write `data` to `path` through an exclusively created temporary beside it -> fsync ->
    os.replace -> fsync(dir) (trainer.core.files.atomic_writer).

    On any failure the temporary is removed and nothing exists under `path` that was not there
    before; a symlink planted at any temporary name is never followed. Refuses to replace an
    existing file unless `overwrite` (two writers for one file is a bug, not something to paper
    over). The file follows the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise FileExistsError(f"{path} already exists; artifacts are never overwritten silently (remove it, or "
                              "use a new rollout id / output directory)")
    with atomic_writer(path) as f:
        f.write(data)
    return path


def write_sidecar(path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *,
                  overwrite: bool = False) -> Path:
    """Atomically write a safetensors file of CPU-contiguous `tensors` with str->str `metadata`."""
    from safetensors.torch import save

    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                metadata={str(k): str(v) for k, v in metadata.items()})
    return atomic_write_bytes(path, data, overwrite=overwrite)


def read_sidecar(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a sidecar. Raises ArtifactError naming the file when it is
    missing, truncated / corrupt, of another format, or lacks required keys."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        leftover = any(path.parent.glob(glob_escape(path.name) + "*" + TMP_SUFFIX)) if path.parent.is_dir() else False
        hint = " (a .tmp of it exists: the write never completed)" if leftover else ""
        raise ArtifactError(f"trajectory sidecar {path} does not exist{hint}; regenerate the rollout")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated / garbled files
        raise ArtifactError(f"trajectory sidecar {path} is corrupt or partial ({type(e).__name__}: {e}); "
                            "delete it and regenerate the rollout") from None
    if metadata.get("format") != SIDECAR_FORMAT:
        raise ArtifactError(f"{path} is not a trajectory sidecar of format {SIDECAR_FORMAT!r} "
                            f"(format={metadata.get('format')!r})")
    missing = [k for k in REQUIRED_SIDECAR_KEYS if k not in tensors]
    if missing:
        raise ArtifactError(f"trajectory sidecar {path} lacks {missing}; it was written by another version or "
                            "damaged: regenerate the rollout")
    return tensors, metadata


def quantize_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] -> uint8 = round(clamp(x, 0, 1) * 255), the quantisation of every
    image and video frame this project writes or scores; same shape, on the images' own device;
    uint8 input is returned as is.

    fp32 whatever the input dtype (bf16 converts exactly); clamp, one multiply and
    round-half-to-even are exact IEEE operations, so every device gives the same bytes."""
    if images.dtype == torch.uint8:
        return images.detach()
    return images.detach().to(torch.float32).clamp(0.0, 1.0).mul(255.0).round().to(torch.uint8)


def write_png(path, image: torch.Tensor, *, overwrite: bool = False) -> Path:
    """Atomically write a float [3, H, W] image in [0, 1] as an 8-bit RGB PNG."""
    import io

    from PIL import Image

    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"{path}: image must be [3, H, W], got {tuple(image.shape)}")
    arr = quantize_uint8(image.float()).permute(1, 2, 0).cpu().numpy()
    buf = io.BytesIO()
    Image.fromarray(arr, mode="RGB").save(buf, format="PNG")
    return atomic_write_bytes(path, buf.getvalue(), overwrite=overwrite)


# ----------------------------------------------------------------------------- group sidecars


def candidate_manifest(traj: Trajectory, row: int, *, sampling_fingerprint: str, weight_manifest_hash: str | None,
                       rollout_id: int | None) -> dict[str, Any]:
    """The small JSON manifest candidate `row` carries (train_metadata): provenance of its sample."""
    return {
        "sample_id": str(traj.sample_ids[row]),
        "group_index": int(traj.group_indices[row]),
        "slot": int(traj.slots[row]),
        "rollout_id": rollout_id,
        "policy_version": int(traj.policy_versions[row]),
        "sampling_fingerprint": sampling_fingerprint,
        "weight_manifest_hash": weight_manifest_hash,
    }


def group_sidecar_payload(traj: Trajectory, *, task: str, rollout_id: int | None, sampling: Any = None,
                          weight_manifest_hash: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of one group's sidecar from a Trajectory of its candidates (any row
    order; stored by slot). All candidates must share the prompt (and so the conditioning)."""
    from trainer.sampling import candidate_seed

    if not len(traj):
        raise ValueError("a group sidecar needs at least one candidate")
    order = sorted(range(len(traj)), key=lambda i: int(traj.slots[i]))
    g = traj[order] if order != list(range(len(traj))) else traj
    group = int(g.group_indices[0])
    if len(set(g.prompts)) != 1 or len(set(g.group_indices.tolist())) != 1:
        raise ValueError(f"candidates of group {group} disagree on prompt / group index ({g.sample_ids})")
    slots = [int(v) for v in g.slots.tolist()]
    if len(set(slots)) != len(slots):
        raise ValueError(f"group {group} has duplicate slots {slots}")
    fingerprint = _fingerprint(sampling)
    manifests = g.train_metadata or [candidate_manifest(g, i, sampling_fingerprint=fingerprint,
                                                        weight_manifest_hash=weight_manifest_hash,
                                                        rollout_id=rollout_id) for i in range(len(g))]
    i64 = torch.int64
    tensors = {
        "common.slots": g.slots.to(i64),
        "common.policy_versions": g.policy_versions.to(i64),
        "common.seed_hashes": torch.tensor([candidate_seed(seed, sid) for seed, sid in
                                            zip(g.generation_seeds, g.sample_ids)], dtype=i64),
        "common.sde_indices": torch.tensor(g.sde_indices, dtype=i64),
        "common.sigmas": g.sigmas[0].float(),
        "common.sigmas_next": g.sigmas_next[0].float(),
        "common.timesteps": g.timesteps[0].float(),
        "common.height": torch.tensor(g.height, dtype=i64),
        "common.width": torch.tensor(g.width, dtype=i64),
        "common.vae_scale_factor": torch.tensor(g.vae_scale_factor, dtype=i64),
        "tracks.latents": g.latents,
        "tracks.next_latents": g.next_latents,
        "tracks.log_probs": g.log_probs.float(),
    }
    tensors.update({f"conditions.{k}": trimmed_condition(g.conditions, k, 0) for k in g.conditions})
    metadata = {
        "format": SIDECAR_FORMAT,
        "task": task,
        "rollout_id": json.dumps(rollout_id),
        "group_index": str(group),
        "prompt": g.prompts[0],
        "prompt_metadata": json.dumps(recorded_metadata(g.metadata[0] or {}), sort_keys=True),
        "sample_ids": json.dumps([str(v) for v in g.sample_ids]),
        "generation_seeds": json.dumps([int(v) for v in g.generation_seeds]),
        "num_inference_steps": str(int(g.num_inference_steps)),
        "eta": repr(float(g.eta)),
        "sde_type": str(g.sde_type),
        "sigma_max": repr(float(g.sigma_max)),
        "guidance_scale": repr(float(g.guidance_scale)),
        "negative_prompt": json.dumps(g.negative_prompt),
        "cfg_renorm": json.dumps(bool(g.cfg_renorm)),
        "guidance_scale_2": json.dumps(g.sampler.guidance_scale_2),
        "expert_boundary": json.dumps(g.sampler.expert_boundary),
        "frames": str(int(g.geometry.frames)),
        "media": json.dumps(list(g.geometry.media)),
        "latent_dtype": g.latent_dtype,
        "sampling": json.dumps(sampling.to_dict() if hasattr(sampling, "to_dict") else None, sort_keys=True),
        "sampling_fingerprint": fingerprint,
        "weight_manifest_hash": json.dumps(weight_manifest_hash),
        "policy_version": str(int(g.policy_versions.max())),
        "candidates": json.dumps(manifests, sort_keys=True),
    }
    return tensors, metadata


def write_group_sidecar(path, traj: Trajectory, *, task: str, rollout_id: int | None, sampling: Any = None,
                        weight_manifest_hash: str | None = None, overwrite: bool = False) -> Path:
    """Build and atomically write one group's sidecar (group_sidecar_payload + write_sidecar)."""
    tensors, metadata = group_sidecar_payload(traj, task=task, rollout_id=rollout_id, sampling=sampling,
                                              weight_manifest_hash=weight_manifest_hash)
    return write_sidecar(path, tensors, metadata, overwrite=overwrite)


def sidecar_to_trajectory(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Trajectory:
    """The Trajectory (without images) a sidecar stores, slot order; the group's conditioning
    repeated on every row. What the actor replays from it equals what it replays from the
    rollout's own trajectory."""
    sample_ids = json.loads(metadata["sample_ids"])
    k = len(sample_ids)
    seeds = json.loads(metadata.get("generation_seeds", "null")) or [0] * k
    manifests = json.loads(metadata.get("candidates", "[]"))
    per_step = lambda name: tensors[name].float().reshape(1, -1).repeat(k, 1)  # noqa: E731
    conditions = {name.split(".", 1)[1]: t.unsqueeze(0).repeat(k, *([1] * t.dim()))
                  for name, t in tensors.items() if name.startswith("conditions.")}
    return Trajectory(
        prompts=[metadata["prompt"]] * k,
        sample_ids=[str(v) for v in sample_ids],
        group_indices=torch.full((k,), int(metadata["group_index"]), dtype=torch.int64),
        slots=tensors["common.slots"].to(torch.int64),
        generation_seeds=[int(v) for v in seeds],
        policy_versions=tensors["common.policy_versions"].to(torch.int64),
        metadata=[json.loads(metadata.get("prompt_metadata", "{}")) for _ in range(k)],
        latents=tensors["tracks.latents"],
        next_latents=tensors["tracks.next_latents"],
        timesteps=per_step("common.timesteps"),
        sigmas=per_step("common.sigmas"),
        sigmas_next=per_step("common.sigmas_next"),
        log_probs=tensors["tracks.log_probs"].float(),
        conditions=conditions,
        sde_indices=[int(i) for i in tensors["common.sde_indices"].tolist()],
        geometry=Geometry(int(tensors["common.height"]), int(tensors["common.width"]),
                          int(tensors["common.vae_scale_factor"]), frames=int(metadata.get("frames", "1")),
                          media=tuple(json.loads(metadata.get("media", "[]")))),
        sampler=sidecar_sampler_settings(metadata),
        train_metadata=manifests if len(manifests) == k else None,
        rollout_id=json.loads(metadata.get("rollout_id", "null")),
    ).validate()


def sidecar_sampler_settings(metadata: Mapping[str, str]) -> SamplerSettings:
    """The SamplerSettings a sidecar's metadata records (frames / media, added later, default to
    an image without conditioning media). A sidecar without its eta, sde_type or step count
    cannot be replayed (the sampler's log-probs depend on them): ValueError naming them."""
    missing = [k for k in ("num_inference_steps", "eta", "sde_type") if k not in metadata]
    if missing:
        raise ValueError(f"trajectory sidecar metadata lacks {missing}: the sampler settings that produced it are "
                         "unknown, so it cannot be replayed; regenerate the rollout")
    return SamplerSettings(num_inference_steps=int(metadata["num_inference_steps"]), eta=float(metadata["eta"]),
                           sde_type=metadata["sde_type"], sigma_max=float(metadata.get("sigma_max", "0.99")),
                           guidance_scale=float(metadata.get("guidance_scale", "1.0")),
                           negative_prompt=json.loads(metadata.get("negative_prompt", "null")),
                           cfg_renorm=bool(json.loads(metadata.get("cfg_renorm", "false"))),
                           guidance_scale_2=_optional_float(metadata.get("guidance_scale_2", "null")),
                           expert_boundary=_optional_float(metadata.get("expert_boundary", "null")))


def _optional_float(text: str) -> float | None:
    """A sidecar's JSON number or null (a two-expert model's settings; absent in older sidecars)."""
    value = json.loads(text)
    return None if value is None else float(value)


def _fingerprint(sampling: Any) -> str:
    if sampling is None:
        return ""
    if hasattr(sampling, "fingerprint"):
        return sampling.fingerprint()
    from trainer.sampling import parse_sampling_config

    return parse_sampling_config(sampling).fingerprint()


# ----------------------------------------------------------------------------- rollout dirs, retention


def list_rollout_dirs(root, task: str, *, eval: bool = False) -> list[tuple[int, Path]]:
    """(rollout id, dir) of every rollout_<digits> directory of the task, ascending id. Other
    entries are ignored (and never deleted)."""
    base = task_root(root, task, eval=eval)
    if not base.is_dir():
        return []
    out = []
    for entry in base.iterdir():
        m = _ROLLOUT_RE.match(entry.name)
        if m and entry.is_dir():
            out.append((int(m.group(1)), entry))
    return sorted(out)


def prune_stale_artifacts(root, task: str, keep: int, *, eval: bool = False, up_to: int | None = None) -> list[Path]:
    """Delete all but the `keep` newest rollout directories (by rollout id) of the task;
    keep <= 0 keeps everything. Returns the removed directories.

    Called at the start of a rollout after its own directory exists, with up_to = its id, so
    `keep` counts it: afterwards exactly `keep` rollouts up to it remain
    (--artifact-retention-rollouts). Directories of later ids (left by an attempt that got
    further before a resume from an earlier checkpoint) are neither counted nor removed here:
    counted, they would make the resumed run reap its own newest rollouts; prepare_rollout_dir
    replaces each when the run reaches its id.

    A directory that cannot be removed is logged as an error and left (the run goes on; the next
    call tries again), the rule checkpoint rotation follows too: only new outputs are essential."""
    if keep <= 0:
        return []
    dirs = [(i, d) for i, d in list_rollout_dirs(root, task, eval=eval) if up_to is None or i <= up_to]
    stale = [d for _, d in dirs[:-keep]] if len(dirs) > keep else []
    removed = []
    for d in stale:
        try:
            shutil.rmtree(d)
        except OSError as e:  # cleanup of old outputs never stops a run (like checkpoint rotation)
            log.error("artifact retention could not remove %s (it stays; the next rollout tries again): %r", d, e)
            continue
        removed.append(d)
        log.debug("artifact retention: removed %s", d)
    return removed


def prepare_rollout_dir(root, task: str, rollout_id: int, *, eval: bool = False) -> Path:
    """Create the rollout's directory, empty. Files left there by an earlier attempt at the same
    rollout id (a run resumed from a checkpoint before it) are stale and are removed, with a
    warning naming them."""
    d = rollout_dir(root, task, rollout_id, eval=eval)
    if d.exists():
        leftovers = sorted(p.name for p in d.iterdir())
        if leftovers:
            log.warning("replacing %d artifact file(s) of an earlier attempt at %s (e.g. %s)", len(leftovers), d,
                        leftovers[:3])
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=False)
    return d


def iter_sidecars(directory) -> Iterable[Path]:
    """The complete sidecars of a rollout directory (no .tmp leftovers), by group index."""
    return sorted(p for p in Path(directory).glob("group_*.safetensors") if p.is_file())


# ----------------------------------------------------------------------------- rollout index

INDEX_JSONL = "index.jsonl"
INDEX_HTML = "index.html"
#: characters of a prompt the index keeps (its sidecar keeps it whole): enough to tell prompts
#: apart, and a group's entry stays a few KB however long the prompt file's lines are
INDEX_PROMPT_CHARS = 1000


def _cut(text: str, limit: int = INDEX_PROMPT_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def _score(value: Any) -> float | None:
    """A finite score as a float; None for NaN / inf (a failed group), which JSON cannot hold."""
    v = float(value)
    return v if math.isfinite(v) else None


def rollout_index(groups: Sequence[tuple[str, Sequence[str]]], group_size: int,
                  components: Mapping[str, torch.Tensor], advantages: torch.Tensor | None = None, *,
                  media_name: Callable[[int, int], str] = image_name) -> list[dict[str, Any]]:
    """One entry per group of a rollout: {"group", "prompt" (cut to INDEX_PROMPT_CHARS), "sources"
    (the source files' names, no directories: an edit's, else []), "sidecar", "candidates": [{"slot",
    "file", "scores": {component: value or None}, "advantage" (with `advantages`)}]}.

    groups: (prompt, source paths) per group, in group order; components / advantages: the
    rollout's gathered [num_groups * group_size] vectors, candidate g * group_size + slot; media_name:
    the candidate's file name (image_name, or trainer.video_artifacts.video_name for a video)."""
    entries = []
    for g, (prompt, sources) in enumerate(groups):
        candidates = []
        for slot in range(int(group_size)):
            i = g * int(group_size) + slot
            cand: dict[str, Any] = {"slot": slot, "file": media_name(g, slot),
                                    "scores": {str(c): _score(v[i]) for c, v in sorted(components.items())}}
            if advantages is not None:
                cand["advantage"] = _score(advantages[i])
            candidates.append(cand)
        entries.append({"group": g, "prompt": _cut(prompt), "sources": [os.path.basename(str(p)) for p in sources],
                        "sidecar": sidecar_name(g), "candidates": candidates})
    return entries


# no script, no frame, no request beyond the page's own images: the page quotes prompts from an
# untrusted prompt file, so besides escaping them it forbids what a missed escape could use
_INDEX_CSP = "default-src 'none'; img-src 'self' file:; style-src 'unsafe-inline'"
_INDEX_STYLE = ("body{font:14px sans-serif;margin:1em}section{margin-bottom:1.5em}"
                ".prompt{background:#eee;padding:.4em;white-space:pre-wrap}figure{display:inline-block;"
                "margin:0 .5em .5em 0;vertical-align:top}img{height:192px;image-rendering:pixelated}"
                "figcaption{font-size:12px;max-width:256px}")


def index_html(entries: Sequence[Mapping[str, Any]], title: str) -> str:
    """The index as a page: per group its prompt, its source names, then its candidates' files as
    images 192 px high (a tiny image enlarged pixel for pixel; a click opens the file at its own
    size), each captioned with its slot and scores. Every text from outside (prompts, file and
    component names) is HTML-escaped."""
    esc = lambda v: html.escape(str(v), quote=True)  # noqa: E731

    def caption(c: Mapping[str, Any]) -> str:
        parts = [f"s{c['slot']}"] + [f"{esc(k)}={'n/a' if v is None else f'{v:.4g}'}" for k, v in c["scores"].items()]
        if "advantage" in c:
            parts.append(f"adv={'n/a' if c['advantage'] is None else format(c['advantage'], '.3g')}")
        return " ".join(parts)

    out = ['<!doctype html>', '<html><head><meta charset="utf-8">',
           f'<meta http-equiv="Content-Security-Policy" content="{_INDEX_CSP}">',
           f'<title>{esc(title)}</title><style>{_INDEX_STYLE}</style></head><body>', f'<h1>{esc(title)}</h1>']
    for e in entries:
        out.append(f'<section id="group-{int(e["group"])}"><h2>group {int(e["group"])}</h2>'
                   f'<p class="prompt">{esc(e["prompt"])}</p>')
        if e["sources"]:
            out.append(f'<p>source: {esc(", ".join(e["sources"]))}</p>')
        for c in e["candidates"]:
            out.append(f'<figure><a href="{esc(c["file"])}"><img src="{esc(c["file"])}" alt="{esc(c["file"])}" '
                       f'loading="lazy"></a><figcaption>{caption(c)}</figcaption></figure>')
        out.append('</section>')
    out.append('</body></html>')
    return "\n".join(out) + "\n"


def write_rollout_index(directory, entries: Sequence[Mapping[str, Any]], *, title: str) -> tuple[Path, Path]:
    """Write a rollout's index.jsonl (one entry of rollout_index per line, ASCII: a prompt's line
    or paragraph separators are escaped, so every reader splits lines alike) and index.html
    (index_html) into its directory, each atomically (atomic_write_bytes: never a partial file
    under its name, never through a planted link; an existing index is refused). Their names are
    fixed: nothing in a prompt chooses a file name."""
    directory = Path(directory)
    lines = "".join(json.dumps(e, sort_keys=True, ensure_ascii=True) + "\n" for e in entries)
    jsonl = atomic_write_bytes(directory / INDEX_JSONL, lines.encode("ascii"))
    page = atomic_write_bytes(directory / INDEX_HTML, index_html(entries, title).encode("utf-8"))
    return jsonl, page
