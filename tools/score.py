"""Score a folder of images against their prompts and print one JSON line per image.

    python tools/score.py --reward-scorer-path trainer.rewards.pickscore.PickScoreScorer \
        --reward-model-path /models/PickScore_v1 --images runs/art/t2i/rollout_12 \
        --prompt-data data/prompts.jsonl

Images are matched to prompts by the rollout artifact naming group_<8 digits>_sample_<4 digits>.png
when every image in the folder is named that way: the prompt is the one recorded in the group's
trajectory sidecar (group_<8 digits>.safetensors) beside the images, or, for a group without one,
line <group> (0-based) of --prompt-data. The sidecar comes first because a training rollout's
group index is the position in that rollout's shuffled prompt batch, not a line of the prompt file
(an eval rollout's groups do follow the eval file's lines). Otherwise the sorted image files are
paired with the prompt lines in order, and the counts must agree. The prompt file is JSONL:
{"prompt": "...", "metadata": {...}} per line.
Output lines: {"image": FILE, "prompt": ..., "group": G or null, "slot": S or null,
"scores": {component: value or null}}. Scoring goes through the same manager as training
(--reward-runtime cpu / colocate / remote), so the numbers match the training run's; an image
edit's sidecar names its source files, whose pixels the edit scorers (color_edit, clip_preserve,
edit_judge) get as in training.

Videos (a t2v rollout's group_<8 digits>_sample_<4 digits>.webp, animated WebP): a scorer whose
track is video (video_ocr, temporal_consistency, video_vlm_judge, framewise, or a remote video
scorer) reads each file's frames in order (at most MAX_VIDEO_FRAMES per file; every frame is
refused from its header, before any frame is decoded, when it has more than MAX_VIDEO_FRAMES
frames or more than MAX_VIDEO_PIXELS pixels over all its frames).

Every file is opened as PNG, JPEG or WebP only (trainer.core.image_file; other formats are
refused by their bytes, whatever the name), an image of more than 4096 x 4096 pixels is refused
from its header. Source images named by a sidecar (`source_paths`) or a prompt line
(`metadata.source_images`) are read only inside the prompt file's directory or --media-root,
symlinks followed; relative ones are under the prompt file's directory, else --media-root.
After the last image, the mean of each component over the images it scored (and their count)
is printed to stderr; exit 1 when no image got a finite score at all (the endpoint was down or
answered nonsense: the warnings say which).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, existing_file, run_tool, tool_parser  # noqa: E402
from trainer.core.image_file import MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS  # noqa: E402

ARTIFACT_RE = re.compile(r"^group_(\d{8})_sample_(\d{4})\.(?:png|webp)$")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def read_prompt_file(path: str | Path) -> list[tuple[str, dict]]:
    """(prompt, metadata) per line of a JSONL prompt file. Every line must be an object with a
    string "prompt"; the error names the file and line."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                raise ValueError(f"{path}:{lineno}: empty line (group indices are line indices; remove it)")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f'{path}:{lineno}: expected an object with a string "prompt"')
            entries.append((rec["prompt"], dict(rec.get("metadata") or {})))
    return entries


def sidecar_prompt(image_dir: str | Path, group: int) -> tuple[str, dict] | None:
    """(prompt, metadata) recorded in group `group`'s trajectory sidecar in `image_dir`; None when
    there is none. A damaged sidecar raises ArtifactError naming it."""
    from trainer import artifacts

    path = Path(image_dir) / artifacts.sidecar_name(group)
    if not path.is_file():
        return None
    _, metadata = artifacts.read_sidecar(path)
    return metadata["prompt"], json.loads(metadata.get("prompt_metadata") or "{}")


def match_images(image_dir: str | Path, prompts: list[tuple[str, dict]] | None) -> list[dict]:
    """[{path, prompt, metadata, group, slot}] in output order (see the module docstring).
    prompts: the --prompt-data lines, or None when it was not given."""
    from trainer.core.media_key import media_file_problem

    files = sorted(p for p in Path(image_dir).iterdir() if not p.is_dir() and p.suffix.lower() in IMAGE_SUFFIXES)
    for p in files:  # a FIFO, a device or a link to a /proc file named like an image is never opened
        problem = media_file_problem(p)
        if problem:
            raise ValueError(f"--images {image_dir}: {problem}; remove it from the folder")
    from trainer.data import within

    root = os.path.realpath(image_dir)
    for p in files:  # a link out of the folder would hand another file of the host to the scorer
        if not within(os.path.realpath(p), root):
            raise ValueError(f"--images {image_dir}: {p.name} is a link to {os.path.realpath(p)}, outside the folder; "
                             "copy the image into the folder instead")
    if not files:
        raise ValueError(f"--images {image_dir}: no image files found")
    named = [ARTIFACT_RE.match(p.name) for p in files]
    rows = []
    if all(named):
        recorded: dict[int, tuple[str, dict] | None] = {}
        for p, m in zip(files, named):
            g, s = int(m.group(1)), int(m.group(2))
            if g not in recorded:
                recorded[g] = sidecar_prompt(image_dir, g)
            if recorded[g] is not None:
                prompt, md = recorded[g]
            elif prompts is None:
                raise ValueError(f"{p.name}: no sidecar group_{g:08d}.safetensors beside it records its prompt; "
                                 "pass --prompt-data (the prompt file the images were generated from)")
            elif g >= len(prompts):
                raise ValueError(
                    f"{p.name}: group {g} but --prompt-data has only {len(prompts)} lines "
                    "(is it the prompt file this rollout was generated from?)"
                )
            else:
                prompt, md = prompts[g]
            rows.append({"path": p, "prompt": prompt, "metadata": md, "group": g, "slot": s})
        return rows
    if prompts is None:
        raise ValueError(f"--images {image_dir}: its images are not named group_<8d>_sample_<4d>.png, so "
                         "--prompt-data is needed to pair them with prompts")
    if len(files) != len(prompts):
        raise ValueError(
            f"--images {image_dir} has {len(files)} images and --prompt-data has {len(prompts)} prompts; "
            "without group_<8d>_sample_<4d>.png names they are paired in sorted order, so the counts must match"
        )
    for p, (prompt, md) in zip(files, prompts):
        rows.append({"path": p, "prompt": prompt, "metadata": md, "group": None, "slot": None})
    return rows


