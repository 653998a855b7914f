"""A pinned evaluation: the base model and candidates (checkpoints, exports) on named prompt sets.

    evaluate  every rank: per candidate, per set, the trainer's eval call (generate_rollout with
              eval=True) on this rank's share of fixed engine batches (eval_batches), each
              candidate a pure function of (weights, prompt, sample id, seed), each scorer on this
              rank's images, the scores gathered into the set's [prompts x samples] table,
              thumbnails gathered to rank 0;
    summarise rank 0: per scorer the mean over the finite scores with a seeded 95% bootstrap
              interval (prompts resampled: a prompt's samples share its difficulty), the paired
              win rate against the base (same prompt, same seed), a per-prompt table;
    write     rank 0: report.json (tools), report.md with one PNG grid per set and candidate
              (people), in the output directory the caller staged.

Every figure depends on the scores only, and each score on its candidate and its engine batch,
which no world size changes, so the report is the same on any world size, to the bit (tests
compare 1 and 2 ranks), and equal to the trainer's own eval at world size 1 with the same engine
batch size.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

#: the report's format; a reader refuses another
REPORT_VERSION = 1
#: prompts per set drawn in a candidate's grid (one row each), and samples per prompt shown
GRID_PROMPTS = 8
GRID_SAMPLES = 4
#: per-prompt rows in the Markdown page (the JSON holds them all)
PAGE_PROMPTS = 64


@dataclass(frozen=True)
class Candidate:
    """One set of weights to evaluate: the base pipeline `model_path`, with the PEFT adapter
    `lora_dir` on top (None: the pipeline as it is). `source` says what the user named."""

    name: str
    model_path: str
    lora_dir: str | None
    source: dict[str, Any]


@dataclass(frozen=True)
class Settings:
    """What the numbers depend on besides the weights: recorded in the report, and equal
    settings are what makes two reports comparable."""

    task: str
    sampling: Any  # trainer.sampling.SamplingConfig
    n_samples: int
    generation_seed: int
    scorers: tuple[tuple[str, str | None], ...]
    #: candidates per engine batch (eval_batches): the last bits of a score depend on its batch
    engine_batch_size: int
    #: the engine's compute dtype and its options (text window, FP8, compiled blocks): they change the samples
    engine_dtype: str
    engine_options: dict[str, Any]
    bootstrap_seed: int
    bootstrap_resamples: int

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "sampling_config": self.sampling.to_dict(),
                "sampling_fingerprint": self.sampling.fingerprint(), "n_samples_per_prompt": self.n_samples,
                "generation_seed": self.generation_seed, "engine_batch_size": self.engine_batch_size,
                "engine_dtype": self.engine_dtype, "engine_options": dict(self.engine_options),
                "scorers": [{"scorer": s, "model_path": p} for s, p in self.scorers],
                "bootstrap": {"seed": self.bootstrap_seed, "resamples": self.bootstrap_resamples, "level": 0.95}}


# ---------------------------------------------------------------------------------------------
# statistics: pure functions of a [prompts, samples] table of scores (NaN: not scored)

def _prompt_sums(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    finite = np.isfinite(values)
    return np.where(finite, values, 0.0).sum(axis=1), finite.sum(axis=1).astype(np.float64)


def _resampled_ratio(sums: np.ndarray, counts: np.ndarray, seed: int, resamples: int) -> np.ndarray:
    """The ratio sum(sums) / sum(counts) over `resamples` draws of the prompts with replacement
    (numpy's PCG64 seeded with `seed`: the same draws on every machine); draws with no count
    are left out."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(sums), size=(resamples, len(sums)))
    num, den = sums[idx].sum(axis=1), counts[idx].sum(axis=1)
    ok = den > 0
    return num[ok] / den[ok]


def bootstrap_mean(values: np.ndarray, seed: int, resamples: int = 1000) -> dict[str, float | int]:
    """{"mean", "lo", "hi", "n"}: the mean of the finite entries of `values` [P, K] (P prompts, K
    samples each; float64) and its 95% percentile bootstrap interval, the P prompts resampled
    with replacement (a cluster bootstrap: samples of one prompt are not independent). NaN
    everywhere when no entry is finite."""
    values = np.asarray(values, dtype=np.float64)
    sums, counts = _prompt_sums(values)
    n = int(counts.sum())
    if n == 0:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    draws = _resampled_ratio(sums, counts, seed, resamples)
    lo, hi = np.quantile(draws, [0.025, 0.975])
    return {"mean": float(sums.sum() / n), "lo": float(lo), "hi": float(hi), "n": n}


def paired_win_rate(candidate: np.ndarray, base: np.ndarray, seed: int, resamples: int = 1000) -> dict[str, Any]:
    """The candidate against the base on the same (prompt, seed) pairs, both [P, K]: a pair
    where both are finite counts 1 when the candidate scores higher, 1/2 on a tie, 0 lower.
    {"win_rate", "lo", "hi" (95% bootstrap over prompts, as bootstrap_mean), "wins", "ties",
    "losses", "pairs"}; NaN rates without a pair."""
    c, b = np.asarray(candidate, dtype=np.float64), np.asarray(base, dtype=np.float64)
    both = np.isfinite(c) & np.isfinite(b)
    outcome = np.where(both, np.where(c > b, 1.0, np.where(c == b, 0.5, 0.0)), np.nan)
    out = bootstrap_mean(outcome, seed, resamples)
    return {"win_rate": out["mean"], "lo": out["lo"], "hi": out["hi"],
            "wins": int(((c > b) & both).sum()), "ties": int(((c == b) & both).sum()),
            "losses": int(((c < b) & both).sum()), "pairs": int(both.sum())}


def summarise(scores: dict[str, dict[str, dict[str, np.ndarray]]], base: str, seed: int,
              resamples: int) -> dict[str, dict[str, dict[str, Any]]]:
    """{set: {candidate: {component: {mean, lo, hi, n, win_rate_vs_base?}}}} of
    scores[set][candidate][component] ([P, K] each). The base has no win rate."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for set_name, by_cand in scores.items():
        out[set_name] = {}
        for cand, comps in by_cand.items():
            out[set_name][cand] = {}
            for comp, v in comps.items():
                row: dict[str, Any] = bootstrap_mean(v, seed, resamples)
                if cand != base and comp in by_cand[base]:
                    row["win_rate_vs_base"] = paired_win_rate(v, by_cand[base][comp], seed, resamples)
                out[set_name][cand][comp] = row
    return out


# ---------------------------------------------------------------------------------------------
# the distributed part: every rank calls these

def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def eval_batches(num_prompts: int, group_size: int, batch: int, rank: int, world_size: int) -> list[list[tuple[int, int]]]:
    """This rank's engine batches of an eval: the group-major list of every (prompt, sample)
    cut into batches of `batch` candidates (<= 0: one batch of all) from its start, batch i
    generated by rank i mod world_size. The batches are the same on every world size, and the
    same as the engine's own chunks of one process holding them all (the trainer's eval at world
    size 1): the engine's floats depend on a batch's rows and padded text length (~1e-7), so a
    world-size-dependent cut would change the last bits of the scores."""
    pairs = [(g, s) for g in range(num_prompts) for s in range(group_size)]
    step = batch if batch > 0 else max(len(pairs), 1)
    chunks = [pairs[i:i + step] for i in range(0, len(pairs), step)]
    return chunks[rank::world_size]


def _write_media(out_dir: Path, traj: Any) -> None:
    """Each candidate's PNG (a video's animated WebP) under `out_dir`, named as a rollout's."""
    from trainer import artifacts
    from trainer.video_artifacts import video_name, write_video

    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(len(traj)):
        g, s, media = int(traj.group_indices[i]), int(traj.slots[i]), traj.images[i]
        if media.dim() == 4:
            write_video(out_dir / video_name(g, s), media)
        else:
            artifacts.write_png(out_dir / artifacts.image_name(g, s), media)


