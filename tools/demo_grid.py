"""The demo's before/after picture: the eval prompts drawn by the base model and by the trained one.

    python tools/demo_grid.py --config configs/tiny_cpu_demo.toml --output runs/demo/before_after.png

"Before" is rendered here from the recipe's --model-path (the base the run started from) with
exactly the loop's evaluation call (trainer.rollout.generate_rollout with eval=True, the recipe's
sampling config, --generation-seed and --n-samples-per-eval-prompt), so each image has the same
initial noise and SDE noise as its "after" counterpart; the PNGs go to
<artifact-root>/eval_base/. "After" is the newest evaluation the run wrote,
<artifact-root>/eval/<task>/rollout_<k>/. One row per eval prompt: its samples by the base on
the left, the same seeds after post-training on the right, each image labelled with its score on
the trained component (the first of --reward-component-weights); the mean of every component of
each side is printed. Reads the first eval set of the recipe; the recipe's reward must be an
offline scorer.

It also writes the probe slider: one TensorBoard image per evaluation the run kept (all of them
under --artifact-retention-rollouts 0), all the eval prompts and seeds in one grid, under the tag
probes/<set> of the run's own event directory, the base's at step 0. Moving that one slider shows
the same prompts and seeds change over the run.
"""

from __future__ import annotations

# torch and PIL are imported where they are used: --help answers without loading torch
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from typing import TYPE_CHECKING  # noqa: E402

from trainer.cli import ToolError, existing_file, run_tool, tool_parser  # noqa: E402

if TYPE_CHECKING:
    import torch


def _load_pngs(directory: Path, groups: int, n: int) -> list[torch.Tensor]:
    """Images [3, H, W] in [0, 1] of groups x n candidates, in (group, slot) order."""
    import torch

    from trainer.artifacts import image_name
    from trainer.core.image_file import decode_rgb

    out = []
    for g in range(groups):
        for s in range(n):
            path = directory / image_name(g, s)
            if not path.is_file():
                raise ToolError(f"{path} is missing: did the run write its eval images there?")
            rgb = decode_rgb(path)  # the accepted formats only, size checked from the header
            arr = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
            out.append(arr.view(rgb.height, rgb.width, 3).permute(2, 0, 1).float() / 255)
    return out


def draw_grid(prompts: list[str], sides: dict[str, list[torch.Tensor]], scores: dict[str, list[float]], n: int,
              output: Path, scale: int = 4) -> Path:
    """One row per prompt; per side (e.g. {"base": ..., "after": ...}) its n images of that
    prompt, labelled with their scores. sides[label] holds len(prompts) * n images in
    (prompt, sample) order."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    first = next(iter(sides.values()))
    h, w = first[0].shape[1] * scale, first[0].shape[2] * scale
    label_w, head_h, score_h, gap, side_gap = 120, 18, 14, 4, 16
    side_w = n * (w + gap)
    grid = Image.new("RGB", (label_w + len(sides) * (side_w + side_gap), head_h + len(prompts) * (h + score_h + gap)),
                     "white")
    d = ImageDraw.Draw(grid)
    for si, label in enumerate(sides):
        d.text((label_w + si * (side_w + side_gap) + 2, 2), label, fill="black", font=font)
    for r, prompt in enumerate(prompts):
        y = head_h + r * (h + score_h + gap)
        d.text((4, y + h // 2 - 6), prompt, fill="black", font=font)
        for si, (label, images) in enumerate(sides.items()):
            for c in range(n):
                x = label_w + si * (side_w + side_gap) + c * (w + gap)
                img = images[r * n + c]
                tile = Image.fromarray((img.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())
                grid.paste(tile.resize((w, h), Image.NEAREST), (x, y))
                d.text((x + 2, y + h + 1), f"{scores[label][r * n + c]:.2f}", fill="black", font=font)
    output.parent.mkdir(parents=True, exist_ok=True)
    grid.save(output)
    return output


def write_probe_slider(log_dir: str, run_name: str, set_name: str, records: list, n: int,
                       base_images: list[torch.Tensor], done: list[tuple[int, Path]]) -> int:
    """The probes/<set> TensorBoard images (module docstring) under <log_dir>/<run_name>, the
    loop's event directory for that recipe; returns how many were written."""
    from trainer.metrics import MetricsLogger

    captions = [f"{rec.prompt} | seed {s}" for rec in records for s in range(n)]
    writer = MetricsLogger(log_dir, 0, run_name=run_name)
    writer.log_image_grid(0, f"probes/{set_name}", base_images, captions, cols=n)
    for k, directory in done:
        writer.log_image_grid(k, f"probes/{set_name}", _load_pngs(directory, len(records), n), captions, cols=n)
    writer.close()
    return 1 + len(done)