def read_video_frames(path: Path):
    """The frames of a video file (animated WebP, or any accepted image as one frame) as uint8
    [F, H, W, 3], in order. ToolError naming the file, before any frame is decoded, for more than
    MAX_VIDEO_FRAMES frames or MAX_VIDEO_PIXELS pixels in all (the header's counts); the frames
    are decoded one at a time into one array, so memory is that array and one frame."""
    import numpy as np
    from PIL import ImageSequence

    from trainer.core.image_file import ImageFileError, open_image

    try:
        with open_image(path, max_frames=MAX_VIDEO_FRAMES, max_total_pixels=MAX_VIDEO_PIXELS) as im:
            out = np.empty((getattr(im, "n_frames", 1), im.height, im.width, 3), dtype=np.uint8)
            for i, frame in enumerate(ImageSequence.Iterator(im)):
                if i == len(out) or frame.size != im.size:
                    raise ToolError(f"{path}: its frames differ from its header; not a rollout's video")
                out[i] = np.asarray(frame.convert("RGB"), dtype=np.uint8)
    except ImageFileError as e:
        raise ToolError(f"{e} (a rollout's video is at most {MAX_VIDEO_FRAMES} frames, {MAX_VIDEO_PIXELS} pixels "
                        "in all)") from None
    return out


