"""Draw a reward curve from a run's TensorBoard logs into a PNG (no plotting library needed).

    python tools/plot_rewards.py --tensorboard-dir runs/demo/tensorboard --output docs/demo_curve.png \
        [--series reward/color_mean] [--band reward/color_std]

Plots the per-rollout series, its running mean over --window rollouts, the series +- a second
one as a shaded band (--band, e.g. the per-rollout std of the same reward), and (when an eval
series exists) eval/<name>/<component>_mean as points. --tensorboard-dir is the run's event
directory or the directory above it when that holds a single run.

Without --series it plots what the run trained on: reward/weighted_total_mean (the weighted sum
of the trained components); in a run logged before that series existed, the first
reward/<c>_mean that is not constant (a component nobody trains on often is).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, run_tool, tool_parser  # noqa: E402


def _running_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _band_edges(main: list[tuple[int, float]], band: list[tuple[int, float]]) -> tuple[list, list]:
    """(main - band, main + band) at the steps both series have, in step order."""
    width = dict(band)
    both = [(x, y, width[x]) for x, y in sorted(main) if x in width]
    return [(x, y - b) for x, y, b in both], [(x, y + b) for x, y, b in both]


def integer_ticks(lo: float, hi: float, most: int = 8) -> list[int]:
    """Distinct integer x ticks (rollout ids) in [lo, hi]: the multiples of the smallest step of
    1, 2, 5, 10, 20, 50, ... that gives at most `most` ticks."""
    lo_i, hi_i = math.ceil(lo), math.floor(hi)
    if hi_i < lo_i:
        return [round(lo)]
    step = 1
    while (hi_i - lo_i) // step + 1 > most:
        step = _next_step(step)
    first = math.ceil(lo_i / step) * step
    return list(range(first, hi_i + 1, step))


def _next_step(step: int) -> int:
    """1 -> 2 -> 5 -> 10 -> 20 -> 50 -> 100 ..."""
    digits = len(str(step)) - 1
    lead = step // 10 ** digits
    return {1: 2, 2: 5, 5: 10}[lead] * 10 ** digits


def plot(series: dict[str, list[tuple[int, float]]], output: Path, title: str, window: int = 5,
         size: tuple[int, int] = (900, 480), band: tuple[str, list[tuple[int, float]]] | None = None,
         y_range: tuple[float, float] | None = None) -> Path:
    """series: {label: [(step, value), ...]}; the first is the main curve (plus its running mean).
    band: (label, [(step, half width)]) shaded around the main curve.
    y_range: the y-axis limits (unset: the data's range, padded 5%).
    The legend sits under the plot, one line per entry, and the image grows to hold it, so a
    long series name is never cut; the x ticks are whole rollout ids, each once."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    points = [v for s in series.values() for v in s]
    if not points:
        raise ValueError("nothing to plot: the series are empty")
    lower, upper = _band_edges(next(iter(series.values())), band[1]) if band else ([], [])
    points += lower + upper
    colors = ["#9ecae1", "#e6550d", "#31a354", "#756bb1"]
    legend: list[tuple[str, str]] = []
    if len(lower) > 1:
        legend.append((f"+- {band[0]} (band)", "#6baed6"))
    for i, label in enumerate(series):
        legend.append((f"{label} (thin), running mean of {window} (thick)", "#08519c") if i == 0
                      else (f"{label} (dots)", colors[i % len(colors)]))
    line_h = 14
    left, right, top, bottom = 70, 20, 40, 50
    w = max(size[0], left + int(max(font.getlength(t) for t, _ in legend)) + right)
    plot_h = size[1]
    h = plot_h + len(legend) * line_h + 10
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = (max(ys) - min(ys)) * 0.05 or 0.01
    y0, y1 = (min(ys) - pad, max(ys) + pad) if y_range is None else y_range

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (w - left - right),
                top + (y1 - y) / (y1 - y0) * (plot_h - top - bottom))

    d.rectangle([left, top, w - right, plot_h - bottom], outline="black")
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        _, py = px(x0, y)
        d.line([left - 4, py, left, py], fill="black")
        d.text((5, py - 6), f"{y:.4f}", fill="black", font=font)
    for x in integer_ticks(x0, x1):
        qx, _ = px(x, y0)
        d.line([qx, plot_h - bottom, qx, plot_h - bottom + 4], fill="black")
        label = str(x)
        d.text((qx - font.getlength(label) / 2, plot_h - bottom + 8), label, fill="black", font=font)
    d.text((w // 2 - 30, plot_h - 20), "rollout", fill="black", font=font)
    d.text((left, 12), title, fill="black", font=font)
    if len(lower) > 1:
        d.polygon([px(x, y) for x, y in lower] + [px(x, y) for x, y in reversed(upper)], fill="#deebf7")
    for i, (label, s) in enumerate(series.items()):
        s = sorted(s)
        color = colors[i % len(colors)]
        pts = [px(x, y) for x, y in s]
        if i == 0:
            if len(pts) > 1:
                d.line(pts, fill=color, width=1)
            rm = _running_mean([y for _, y in s], window)
            rpts = [px(x, y) for (x, _), y in zip(s, rm)]
            if len(rpts) > 1:
                d.line(rpts, fill="#08519c", width=3)
        else:
            for qx, qy in pts:
                d.ellipse([qx - 4, qy - 4, qx + 4, qy + 4], fill=color)
    for j, (text, color) in enumerate(legend):
        d.text((left, plot_h + 4 + j * line_h), text, fill=color, font=font)
    output.parent.mkdir(parents=True, exist_ok=True)
    img.save(output)
    return output


def default_series(scalars: dict[str, list[tuple[int, float]]]) -> str | None:
    """What the run trained on: reward/weighted_total_mean; else (older runs) the first
    reward/<c>_mean that varies, else the first reward/<c>_mean."""
    if "reward/weighted_total_mean" in scalars:
        return "reward/weighted_total_mean"
    means = [k for k in sorted(scalars) if k.startswith("reward/") and k.endswith("_mean")
             and "advantage" not in k and "group_std" not in k]
    varying = [k for k in means if len({v for _, v in scalars[k]}) > 1]
    return (varying or means or [None])[0]


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("plot_rewards", __doc__)
    ap.add_argument("--tensorboard-dir", required=True, type=existing_dir,
                    help="the run's --tensorboard-dir (or the run directory inside it)")
    ap.add_argument("--output", required=True, help="the PNG file to write")
    ap.add_argument("--series", default=None,
                    help="main series (unset: reward/weighted_total_mean, the reward trained on; see above)")
    ap.add_argument("--band", default=None,
                    help="series drawn as a band of +- its value around the main one, e.g. reward/color_std")
    ap.add_argument("--window", type=int, default=5, help="rollouts in the running mean")
    ap.add_argument("--title", default=None, help="plot title (unset: '<series> per rollout')")
    ap.add_argument("--y-range", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                    help="y-axis limits, LO below HI, e.g. 0 1 for a reward on a 0-1 scale (unset: the data's range)")
    args = ap.parse_args(argv)
    return run_tool("plot_rewards", lambda: _plot(args), (ValueError,))


def _plot(args) -> int:
    from trainer.metrics import read_scalars

    scalars = read_scalars(args.tensorboard_dir)
    main_series = args.series or default_series(scalars)
    if main_series is None or main_series not in scalars:
        raise ToolError(f"--series: no series {main_series!r} in {args.tensorboard_dir}; it has {sorted(scalars)}")
    if args.band is not None and args.band not in scalars:
        raise ToolError(f"--band: no series {args.band!r} in {args.tensorboard_dir}; it has {sorted(scalars)}")
    component = main_series[len("reward/"):-len("_mean")]
    series = {main_series: scalars[main_series]}
    for k in sorted(scalars):
        if k.startswith("eval/") and k.endswith(f"/{component}_mean"):
            series[k] = scalars[k]
    if args.y_range is not None and args.y_range[0] >= args.y_range[1]:
        raise ToolError(f"--y-range {args.y_range[0]} {args.y_range[1]}: LO must be below HI")
    band = (args.band, scalars[args.band]) if args.band else None
    plot(series, Path(args.output), args.title or f"{main_series} per rollout", window=args.window, band=band,
         y_range=None if args.y_range is None else tuple(args.y_range))
    print(f"wrote {args.output}: {main_series}" + "".join(f", {k} (dots)" for k in list(series)[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
