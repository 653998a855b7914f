"""Check prompt files before a run: exit 0 when clean, 2 with a per-problem report otherwise.

    python tools/inspect_data.py --train data/processed/t2i/pickapic_train.jsonl \\
        --eval data/processed/t2i/pickapic_eval256.jsonl --decode-media

Either flag alone checks its files on their own (--eval alone: no leakage check, there is no
train file to compare with); give both for the leakage check.

Errors (each reported as ``file:line: what``):

- a line that is not a JSON object (bad JSON, blank line, bad UTF-8);
- schema: unknown top-level keys, missing ``prompt`` / ``metadata.task`` / ``metadata.sample_id``,
  a ``metadata.task`` outside GENERATION_TASKS, a malformed sample id;
- ``<image>`` / ``<video>`` placeholder counts that differ from the ``images`` / ``videos`` lists;
- a referenced media file that does not exist (with --decode-media: that does not decode);
- a referenced media file outside the prompt file's directory and --media-root (symlinks
  followed; ``--media-root /`` allows any file);
- a sample id used twice in one file;
- train/eval leakage (both flags given): an eval record whose sample id, or whose content (the
  prompt, plus the bytes of its media files in order), is in train;
- an empty file.

Warnings (reported, exit status unaffected): the same prompt (and media bytes) twice within one file.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.cli import EXIT_USAGE, existing_dir, existing_file, run_tool, tool_parser  # noqa: E402
from trainer.core.media_key import media_file_problem  # noqa: E402
from trainer.data import (MEDIA_ROOT_FIX, MediaDigests, PromptRecord, confined_media_path, find_leakage,
                          iter_jsonl_lines, parse_record, record_dedup_key, record_problems, where)

DEFAULT_MAX_REPORT = 200


@dataclass
class FileScan:
    """One file's valid records (with line numbers) and its problems."""

    path: str
    records: list[tuple[int, PromptRecord]] = field(default_factory=list)
    #: record_dedup_key of each record (prompt + media bytes), parallel to records
    keys: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    lines: int = 0


def decode_problem(path: str, kind: str) -> str | None:
    """None if the media file decodes fully, else why not.

    Decoded with Pillow as PNG, JPEG or WebP only (trainer.core.image_file: a file of another
    format is refused by its bytes, whatever its name), the header's size checked before a pixel
    is decoded, every pixel read, so truncated files fail. A video is read as the project writes
    one, an animated WebP, every frame, within MAX_VIDEO_FRAMES frames and MAX_VIDEO_PIXELS pixels
    in all: no general-purpose video demuxer sees a file a prompt names (FFmpeg's playlist and
    concat formats read other files and URLs).
    """
    from PIL import ImageSequence

    from trainer.core.image_file import (MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS, ImageFileError, decode_rgb,
                                         open_image)

    try:  # the accepted formats only, the size checked from the header before decoding
        if kind == "images":
            decode_rgb(path, os.path.basename(path))
            return None
        with open_image(path, os.path.basename(path), max_frames=MAX_VIDEO_FRAMES,
                        max_total_pixels=MAX_VIDEO_PIXELS) as im:
            for frame in ImageSequence.Iterator(im):
                frame.convert("RGB").load()
    except ImageFileError as e:
        return str(e) + (" (a video is checked as an animated WebP, the format rollouts are written in)"
                         if kind != "images" else "")
    except Exception as e:  # noqa: BLE001 - any decoder failure is the finding
        return f"{type(e).__name__}: {e}"
    return None