@torch.no_grad()
def evaluate_candidate(engine: Any, adapter: Any, managers: Sequence[Any], sets: dict[str, Any],
                       settings: Settings, media_root: Path | None, rank: int, world_size: int) -> dict[str, Any]:
    """One candidate's weights (loaded in `engine`) on every set: this rank's eval_batches, each
    through the trainer's eval call (generate_rollout with eval=True), scored by every manager as
    Trainer.evaluate scores; the scores gathered. Collective. Returns {set: {"scores":
    {component: [P, K] float64} on every rank, "thumbs": the loop's _Thumb of the first
    GRID_PROMPTS prompts on rank 0, "sde_indices"}}; each candidate's image under
    media_root/<set>/ (None: none written)."""
    from trainer.loop import _eval_thumbnails, _scorer_inputs, gather_to_rank0, take_sources
    from trainer.rewards.post_process import gather_scores
    from trainer.rollout import generate_rollout
    from trainer.trajectory import Trajectory

    n = settings.n_samples
    out: dict[str, Any] = {}
    for name, ds in sets.items():
        records = [ds[i] for i in range(len(ds))]
        parts, sources, idx, sde_indices = [], {}, [], None
        for chunk in eval_batches(len(records), n, int(getattr(engine, "max_batch_size", 0)), rank, world_size):
            res = generate_rollout(engine, adapter, records, rollout_id=0, sampling=settings.sampling, group_size=n,
                                   generation_seed=settings.generation_seed, artifact_root=None, eval=True,
                                   rank=rank, world_size=world_size, candidates=chunk)
            parts.append(res.trajectory)
            sources.update(take_sources(engine))
            idx += [g * n + s for g, s in res.candidates]
            sde_indices = list(res.sde_indices)
        traj = Trajectory.cat(parts) if parts else None
        if traj is not None and media_root is not None:
            _write_media(media_root / name, traj)
        inputs = _scorer_inputs(traj, sources)
        comps: dict[str, torch.Tensor] = {}
        for manager in managers:
            part = gather_scores(manager.score(*inputs).components, idx, len(records) * n)
            comps.update({c: v for c, v in part.items() if c not in comps})  # the first scorer's name wins
        thumbs = [t for part in gather_to_rank0(_eval_thumbnails(traj, GRID_PROMPTS, inputs[2]))
                  for t in part if t.slot < GRID_SAMPLES]
        out[name] = {"scores": {c: v.double().reshape(len(records), n).numpy() for c, v in comps.items()},
                     "thumbs": thumbs, "sde_indices": sde_indices}
    return out