def main(argv=None) -> int:
    p = tool_parser("demo_grid", __doc__)
    p.add_argument("--config", required=True, type=existing_file, help="the run's recipe (TOML), as given to trainer.train")
    p.add_argument("--output", required=True, help="PNG to write")
    p.add_argument("--scale", type=int, default=4, help="nearest-neighbour upscaling of each image, >= 1")
    args = p.parse_args(argv)
    if args.scale < 1:
        p.error(f"--scale must be >= 1, got {args.scale}")
    return run_tool("demo_grid", lambda: _grid(args), (ValueError, FileNotFoundError))


def _grid(args) -> int:
    import torch

    from trainer.cli import quiet_third_party

    quiet_third_party(load=True)  # it loads a pipeline: diffusers' bars read no environment switch
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
        raise ToolError(f"{args.config} has no eval-prompt-data to draw")
    task, root = cfg.model.generation_task, Path(cfg.artifacts.artifact_root)
    sets = load_eval_sets(cfg.eval.eval_prompt_data, task=task, media_root=cfg.rollout.media_root)
    name, ds = next(iter(sets.items()))
    records = [ds[i] for i in range(len(ds))]
    n = int(cfg.eval.n_samples_per_eval_prompt)
    # the loop's layout: one eval set writes eval/<task>/, several eval/<task>/<name>/
    eval_task = task if len(cfg.eval.eval_prompt_data) == 1 else f"{task}/{name}"
    done = artifacts.list_rollout_dirs(root, eval_task, eval=True)
    if not done:
        raise ToolError(f"no eval images under {artifacts.task_root(root, eval_task, eval=True)}; run the training first")
    last_k, after_dir = done[-1]

    engine = NativeEngine(cfg.model.model_path, device="cpu", dtype="fp32")
    sampling = parse_sampling_config(cfg.rollout.sampling_config)
    if cfg.grpo.algorithm == "nft":  # the base drawn as the run's evaluation drew it: the ODE path
        from trainer.nft import ode_rollout_sampling

        sampling = ode_rollout_sampling(sampling)
    base = generate_rollout(engine, QwenImageAdapter(), records, rollout_id=0,
                            sampling=sampling, group_size=n,
                            generation_seed=int(cfg.rollout.generation_seed), artifact_root=str(root / "eval_base"),
                            task=eval_task, retention=0, eval=True)
    order = sorted(range(len(base.candidates)), key=lambda i: base.candidates[i])  # (group, slot) order
    before = [base.trajectory.images[i] for i in order]
    after = _load_pngs(after_dir, len(records), n)

    manager = reward_manager_from_config(cfg.reward, torch.device("cpu"))
    prompts = [rec.prompt for rec in records for _ in range(n)]
    metadata = [rec.to_dict()["metadata"] for rec in records for _ in range(n)]
    sides = {"base model": before, f"after post-training (rollout {last_k})": after}
    scores: dict[str, list[float]] = {}
    # tiles show the component the run trained on (the first weighted one), the printout all
    weighted = list(cfg.reward.reward_component_weights or {})
    for label, images in sides.items():
        comps = manager.score(images, prompts, metadata).components
        comp = weighted[0] if weighted else sorted(comps)[0]
        scores[label] = [float(v) for v in comps[comp]]
        means = ", ".join(f"{c} {float(v.float().mean()):.3f}" for c, v in sorted(comps.items()))
        print(f"demo_grid: {label}: {means} (mean of {len(images)} eval images)")
    draw_grid([rec.prompt for rec in records], sides, scores, n, Path(args.output), scale=args.scale)
    print(f"demo_grid: wrote {args.output}")
    if cfg.logging.tensorboard_dir:
        written = write_probe_slider(cfg.logging.tensorboard_dir, Path(args.config).stem, name, records, n, before, done)
        print(f"demo_grid: wrote {written} probe grids (tag probes/{name}) to the run's TensorBoard events")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
