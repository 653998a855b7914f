"""Compare training runs side by side from their TensorBoard logs: one PNG and one Markdown table.

    python tools/compare_runs.py --run flowgrpo runs/demo/tensorboard --run nft runs/demo/nft/tensorboard \
        --component named_color --eval-set held_out --output docs/demo_algorithms.png

The PNG has four panels: the training reward (reward/<component>_mean, per rollout, with its
running mean) and the held-out eval reward (eval/<set>/<component>_mean) against the rollout
id, and both again against the run's cumulative wall-clock seconds (the sum of perf/step_time
up to and including that rollout, eval time included: what a user waits). The table (printed,
Markdown) gives each run's base reward, the mean of its last --window rollouts, the held-out
reward at its first and last eval, its seconds per rollout and its total seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, run_tool, tool_parser  # noqa: E402

COLORS = ("#e6550d", "#3182bd", "#31a354", "#756bb1")
PANEL = (560, 330)


def cumulative_seconds(step_time: list[tuple[int, float]]) -> dict[int, float]:
    """rollout id -> wall-clock seconds of the run up to the end of that rollout."""
    out, total = {}, 0.0
    for step, seconds in sorted(step_time):
        total += seconds
        out[step] = total
    return out


def running_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def run_series(scalars: dict[str, list[tuple[int, float]]], component: str, eval_set: str) -> dict[str, list]:
    """{"train": [(rollout, reward)], "eval": [(rollout, reward)], "seconds": {rollout: s}} of one run."""
    train_key, eval_key = f"reward/{component}_mean", f"eval/{eval_set}/{component}_mean"
    if train_key not in scalars:
        raise ToolError(f"no series {train_key!r} in the run's logs (--component); it has "
                        f"{sorted(k for k in scalars if k.startswith('reward/'))[:12]}")
    if "perf/step_time" not in scalars:
        raise ToolError("no perf/step_time series in the run's logs: not a log written by trainer.loop")
    return {"train": sorted(scalars[train_key]), "eval": sorted(scalars.get(eval_key, [])),
            "seconds": cumulative_seconds(scalars["perf/step_time"])}


def _panel(title: str, xlabel: str, curves: list[tuple[str, str, list[tuple[float, float]], bool]],
           window: int, y_range: tuple[float, float]) -> Image.Image:
    """One chart: curves (label, color, points, is_eval): training curves as a thin line plus a
    thick running mean, eval curves as dots joined by a line."""
    w, h = PANEL
    left, right, top, bottom = 55, 15, 30, 40
    img = Image.new("RGB", PANEL, "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    xs = [x for _, _, pts, _ in curves for x, _ in pts] or [0.0, 1.0]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = y_range

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (w - left - right), top + (y1 - y) / (y1 - y0) * (h - top - bottom))

    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for i in range(5):
        _, py = px(x0, y0 + (y1 - y0) * i / 4)
        d.text((5, py - 6), f"{y0 + (y1 - y0) * i / 4:.2f}", fill="black", font=font)
        qx, _ = px(x0 + (x1 - x0) * i / 4, y0)
        d.text((qx - 8, h - bottom + 6), f"{x0 + (x1 - x0) * i / 4:.0f}", fill="black", font=font)
    d.text((w // 2 - 30, h - 18), xlabel, fill="black", font=font)
    d.text((left, 10), title, fill="black", font=font)
    ly = top + 5
    for label, color, pts, is_eval in curves:
        q = [px(x, y) for x, y in pts]
        if is_eval:
            if len(q) > 1:
                d.line(q, fill=color, width=2)
            for cx, cy in q:
                d.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=color)
        else:
            if len(q) > 1:
                d.line(q, fill=color, width=1)
            rm = running_mean([y for _, y in pts], window)
            rq = [px(x, y) for (x, _), y in zip(pts, rm)]
            if len(rq) > 1:
                d.line(rq, fill=color, width=3)
        d.text((left + 8, ly), label, fill=color, font=font)
        ly += 13
    return img


def draw(runs: dict[str, dict[str, list]], output: Path, window: int = 5,
         y_range: tuple[float, float] = (0.0, 1.0)) -> Path:
    """The four-panel PNG of `runs` (name -> run_series)."""
    panels = []
    for what, is_eval in (("training reward", False), ("held-out reward", True)):
        for xlabel in ("rollout", "wall-clock seconds"):
            curves = []
            for i, (name, s) in enumerate(runs.items()):
                pts = s["eval" if is_eval else "train"]
                if xlabel != "rollout":
                    pts = [(s["seconds"][x], y) for x, y in pts if x in s["seconds"]]
                curves.append((name, COLORS[i % len(COLORS)], [(float(x), float(y)) for x, y in pts], is_eval))
            suffix = f" (thick: running mean of {window})" if not is_eval else " (at each eval)"
            panels.append(_panel(f"{what} vs {xlabel}{suffix}", xlabel, curves, window, y_range))
    w, h = PANEL
    sheet = Image.new("RGB", (2 * w, 2 * h), "white")
    for i, p in enumerate(panels):
        sheet.paste(p, ((i % 2) * w, (i // 2) * h))
    output.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(output)
    return output


def table(runs: dict[str, dict[str, list]], window: int = 5) -> str:
    """The Markdown table of the runs' figures."""
    lines = ["| run | rollouts | training reward: base -> last %d | held-out: first -> last eval | s / rollout | "
             "total s |" % window, "|---|---|---|---|---|---|"]
    for name, s in runs.items():
        train = [y for _, y in s["train"]]
        last = train[-window:]
        ev = s["eval"]
        held = f"{ev[0][1]:.3f} (r{ev[0][0]}) -> {ev[-1][1]:.3f} (r{ev[-1][0]})" if ev else "-"
        total = max(s["seconds"].values()) if s["seconds"] else 0.0
        lines.append(f"| {name} | {len(train)} | {train[0]:.3f} -> {sum(last) / len(last):.3f} | {held} | "
                     f"{total / max(len(s['seconds']), 1):.1f} | {total:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("compare_runs", __doc__)
    ap.add_argument("--run", nargs=2, action="append", metavar=("NAME", "TENSORBOARD_DIR"), required=True,
                    help="a run's name and its --tensorboard-dir (or the run directory inside it); give two or more")
    ap.add_argument("--component", required=True, help="the reward component to compare, e.g. named_color")
    ap.add_argument("--eval-set", default="held_out", help="the eval set whose reward is drawn (its --eval-prompt-data name)")
    ap.add_argument("--output", required=True, help="the PNG file to write")
    ap.add_argument("--window", type=int, default=5, help="rollouts in the running mean and the table's last-N mean")
    ap.add_argument("--y-range", type=float, nargs=2, metavar=("LO", "HI"), default=(0.0, 1.0),
                    help="y-axis limits, LO below HI (default 0 1: a reward on a 0-1 scale)")
    args = ap.parse_args(argv)
    return run_tool("compare_runs", lambda: _compare(args), (ValueError,))


def _compare(args: argparse.Namespace) -> int:
    from trainer.metrics import read_scalars

    if len(args.run) < 2:
        raise ToolError("--run: give at least two runs to compare")
    if not args.y_range[0] < args.y_range[1] or args.window < 1:
        raise ToolError("--y-range needs LO < HI and --window >= 1")
    runs = {}
    for name, tb in args.run:
        if not Path(tb).is_dir():
            raise ToolError(f"--run {name}: {tb} is not a directory")
        runs[name] = run_series(read_scalars(tb), args.component, args.eval_set)
    draw(runs, Path(args.output), args.window, tuple(args.y_range))
    print(table(runs, args.window))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
