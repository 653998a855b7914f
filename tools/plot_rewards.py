"""Draw a reward curve from a run's TensorBoard logs into a PNG (no plotting library needed).

    python tools/plot_rewards.py --tensorboard-dir runs/demo/tensorboard --output docs/demo_curve.png \
        [--series reward/color_mean] [--band reward/color_std]

Plots the per-rollout series, its running mean over --window rollouts, and (when an eval series
exists) eval/<name>/<component>_mean as points.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont


def _running_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot(series: dict[str, list[tuple[int, float]]], output: Path, title: str, window: int = 5,
         size: tuple[int, int] = (900, 480), y_range: tuple[float, float] | None = None) -> Path:
    """series: {label: [(step, value), ...]}; the first is the main curve (plus its running mean).
    y_range: the y-axis limits (default: the data's range, padded 5%)."""
    w, h = size
    left, right, top, bottom = 70, 20, 40, 50
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    points = [v for s in series.values() for v in s]
    if not points:
        raise ValueError("nothing to plot: the series are empty")
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensorboard-dir", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--series", default=None, help="main series (default: the first reward/<c>_mean found)")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--title", default=None)
    ap.add_argument("--y-range", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                    help="y-axis limits, e.g. 0 1 for a reward on a 0-1 scale (default: the data's range)")
    args = ap.parse_args(argv)
    from trainer.metrics import read_scalars

    scalars = read_scalars(args.tensorboard_dir)
    main_series = args.series or next(
        (k for k in sorted(scalars) if k.startswith("reward/") and k.endswith("_mean")
         and "advantage" not in k and "group_std" not in k), None)
    if main_series is None or main_series not in scalars:
        print(f"plot_rewards: no series {main_series!r} in {args.tensorboard_dir}; have {sorted(scalars)}",
              file=sys.stderr)
        return 2
    component = main_series[len("reward/"):-len("_mean")]
    series = {main_series: scalars[main_series]}
    for k in sorted(scalars):
        if k.startswith("eval/") and k.endswith(f"/{component}_mean"):
            series[k] = scalars[k]
    if args.y_range is not None and args.y_range[0] >= args.y_range[1]:
        print(f"plot_rewards: --y-range {args.y_range[0]} {args.y_range[1]}: LO must be below HI", file=sys.stderr)
        return 2
    plot(series, Path(args.output), args.title or f"{main_series} per rollout", window=args.window,
         y_range=None if args.y_range is None else tuple(args.y_range))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
