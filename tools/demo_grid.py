"""The demo's before/after picture: the eval prompts drawn by the base model and by the trained one.

    python tools/demo_grid.py --config configs/tiny_cpu_demo.toml --output runs/demo/before_after.png

"Before" is rendered here from the recipe's --model-path (the base the run started from) with
exactly the loop's evaluation call (trainer.rollout.generate_rollout with eval=True, the recipe's
sampling config, --generation-seed and --n-samples-per-eval-prompt), so each image has the same
initial noise and SDE noise as its "after" counterpart; the PNGs go to
<artifact-root>/eval_base/. "After" is the newest evaluation the run wrote,
<artifact-root>/eval/<task>/rollout_<k>/. One column per (prompt, sample), the base's row above
the trained row, each image labelled with its score on the trained component (the first of
--reward-component-weights); the mean of every component of each row is printed.
Reads the first eval set of the recipe; the recipe's reward must be an offline scorer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from PIL import Image, ImageDraw, ImageFont


def _load_pngs(directory: Path, groups: int, n: int) -> list[torch.Tensor]:
    """Images [3, H, W] in [0, 1] of groups x n candidates, in (group, slot) order."""
    from trainer.artifacts import image_name

    out = []
    for g in range(groups):
        for s in range(n):
            path = directory / image_name(g, s)
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: did the run write its eval images there?")
            arr = torch.frombuffer(bytearray(Image.open(path).convert("RGB").tobytes()), dtype=torch.uint8)
            w, h = Image.open(path).size
            out.append(arr.view(h, w, 3).permute(2, 0, 1).float() / 255)
    return out


def draw_grid(rows: dict[str, list[torch.Tensor]], scores: dict[str, list[float]], captions: list[str],
              output: Path, scale: int = 4) -> Path:
    """rows: {row label: images [3, H, W]}, all rows the same length; one caption per column."""
    font = ImageFont.load_default()
    first = next(iter(rows.values()))
    h, w = first[0].shape[1] * scale, first[0].shape[2] * scale
    label_w, cap_h, score_h, gap = 70, 28, 14, 4
    cols = len(first)
    grid = Image.new("RGB", (label_w + cols * (w + gap), cap_h + len(rows) * (h + score_h + gap)), "white")
    d = ImageDraw.Draw(grid)
    for c, caption in enumerate(captions):
        x = label_w + c * (w + gap)
        for i, line in enumerate(caption.split("\n")[:2]):
            d.text((x + 2, 2 + 12 * i), line, fill="black", font=font)
    for r, (label, images) in enumerate(rows.items()):
        y = cap_h + r * (h + score_h + gap)
        d.text((4, y + h // 2 - 6), label, fill="black", font=font)
        for c, img in enumerate(images):
            x = label_w + c * (w + gap)
            tile = Image.fromarray((img.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())
            grid.paste(tile.resize((w, h), Image.NEAREST), (x, y))
            d.text((x + 2, y + h + 1), f"{scores[label][c]:.2f}", fill="black", font=font)
    output.parent.mkdir(parents=True, exist_ok=True)
    grid.save(output)
    return output


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the run's recipe (TOML), as given to trainer.train")
    p.add_argument("--output", required=True, help="PNG to write")
    p.add_argument("--scale", type=int, default=4, help="nearest-neighbour upscaling of each image (default 4)")
    args = p.parse_args(argv)

    from trainer import artifacts
    from trainer.config import load_config
    from trainer.data import load_eval_sets
    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.rewards.manager import reward_manager_from_config
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    cfg = load_config(["--config", args.config])
    if not cfg.eval.eval_prompt_data:
        print(f"demo_grid: {args.config} has no eval-prompt-data to draw", file=sys.stderr)
        return 2
    task, root = cfg.model.generation_task, Path(cfg.artifacts.artifact_root)
    name, ds = next(iter(load_eval_sets(cfg.eval.eval_prompt_data, task=task).items()))
    records = [ds[i] for i in range(len(ds))]
    n = int(cfg.eval.n_samples_per_eval_prompt)
    # the loop's layout: one eval set writes eval/<task>/, several eval/<task>/<name>/
    eval_task = task if len(cfg.eval.eval_prompt_data) == 1 else f"{task}/{name}"
    done = artifacts.list_rollout_dirs(root, eval_task, eval=True)
    if not done:
        print(f"demo_grid: no eval images under {artifacts.task_root(root, eval_task, eval=True)}; "
              "run the training first", file=sys.stderr)
        return 2
    last_k, after_dir = done[-1]

    engine = NativeEngine(cfg.model.model_path, device="cpu", dtype="fp32")
    base = generate_rollout(engine, QwenImageAdapter(), records, rollout_id=0,
                            sampling=parse_sampling_config(cfg.rollout.sampling_config), group_size=n,
                            generation_seed=int(cfg.rollout.generation_seed), artifact_root=str(root / "eval_base"),
                            task=eval_task, retention=0, eval=True)
    before = [r["image"] for r in sorted(base.responses, key=lambda r: (r["group_index"], r["slot"]))]
    after = _load_pngs(after_dir, len(records), n)

    manager = reward_manager_from_config(cfg.reward, torch.device("cpu"))
    prompts = [rec.prompt for rec in records for _ in range(n)]
    metadata = [rec.to_dict()["metadata"] for rec in records for _ in range(n)]
    rows = {"base": before, f"rollout {last_k}": after}
    scores: dict[str, list[float]] = {}
    # tiles show the component the run trained on (the first weighted one), the printout all
    weighted = list(cfg.reward.reward_component_weights or {})
    for label, images in rows.items():
        comps = manager.score(images, prompts, metadata).components
        comp = weighted[0] if weighted else sorted(comps)[0]
        scores[label] = [float(v) for v in comps[comp]]
        means = ", ".join(f"{c} mean {float(v.float().mean()):.4f}" for c, v in sorted(comps.items()))
        print(f"demo_grid: {label:>12}: {means} over {len(images)} eval images")
    captions = [f"{rec.prompt}\nseed {s}" for rec in records for s in range(n)]
    draw_grid(rows, scores, captions, Path(args.output), scale=args.scale)
    print(f"demo_grid: wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
