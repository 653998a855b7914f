"""Draw a reward curve from a run's TensorBoard logs into a PNG (no plotting library needed).

    python tools/plot_rewards.py --tensorboard-dir runs/demo/tensorboard --output docs/demo_curve.png \
        [--series reward/color_mean] [--band reward/color_std]

Plots the per-rollout series, its running mean over --window rollouts, the series +- a second
one as a shaded band (--band, e.g. the per-rollout std of the same reward), and (when an eval
series exists) eval/<name>/<component>_mean as points. --tensorboard-dir is the run's event
directory or the directory above it when that holds a single run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

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


def plot(series: dict[str, list[tuple[int, float]]], output: Path, title: str, window: int = 5,
         size: tuple[int, int] = (900, 480), band: tuple[str, list[tuple[int, float]]] | None = None,
         y_range: tuple[float, float] | None = None) -> Path:
    """series: {label: [(step, value), ...]}; the first is the main curve (plus its running mean).
    band: (label, [(step, half width)]) shaded around the main curve.
    y_range: the y-axis limits (unset: the data's range, padded 5%)."""
    w, h = size
    left, right, top, bottom = 70, 20, 40, 50
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    points = [v for s in series.values() for v in s]
    if not points:
        raise ValueError("nothing to plot: the series are empty")
    lower, upper = _band_edges(next(iter(series.values())), band[1]) if band else ([], [])
    points += lower + upper
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = (max(ys) - min(ys)) * 0.05 or 0.01
    y0, y1 = (min(ys) - pad, max(ys) + pad) if y_range is None else y_range

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (w - left - right), top + (y1 - y) / (y1 - y0) * (h - top - bottom))

    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        _, py = px(x0, y)
        d.line([left - 4, py, left, py], fill="black")
        d.text((5, py - 6), f"{y:.4f}", fill="black", font=font)
    for i in range(5):
        x = x0 + (x1 - x0) * i / 4
        qx, _ = px(x, y0)
        d.line([qx, h - bottom, qx, h - bottom + 4], fill="black")
        d.text((qx - 8, h - bottom + 8), f"{x:.0f}", fill="black", font=font)
    d.text((w // 2 - 30, h - 20), "rollout", fill="black", font=font)
    d.text((left, 12), title, fill="black", font=font)
    colors = ["#9ecae1", "#e6550d", "#31a354", "#756bb1"]
    legend_y = top + 6
    if len(lower) > 1:
        d.polygon([px(x, y) for x, y in lower] + [px(x, y) for x, y in reversed(upper)], fill="#deebf7")
        d.text((w - right - 260, legend_y), f"+- {band[0]} (band)", fill="#6baed6", font=font)
        legend_y += 14
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
            d.text((w - right - 260, legend_y), f"{label} (thin), running mean of {window} (thick)",
                   fill="#08519c", font=font)
        else:
            for qx, qy in pts:
                d.ellipse([qx - 4, qy - 4, qx + 4, qy + 4], fill=color)
            d.text((w - right - 260, legend_y), f"{label} (dots)", fill=color, font=font)
        legend_y += 14
    output.parent.mkdir(parents=True, exist_ok=True)
    img.save(output)
    return output


def main(argv: list[str] | None = None) -> int:
    ap = tool_parser("plot_rewards", __doc__)
    ap.add_argument("--tensorboard-dir", required=True, type=existing_dir,
                    help="the run's --tensorboard-dir (or the run directory inside it)")
    ap.add_argument("--output", required=True, help="the PNG file to write")
    ap.add_argument("--series", default=None, help="main series (unset: the first reward/<c>_mean found)")
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
    main_series = args.series or next(
        (k for k in sorted(scalars) if k.startswith("reward/") and k.endswith("_mean")
         and "advantage" not in k and "group_std" not in k), None)
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
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