def confine_sources(rows: list[dict], prompt_dir: str | None, media_root: str | None) -> None:
    """Each row's source references (a sidecar's SOURCE_PATHS_KEY, a prompt line's string
    entries of SOURCE_IMAGES_KEY) replaced in place by their real paths; ToolError naming the
    image and the source when one lies outside `prompt_dir` and `media_root` (data.confined_media_path)
    or no directory is given to resolve it against."""
    from trainer.core.media_key import media_file_problem
    from trainer.data import MEDIA_ROOT_FIX, confined_media_path
    from trainer.models.edit_source import SOURCE_PATHS_KEY
    from trainer.rewards.base import SOURCE_IMAGES_KEY

    base = prompt_dir or media_root
    for r in rows:
        md = r["metadata"]
        for key in (SOURCE_PATHS_KEY, SOURCE_IMAGES_KEY):
            refs = md.get(key)
            if not isinstance(refs, list) or not any(isinstance(x, str) for x in refs):
                continue
            if base is None:
                raise ToolError(f"{r['path'].name}: its record names source images ({refs[0]!r}, ...); pass "
                                "--media-root DIR (the directory of the prompt file the images were made from: "
                                "a sidecar records its sources relative to it) or --prompt-data FILE")
            out = []
            for ref in refs:
                if isinstance(ref, str):
                    real, allowed = confined_media_path(ref, base, media_root)
                    if not allowed:
                        roots = base + (f" and --media-root {media_root}" if media_root and media_root != base else "")
                        raise ToolError(f"{r['path'].name}: source image {ref!r} ({real}) lies outside {roots}; "
                                        f"{MEDIA_ROOT_FIX}")
                    problem = os.path.exists(real) and media_file_problem(real)
                    if problem:  # a FIFO, a device, a /proc file: never opened (a missing one is named when read)
                        raise ToolError(f"{r['path'].name}: source image {ref!r}: {problem}")
                    ref = real
                out.append(ref)
            r["metadata"] = md = {**md, key: out}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # the config's copy of the shipped names: trainer.rewards imports torch, and --help must not wait for it
    from trainer.config import SCORER_SHORT_NAMES as SHIPPED_SCORERS

    p = tool_parser("score", __doc__.split("\n\n")[0])
    p.add_argument(
        "--reward-scorer-path", default=None,
        help="dotpath of a scorer class or function, or a shipped short name "
             f"({', '.join(sorted(SHIPPED_SCORERS))}); required unless --reward-runtime remote",
    )
    p.add_argument("--reward-model-path", default=None, type=existing_dir,
                   help="local model directory for scorers that need weights")
    p.add_argument("--reward-runtime", default="cpu", choices=("cpu", "colocate", "remote"),
                   help="where the scorer runs, as in training")
    p.add_argument("--reward-endpoint", default=None, help="URL of a reward server (with --reward-runtime remote)")
    p.add_argument("--device", default="cpu", help="device for --reward-runtime colocate, e.g. cuda:0")
    p.add_argument("--images", required=True, type=existing_dir, help="folder of images")
    p.add_argument("--prompt-data", default=None, type=existing_file,
                   help="JSONL prompt file; needed unless every image's group sidecar is in --images")
    p.add_argument("--media-root", default=None, type=existing_dir,
                   help="directory whose files the records may name as source images, beside --prompt-data's "
                        "directory; relative sources are under it when there is no --prompt-data ('/' allows "
                        "any file)")
    p.add_argument("--reward-batch-size", "--batch-size", dest="batch_size", type=int, default=16,
                   help="images per scorer call")
    args = p.parse_args(argv)
    if args.reward_runtime == "remote" and not args.reward_endpoint:
        p.error("--reward-runtime remote needs --reward-endpoint (e.g. http://host:8000/score)")
    if args.reward_runtime != "remote" and not args.reward_scorer_path:
        p.error(f"--reward-runtime {args.reward_runtime} needs --reward-scorer-path: a shipped short name "
                f"({', '.join(sorted(SHIPPED_SCORERS))}) or the dotpath of a scorer class")
    if args.batch_size < 1:
        p.error(f"--reward-batch-size must be >= 1, got {args.batch_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from trainer.artifacts import ArtifactError
    from trainer.rewards.base import RewardError

    return run_tool("score", lambda: _score(args), (ArtifactError, RewardError))


def _score(args: argparse.Namespace) -> int:
    from trainer.core.image_file import ImageFileError, decode_rgb
    from trainer.models.edit_source import with_source_pixels
    from trainer.rewards.base import SOURCE_IMAGES_KEY
    from trainer.rewards.manager import RewardManager, scorer_tracks

    try:
        rows = match_images(args.images, read_prompt_file(args.prompt_data) if args.prompt_data else None)
        confine_sources(rows, os.path.dirname(os.path.abspath(args.prompt_data)) if args.prompt_data else None,
                        args.media_root)
        manager = RewardManager(
            args.reward_runtime, args.reward_scorer_path, args.reward_model_path, args.device, args.reward_endpoint,
            batch_size=args.batch_size,
        )
    except (ValueError, TypeError) as e:  # the messages name the file, the flag or the scorer
        raise ToolError(str(e)) from None
    totals: dict[str, tuple[float, int]] = {}  # component -> (sum, count) of its finite scores
    for start in range(0, len(rows), args.batch_size):
        chunk = rows[start:start + args.batch_size]
        images = []
        for r in chunk:
            if "video" in scorer_tracks(manager.scorer):
                images.append(read_video_frames(r["path"]))
                continue
            try:
                images.append(decode_rgb(r["path"]))
            except ImageFileError as e:
                raise ToolError(str(e)) from None
        # an edit's sidecar names its sources: the edit scorers get their pixels as in training (a
        # video's [F, H, W, 3] frames give its size; its sidecar names no sources)
        sizes = [(im.height, im.width) if hasattr(im, "convert") else tuple(im.shape[1:3]) for im in images]
        try:
            metadata = with_source_pixels([r["metadata"] for r in chunk], sizes, SOURCE_IMAGES_KEY)
        except (ValueError, OSError) as e:  # edit_source's errors name the source file
            raise ToolError(str(e)) from None
        if images and not hasattr(images[0], "convert"):
            from trainer.rewards.video import VideoBatch

            images = VideoBatch(images)
        out = manager.score(images, [r["prompt"] for r in chunk], metadata)
        for i, r in enumerate(chunk):
            scores = {}
            for name, t in out.components.items():
                v = float(t[i])
                scores[name] = v if math.isfinite(v) else None
                if math.isfinite(v):
                    totals[name] = (totals.get(name, (0.0, 0))[0] + v, totals.get(name, (0.0, 0))[1] + 1)
                else:
                    totals.setdefault(name, (0.0, 0))
            line = {"image": r["path"].name, "prompt": r["prompt"], "group": r["group"], "slot": r["slot"]}
            print(json.dumps({**line, "scores": scores}), flush=True)
    for name, (total, n) in sorted(totals.items()):
        mean = f"{total / n:.6g}" if n else "none"
        print(f"score: {name}: mean {mean} over {n} of {len(rows)} images (the others scored NaN)"
              if n < len(rows) else f"score: {name}: mean {mean} over {n} images", file=sys.stderr)
    if rows and not any(n for _, n in totals.values()):
        # a scorer or endpoint that scored nothing (an outage, a malformed answer: the warnings above
        # say which) must not end like a scoring run
        print(f"flowgrpo-score: error: none of the {len(rows)} images got a finite score from "
              f"{args.reward_endpoint or args.reward_scorer_path}; see the warnings above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