def scan_file(path: str, decode_media: bool, digests: MediaDigests | None = None,
              media_root: str | None = None) -> FileScan:
    """Per-line checks of one prompt file (everything except cross-file leakage); a media file
    outside the file's directory and `media_root` (symlinks followed) is an error, never read."""
    scan = FileScan(path=path)
    digests = digests or MediaDigests()
    if not os.path.isfile(path):
        scan.errors.append(f"{where(path)}: no such file")
        return scan
    base = os.path.dirname(os.path.abspath(path))
    ids: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for lineno, obj, error in iter_jsonl_lines(path):
        scan.lines += 1
        if error is not None:
            scan.errors.append(f"{where(path, lineno)}: {error}")
            continue
        problems = record_problems(obj)
        if problems:
            scan.errors.extend(f"{where(path, lineno)}: {p}" for p in problems)
            continue
        rec = parse_record(obj)
        outside = False
        for kind, refs in (("images", rec.images), ("videos", rec.videos)):
            for ref in refs:
                full, allowed = confined_media_path(ref, base, media_root)
                if not allowed:
                    outside = True
                    scan.errors.append(f"{where(path, lineno)}: {kind} file {ref!r} ({full}) lies outside the "
                                       f"prompt file's directory; {MEDIA_ROOT_FIX}")
                    continue
                problem = media_file_problem(full)
                if not os.path.exists(full):
                    scan.errors.append(f"{where(path, lineno)}: {kind} file {ref!r} does not exist ({full})")
                elif problem:  # a FIFO, a device, a /proc file, an oversized one: never opened
                    scan.errors.append(f"{where(path, lineno)}: {kind} file {ref!r}: {problem}")
                elif decode_media:
                    why = decode_problem(full, kind)
                    if why:
                        scan.errors.append(f"{where(path, lineno)}: {kind} file {ref!r} does not decode: {why}")
        if rec.sample_id in ids:
            scan.errors.append(f"{where(path, lineno)}: sample_id {rec.sample_id!r} already used at line "
                               f"{ids[rec.sample_id]}; ids must be unique (run tools/curate_data.py)")
        else:
            ids[rec.sample_id] = lineno
        if outside:
            continue  # its media are not read: the error above says why
        h = record_dedup_key(rec, base, digests)
        if h in hashes:
            scan.warnings.append(f"{where(path, lineno)}: same prompt as line {hashes[h]} "
                                 "(tools/curate_data.py dedups)")
        else:
            hashes[h] = lineno
        scan.records.append((lineno, rec))
        scan.keys.append(h)
    if scan.lines == 0:
        scan.errors.append(f"{where(path)}: the file is empty")
    return scan


def leakage_errors(train: FileScan, other: FileScan) -> list[str]:
    """An error per record of ``other`` whose sample id or prompt (content hash) is in ``train``."""
    errors = []
    # the keys were computed against each file's own directory: a relative media path means a
    # different file in each, and the same bytes match under any name
    for kind, i, j in find_leakage((r for _, r in train.records), (r for _, r in other.records),
                                   keys_a=train.keys, keys_b=other.keys):
        train_line, rec = train.records[i][0], other.records[j][1]
        what = f"sample_id {rec.sample_id!r} is" if kind == "sample_id" else "the same prompt is"
        errors.append(f"{where(other.path, other.records[j][0])}: leakage: {what} also in "
                      f"{where(train.path, train_line)}")
    return errors


def inspect(train_path: str | None, eval_paths: list[str], decode_media: bool = False,
            media_root: str | None = None) -> tuple[list[str], list[str], list[FileScan]]:
    """(errors, warnings, scans) for a train file and its eval files; either may be absent (None /
    []), and leakage is checked only when both are there."""
    digests = MediaDigests()  # a file shared by train and eval is read once
    train = scan_file(train_path, decode_media, digests, media_root) if train_path else None
    evals = [scan_file(p, decode_media, digests, media_root) for p in eval_paths]
    scans = ([train] if train else []) + evals
    errors = [e for s in scans for e in s.errors]
    warnings = [w for s in scans for w in s.warnings]
    if train is not None:
        for s in evals:
            errors.extend(leakage_errors(train, s))
    return errors, warnings, scans


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("inspect_data", __doc__.split("\n\n")[0])
    p.add_argument("--train", default=None, type=existing_file,
                   help="the training prompt JSONL (at least one of --train / --eval is required)")
    p.add_argument("--eval", default=[], nargs="+", type=existing_file,
                   help="eval prompt JSONL file(s), checked for leakage against --train when it is given")
    p.add_argument("--decode-media", action="store_true", help="also decode every referenced media file")
    p.add_argument("--media-root", default=None, type=existing_dir,
                   help="directory whose files the prompt files may also name as media, beside their own "
                        "directory (a path outside both, symlinks followed, is an error; '/' allows any file)")
    p.add_argument("--max-report", type=int, default=DEFAULT_MAX_REPORT,
                   help="print at most this many errors and warnings each (the counts are always complete)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.train and not args.eval:
        parser.error("give --train FILE, --eval FILE [FILE ...], or both (both: also checks train/eval leakage)")
    if args.max_report < 0:
        parser.error(f"--max-report must be >= 0, got {args.max_report}")
    return run_tool("inspect_data", lambda: _inspect(args))


def _inspect(args) -> int:
    errors, warnings, scans = inspect(args.train, args.eval, args.decode_media, args.media_root)
    for label, items in (("error", errors), ("warning", warnings)):
        for line in items[:args.max_report]:
            print(f"{label}: {line}")
        if len(items) > args.max_report:
            print(f"{label}: ... {len(items) - args.max_report} more not shown (--max-report)")
    for s in scans:
        print(f"inspect_data: {s.path}: {s.lines} line(s), {len(s.records)} valid record(s)")
    if errors:
        # bad data is bad input, like a bad flag: the same status as every tool's input errors
        print(f"inspect_data: FAILED: {len(errors)} error(s), {len(warnings)} warning(s)")
        return EXIT_USAGE
    print(f"inspect_data: OK ({len(warnings)} warning(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
