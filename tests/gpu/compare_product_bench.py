"""The product path's steady step beside the bench's, stage by stage (tests/gpu/real_width.sh speed).

    python tests/gpu/compare_product_bench.py RUN/tensorboard BENCH.jsonl [--skip-first 2]

RUN/tensorboard may also be the run's scalars as JSON (real_width.sh saves them as
scalars-speed-MODE.json), so a stored run can be compared again without its event files.
The product figures are the medians of the run's TensorBoard series over its steady rollouts:
the first `--skip-first` rollouts (the compile, the engine's LoRA recompile), every rollout that
compiled a graph (perf/rollout_new_graphs or perf/actor_new_graphs above 0: with prompts of varied
lengths the graphs with the text length symbolic come a few rollouts in) and the last one (which
may write the final checkpoint) are left out. The bench figure is its `step_s` record (the
FlowGRPO step, the first one when the file holds several) with its stage split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.metrics import read_scalars  # noqa: E402

#: product series -> the bench stage it is compared with (None: the product path only)
ROWS = (
    ("perf/step_time", "step"),
    ("perf/rollout_time", "rollout"),
    ("perf/rollout_generate_time", None),
    ("perf/rollout_artifact_time", None),
    ("perf/reward_time", "reward"),
    ("perf/train_time", "update"),
    ("perf/sync_time", "sync"),
    ("perf/artifact_flush_time", None),
    ("perf/watch_time", None),
    ("perf/watch_stats_time", None),
    ("perf/end_update_time", None),
    ("perf/gc_time", None),
)
#: the stages perf/step_time is compared through; what the step spends outside them is its own row
TIMED = ("perf/rollout_time", "perf/reward_time", "perf/train_time", "perf/sync_time")


#: the series that count the graphs a rollout compiled (the loop logs them with compiled blocks)
GRAPH_SERIES = ("perf/rollout_new_graphs", "perf/actor_new_graphs")
#: printed per rollout as well: the step, and the garbage collector's time and full collections in it
PER_ROLLOUT = ("perf/step_time", "perf/gc_time", "perf/gc_full_collections")


def steady_rollouts(scalars: dict[str, list[tuple[int, float]]], skip_first: int) -> set[int]:
    """The rollouts a steady figure is taken over: from `skip_first` on, none that compiled a
    graph, not the last."""
    steps = sorted(k for k, _ in scalars.get("perf/step_time", []))
    compiled = {k for tag in GRAPH_SERIES for k, v in scalars.get(tag, []) if v > 0}
    return {k for k in steps[:-1] if k >= skip_first and k not in compiled}


def steady(series: list[tuple[int, float]], rollouts: set[int]) -> list[float]:
    return [v for k, v in sorted(series) if k in rollouts]


def bench_step(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("figure") == "step_s" and r.get("algorithm", "flowgrpo") == "flowgrpo"]
    if not steps:
        raise SystemExit(f"{path}: no step_s record (did the bench's step phase run?)")
    return steps[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tensorboard", type=Path)
    p.add_argument("bench", type=Path)
    p.add_argument("--skip-first", type=int, default=2)
    args = p.parse_args(argv)
    scalars = (json.loads(args.tensorboard.read_text()) if args.tensorboard.suffix == ".json"
               else read_scalars(args.tensorboard))
    rollouts = steady_rollouts(scalars, args.skip_first)
    rec = bench_step(args.bench)
    stages = dict(rec.get("stages", {}))
    # the bench's update under offload includes the swaps the loop counts inside perf/train_time
    update = stages.get("update", 0.0) + stages.get("swap_to_train", 0.0)
    bench = {"step": rec["value"], "rollout": stages.get("rollout", 0.0) + stages.get("actor_offload", 0.0),
             "reward": stages.get("reward"), "update": update,
             "sync": stages.get("sync", 0.0) + stages.get("swap_to_sync", 0.0)}
    print(f"{'figure':34s} {'product (median, n)':>22s} {'bench':>8s} {'product/bench':>14s}")
    out = {}

    def row(name: str, series: list[tuple[int, float]], b: float | None, label: str | None = None) -> None:
        vals = steady(series, rollouts)
        med = statistics.median(vals) if vals else None
        ratio = med / b if label is None and med is not None and b else None  # a labelled row is a remainder
        out[name] = {"product": med, "n": len(vals), "bench": b, "ratio": ratio}
        print(f"{label or name:34s} "
              f"{('%.3f s' % med if med is not None else '-'):>14s} ({len(vals)}) "
              f"{('%.3f' % b if b is not None else '-'):>8s} {('%.3f' % ratio if ratio else '-'):>14s}")

    for tag, stage in ROWS:
        row(tag, scalars.get(tag, []), bench.get(stage) if stage else None)
    # per rollout: the step less its timed stages (the watch, the hand-back, logging), beside the
    # bench's step less the sum of its stages
    timed = {tag: dict(scalars.get(tag, [])) for tag in TIMED}
    rest = [(k, step - sum(timed[tag].get(k, 0.0) for tag in TIMED)) for k, step in scalars.get("perf/step_time", [])]
    row("outside_timed_stages", rest, rec["value"] - sum(stages.values()) + stages.get("rollout_new_graphs", 0.0),
        label="outside the timed stages")
    for tag in GRAPH_SERIES:  # per rollout: why a rollout is or is not among the steady ones
        if tag in scalars:
            counts = {k: int(v) for k, v in sorted(scalars[tag])}
            print(f"{tag:34s} {counts}")
            out[tag] = counts
    for tag in PER_ROLLOUT:  # per rollout: a slow one beside the collector's pauses in it
        if tag in scalars:
            values = {k: round(v, 3) for k, v in sorted(scalars[tag])}
            print(f"{tag:34s} {values}")
            out[f"{tag} per rollout"] = values
    print(f"{'steady rollouts':34s} {sorted(rollouts)}")
    out["steady_rollouts"] = sorted(rollouts)
    r = out["perf/step_time"]["ratio"]
    verdict = "within 5%" if r is not None and r <= 1.05 else "NOT within 5%"
    print(f"steady step: product {out['perf/step_time']['product']} s, bench {bench['step']:.3f} s: {verdict}")
    print(json.dumps({"product_vs_bench": out, "bench_record": rec}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