# ---------------------------------------------------------------------------------------------
# the report: rank 0

def _fmt(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.4f}"


def _finite_or_none(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def _jsonable(x: Any) -> Any:
    """NaN / inf -> None, so the report is strict JSON."""
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return _finite_or_none(x)
    return x


def draw_grid(set_name: str, cand: str, base: str, prompts: list[str], thumbs: dict[str, list],
              scores: dict[str, dict[str, np.ndarray]], component: str | None, output: Path) -> Path:
    """One PNG: a row per prompt (the first GRID_PROMPTS), its source image(s) for an edit, the
    base's first GRID_SAMPLES samples and then the candidate's (the same seeds), each captioned
    with its score on `component`; a video sample is its frame strip. For the base alone, its
    samples only."""
    from PIL import Image

    from trainer.core.files import atomic_writer
    from trainer.metrics import prompt_rows_grid

    sides = [base] if cand == base else [base, cand]
    by = {s: {(t.group, t.slot): t for t in thumbs[s]} for s in sides}
    rows = []
    for g, prompt in enumerate(prompts[:GRID_PROMPTS]):
        images, captions = [], []
        first = next((t for t in thumbs[cand] if t.group == g and t.sources), None)
        for caption, im in (first.sources if first else ()):
            images.append(im)
            captions.append(caption)
        for side in sides:
            for slot in range(GRID_SAMPLES):
                t = by[side].get((g, slot))
                if t is None:
                    continue
                v = scores[side][component][g, slot] if component else math.nan
                images.append(t.image)
                captions.append(f"{side} s{slot}" + (f" {component}={v:.3f}" if component else ""))
        if images:
            rows.append((f"{g}: {prompt}", images, captions))
    video = any(t.video for side in sides for t in thumbs[side])
    grid = prompt_rows_grid(rows, **({"tile_side": None} if video else {}))
    with atomic_writer(output) as f:
        Image.fromarray(grid).save(f, format="PNG")
    return output


def grid_name(set_name: str, cand: str) -> str:
    return f"grid_{set_name}_{cand}.png"


def build_report(settings: Settings, sets: dict[str, Any], candidates: Sequence[Candidate],
                 results: dict[str, dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON report (see docs/evaluation.md for its fields)."""
    base = candidates[0].name
    scores = {s: {c.name: results[c.name][s]["scores"] for c in candidates} for s in sets}
    summary = summarise(scores, base, settings.bootstrap_seed, settings.bootstrap_resamples)
    out_sets = {}
    for s, ds in sets.items():
        prompts = [ds[i].prompt for i in range(len(ds))]
        per_prompt = [{"index": g, "prompt": p,
                       "scores": {c.name: {comp: [_finite_or_none(x) for x in v[g]]
                                           for comp, v in scores[s][c.name].items()} for c in candidates}}
                      for g, p in enumerate(prompts)]
        out_sets[s] = {"path": str(Path(ds.path).resolve()), "sha256": file_sha256(ds.path), "prompts": len(prompts),
                       "sde_indices": results[base][s]["sde_indices"],
                       "summary": summary[s], "per_prompt": per_prompt,
                       "grids": {c.name: grid_name(s, c.name) for c in candidates}}
    return _jsonable({"report_version": REPORT_VERSION, "settings": settings.to_dict(), "base": base,
                      # a checkpoint's export lived in a temporary directory: its source names it
                      "candidates": [{"name": c.name, "source": c.source,
                                      "model_path": None if c.source["kind"] == "checkpoint" else c.model_path}
                                     for c in candidates], "sets": out_sets, **extra})


def markdown_page(report: dict[str, Any]) -> str:
    """report.md: the settings, per set a table of every candidate's mean [95% interval] and win
    rate against the base per component, the grids, and the per-prompt means."""
    st = report["settings"]
    sc = st["sampling_config"]
    shape = f"{sc['height']} x {sc['width']}" + (f", {sc.get('num_frames')} frames" if st["task"] == "t2v" else "")
    lines = ["# Evaluation", "",
             f"Task `{st['task']}`, {shape}, {sc['num_inference_steps']} steps, guidance {sc['guidance_scale']}, "
             f"{st['n_samples_per_prompt']} samples per prompt, generation seed {st['generation_seed']}; scorers "
             + ", ".join(f"`{s['scorer']}`" for s in st["scorers"])
             + f". Intervals: 95% bootstrap over prompts ({st['bootstrap']['resamples']} resamples, seed "
             f"{st['bootstrap']['seed']}). Win rate: the share of (prompt, seed) pairs where the candidate scores "
             f"above the base `{report['base']}` (a tie counts half).", "",
             "| candidate | weights |", "|---|---|"]
    for c in report["candidates"]:
        src = c["source"]
        where = f"`{src.get('path') or c['model_path']}`"  # the base has no source path
        if src.get("iteration") is not None:
            where += f" (iteration {src['iteration']})"
        lines.append(f"| {c['name']} | {src.get('kind')}: {where} |")
    for s, body in report["sets"].items():
        lines += ["", f"## Set `{s}` ({body['prompts']} prompts, `{Path(body['path']).name}`)", "",
                  "| candidate | component | mean | 95% interval | win rate vs base | wins / ties / losses |",
                  "|---|---|---|---|---|---|"]
        for cand, comps in body["summary"].items():
            for comp, row in sorted(comps.items()):
                win = row.get("win_rate_vs_base")
                wr = f"{_fmt(win['win_rate'])} [{_fmt(win['lo'])}, {_fmt(win['hi'])}]" if win else "-"
                wtl = f"{win['wins']} / {win['ties']} / {win['losses']}" if win else "-"
                lines.append(f"| {cand} | {comp} | {_fmt(row['mean'])} | [{_fmt(row['lo'])}, {_fmt(row['hi'])}] "
                             f"| {wr} | {wtl} |")
        for cand, png in body["grids"].items():
            if cand == report["base"] and len(body["grids"]) > 1:
                continue  # each candidate's grid shows the base beside it
            title = "the base" if cand == report["base"] else f"{report['base']} (left) vs {cand} (right)"
            lines += ["", f"![{s}: {title}]({png})"]
        comps = sorted({c for row in body["summary"].values() for c in row})
        cands = list(body["summary"])
        lines += ["", "Per prompt (mean over its samples):", "",
                  "| # | prompt | " + " | ".join(f"{c} {k}" for k in comps for c in cands) + " |",
                  "|---|---|" + "---|" * (len(comps) * len(cands))]
        for row in body["per_prompt"][:PAGE_PROMPTS]:
            cells = []
            for k in comps:
                for c in cands:
                    v = [x for x in row["scores"][c].get(k, []) if x is not None]
                    cells.append(_fmt(sum(v) / len(v)) if v else "n/a")
            text = " ".join(row["prompt"].split())[:200].replace("|", "\\|").replace("<", "&lt;")
            lines.append(f"| {row['index']} | {text} | " + " | ".join(cells) + " |")
        if body["prompts"] > PAGE_PROMPTS:
            lines.append(f"\n(the first {PAGE_PROMPTS} of {body['prompts']} prompts; report.json has them all)")
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, report: dict[str, Any], sets: dict[str, Any], candidates: Sequence[Candidate],
                 results: dict[str, dict[str, Any]]) -> None:
    """report.json, the grids and report.md into `out_dir`, each file written atomically."""
    from trainer.core.files import atomic_writer

    base = candidates[0].name
    for s, ds in sets.items():
        prompts = [ds[i].prompt for i in range(len(ds))]
        thumbs = {c.name: results[c.name][s]["thumbs"] for c in candidates}
        scores = {c.name: results[c.name][s]["scores"] for c in candidates}
        comp = sorted(scores[base])[0] if scores[base] else None
        for c in candidates:
            draw_grid(s, c.name, base, prompts, thumbs, scores, comp, out_dir / grid_name(s, c.name))
    with atomic_writer(out_dir / "report.json") as f:
        f.write((json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n").encode())
    with atomic_writer(out_dir / "report.md") as f:
        f.write(markdown_page(report).encode())


def comparable(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Why reports `a` and `b` cannot be compared number for number (different settings or
    prompt files); [] when they can."""
    problems = []
    for r, label in ((a, "first"), (b, "second")):
        if r.get("report_version") != REPORT_VERSION:
            problems.append(f"the {label} report has report_version {r.get('report_version')!r}, not {REPORT_VERSION}")
    if problems:
        return problems
    for key in sorted(set(a["settings"]) | set(b["settings"])):
        if key != "bootstrap" and a["settings"].get(key) != b["settings"].get(key):
            problems.append(f"settings.{key} differs: {a['settings'].get(key)!r} vs {b['settings'].get(key)!r}")
    for s in sorted(set(a["sets"]) & set(b["sets"])):
        if a["sets"][s]["sha256"] != b["sets"][s]["sha256"]:
            problems.append(f"set {s!r} was evaluated on different prompt files")
    if not set(a["sets"]) & set(b["sets"]):
        problems.append("the reports share no prompt set name")
    return problems


def compare_reports(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> str:
    """A Markdown table of two comparable reports (comparable() == []): per shared set,
    candidate and component, each report's mean [95% interval] and win rate against its base,
    and the paired win rate of B's candidate over A's where both evaluated the same name (the
    same prompts and seeds: the settings are equal)."""
    st = a["settings"]
    lines = ["# Two evaluations compared", "",
             f"`{label_a}` and `{label_b}`: equal settings (task `{st['task']}`, sampling fingerprint "
             f"`{st['sampling_fingerprint'][:12]}`, seed {st['generation_seed']}, {st['n_samples_per_prompt']} "
             "samples per prompt).", ""]
    seed, resamples = st["bootstrap"]["seed"], st["bootstrap"]["resamples"]
    for s in sorted(set(a["sets"]) & set(b["sets"])):
        lines += [f"## Set `{s}`", "",
                  f"| candidate | component | {label_a}: mean [95%] | {label_b}: mean [95%] | "
                  f"{label_b} over {label_a} (paired win rate) |", "|---|---|---|---|---|"]
        sa, sb = a["sets"][s], b["sets"][s]
        for cand in [c for c in sa["summary"] if c in sb["summary"]]:
            for comp in sorted(set(sa["summary"][cand]) & set(sb["summary"][cand])):
                ra, rb = sa["summary"][cand][comp], sb["summary"][cand][comp]

                def table(report_set: dict[str, Any]) -> np.ndarray:
                    return np.array([[np.nan if x is None else x for x in row["scores"][cand][comp]]
                                     for row in report_set["per_prompt"]], dtype=np.float64)

                win = paired_win_rate(table(sb), table(sa), seed, resamples)
                lines.append(f"| {cand} | {comp} | {_fmt(ra['mean'])} [{_fmt(ra['lo'])}, {_fmt(ra['hi'])}] | "
                             f"{_fmt(rb['mean'])} [{_fmt(rb['lo'])}, {_fmt(rb['hi'])}] | "
                             f"{_fmt(win['win_rate'])} [{_fmt(win['lo'])}, {_fmt(win['hi'])}] |")
        lines.append("")
    return "\n".join(lines)
