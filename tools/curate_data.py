"""Dedup, filter and split a prompt JSONL into train / eval files.

    python tools/curate_data.py --input data/raw/t2i/pickapic.jsonl --output-dir data/processed/t2i \\
        --prefix pickapic_ --min-prompt-words 6 --eval-size 2048 --eval-subset-sizes 64 256 \\
        --no-check-media

writes pickapic_train.jsonl, pickapic_eval.jsonl, pickapic_eval64.jsonl, pickapic_eval256.jsonl.
Without --eval-size the split is by --eval-fraction and the files are <prefix>_train.jsonl /
<prefix>_eval.jsonl (plus any requested subsets). A prefix is joined to the name with "_" unless
it already ends in "_", "-" or "." (--prefix pickapic and --prefix pickapic_ both give
pickapic_train.jsonl); no prefix gives train.jsonl. Output files are replaced (atomically; the
report says which ones were).

Every step is deterministic, never RNG:

1. validate every line (a malformed or invalid line stops the run with its file:line), and
   every media reference: one outside the input file's directory and --media-root (symlinks
   followed; ``--media-root /`` allows any file) stops the run too, before any file is read;
2. drop records whose media files do not exist (unless --no-check-media);
3. drop prompts with fewer than --min-prompt-words words (placeholders not counted);
4. dedup by content key (the whitespace-normalised prompt, plus for a record with media the
   sha256 of each media file's bytes in order and its metadata but ``source``: the same image
   under two names is a duplicate, two images with one name in different directories are not,
   nor are two edits of one image that ask for different targets, e.g. metadata.color "red" and
   "green"); of a set of duplicates the record
   with the smallest sample_id is kept, so the result depends on the set of records, not their
   order;
5. split by u = split_unit(sample_id) in [0, 1): --eval-fraction F puts u < F in eval (a record
   keeps its side when records are added or reordered); --eval-size N puts the N smallest u in
   eval (reordering changes nothing; an added record can only displace an eval record to train,
   never pull a train record into eval);
6. eval subsets eval<A> are the A smallest-u eval records, so eval64 is inside eval256 is
   inside eval.

Files keep input order and are canonical JSON lines, so a rerun writes identical bytes.
Relative media paths are rewritten to stay valid relative to --output-dir.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.cli import ToolError, existing_dir, existing_file, output_dir, run_tool, tool_parser  # noqa: E402
from trainer.core.media_key import media_file_problem  # noqa: E402
from trainer.data import (MEDIA_ROOT_FIX, DataError, MediaDigests, PromptRecord, confined_media_path, count_words,
                          iter_jsonl_lines, parse_record, record_content_hash, record_dedup_key, resolve_media_path, split_unit, where,
                          write_jsonl)

DEFAULT_EVAL_FRACTION = 0.05
#: how many offending lines an error or a drop report lists before summarising
MAX_LISTED = 20
EXAMPLES_PER_REASON = 3


@dataclass
class CurateReport:
    """What curate() read, dropped (reason -> input line numbers) and wrote (path -> count)."""

    read: int = 0
    dropped: dict[str, list[int]] = field(default_factory=dict)
    train: int = 0
    eval: int = 0
    written: dict[str, int] = field(default_factory=dict)
    replaced: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)


#: a prefix ending in one of these is used as it is; any other gets "_" before the name
PREFIX_SEPARATORS = ("_", "-", ".")


def name_prefix(prefix: str) -> str:
    """The prefix as it starts a file name: "pickapic" -> "pickapic_", "pickapic_" and "" unchanged."""
    return prefix if not prefix or prefix.endswith(PREFIX_SEPARATORS) else prefix + "_"


def output_names(prefix: str, subset_sizes: list[int]) -> tuple[str, str, list[str]]:
    """The curated file names: <prefix>_train.jsonl, <prefix>_eval.jsonl, <prefix>_eval<A>.jsonl
    (name_prefix adds the separator)."""
    prefix = name_prefix(prefix)
    return f"{prefix}train.jsonl", f"{prefix}eval.jsonl", [f"{prefix}eval{a}.jsonl" for a in subset_sizes]


def load_records(path: str) -> list[tuple[int, PromptRecord]]:
    """Every record of ``path`` with its line number; DataError listing every bad line
    (malformed JSON, schema violations, a sample id reused for different content)."""
    if not os.path.isfile(path):
        raise DataError(f"--input {path}: no such file")
    problems: list[str] = []
    records: list[tuple[int, PromptRecord]] = []
    first_line: dict[str, tuple[int, str]] = {}
    for lineno, obj, error in iter_jsonl_lines(path):
        if error is None:
            try:
                rec = parse_record(obj)
            except ValueError as e:
                error = str(e)
        if error is not None:
            problems.append(f"{where(path, lineno)}: {error}")
            continue
        h = record_content_hash(rec)
        if rec.sample_id in first_line and first_line[rec.sample_id][1] != h:
            problems.append(f"{where(path, lineno)}: sample_id {rec.sample_id!r} already used at line "
                            f"{first_line[rec.sample_id][0]} for a different prompt; ids must be unique "
                            "(tools/prepare_data.py derives them from the prompt)")
            continue
        first_line.setdefault(rec.sample_id, (lineno, h))
        records.append((lineno, rec))
    if problems:
        shown = problems[:MAX_LISTED]
        more = f"\n... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise DataError(f"{len(problems)} bad line(s) in {path}; fix them and rerun "
                        "(nothing was written):\n" + "\n".join(shown) + more)
    if not records:
        raise DataError(f"--input {path}: the file has no records")
    return records


def split_records(keys: list[str], eval_size: int | None, eval_fraction: float | None,
                  subset_sizes: list[int]) -> tuple[set[str], list[set[str]]]:
    """Eval membership by sample id: (eval ids, [ids of each subset]), see the module doc, step 5-6.

    ``keys`` are the kept sample ids. Raises DataError if train or eval would be empty or a subset
    is larger than eval.
    """
    ranked = sorted(keys, key=lambda sid: (split_unit(sid), sid))
    if eval_size is not None:
        if eval_size >= len(ranked):
            raise DataError(f"--eval-size {eval_size}: only {len(ranked)} record(s) left after filtering, "
                            "so no train records would remain; lower --eval-size")
        eval_ranked = ranked[:eval_size]
    else:
        eval_ranked = [sid for sid in ranked if split_unit(sid) < eval_fraction]
        if not eval_ranked:
            raise DataError(f"--eval-fraction {eval_fraction}: no record of {len(ranked)} falls in eval; "
                            "raise --eval-fraction or use --eval-size")
        if len(eval_ranked) == len(ranked):
            raise DataError(f"--eval-fraction {eval_fraction}: every record falls in eval; lower it")
    for a in subset_sizes:
        if a > len(eval_ranked):
            raise DataError(f"--eval-subset-sizes {a}: larger than the eval split ({len(eval_ranked)} "
                            "record(s)); lower it or enlarge the eval split")
    return set(eval_ranked), [set(eval_ranked[:a]) for a in subset_sizes]


def rebase_media(rec: PromptRecord, src_dir: str, out_dir: str) -> PromptRecord:
    """Rewrite relative media paths so they point at the same files from ``out_dir``."""
    def move(ref: str) -> str:
        if os.path.isabs(ref):
            return ref
        return os.path.relpath(resolve_media_path(ref, src_dir), out_dir).replace(os.sep, "/")

    if not rec.media():
        return rec
    return PromptRecord(rec.prompt, rec.task, rec.sample_id, tuple(map(move, rec.images)),
                        tuple(map(move, rec.videos)), rec.extra)


def curate(input_path: str, out_dir: str, prefix: str = "", min_prompt_words: int = 0,
           eval_size: int | None = None, eval_subset_sizes: list[int] | tuple[int, ...] = (),
           eval_fraction: float | None = None, check_media: bool = True,
           media_root: str | None = None) -> CurateReport:
    """Run steps 1-6 of the module doc and write the files; returns what happened."""
    subset_sizes = list(eval_subset_sizes)
    if eval_size is not None and eval_fraction is not None:
        raise DataError("--eval-size and --eval-fraction are alternatives; give one")
    if eval_size is not None and eval_size < 1:
        raise DataError(f"--eval-size must be >= 1, got {eval_size}")
    if eval_size is None:
        eval_fraction = DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
        if not 0.0 < eval_fraction < 1.0:
            raise DataError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
    if any(a < 1 for a in subset_sizes) or len(set(subset_sizes)) != len(subset_sizes):
        raise DataError(f"--eval-subset-sizes must be distinct positive sizes, got {subset_sizes}")
    if min_prompt_words < 0:
        raise DataError(f"--min-prompt-words must be >= 0, got {min_prompt_words}")

    train_name, eval_name, subset_names = output_names(prefix, subset_sizes)
    out_paths = [os.path.join(out_dir, n) for n in (train_name, eval_name, *subset_names)]
    src = os.path.abspath(input_path)
    if any(os.path.abspath(p) == src for p in out_paths):
        raise DataError(f"--input {input_path} would be overwritten by an output; use another --output-dir or --prefix")
    output_dir("--output-dir", out_dir)
    taken = [p for p in out_paths if os.path.isdir(p)]
    if taken:
        raise DataError(f"--output-dir {out_dir}: {', '.join(taken)} is a directory where an output file goes; "
                        "remove it or choose another --output-dir or --prefix")

    report = CurateReport()
    records = load_records(input_path)
    report.read = len(records)
    src_dir = os.path.dirname(src)

    def drop(reason: str, lineno: int) -> None:
        report.dropped.setdefault(reason, []).append(lineno)

    # a prompt file names only its own data: no file elsewhere on the host is read to hash it
    outside = [f"{where(input_path, lineno)}: {ref!r} is {real}" for lineno, rec in records for ref in rec.media()
               for real, allowed in [confined_media_path(ref, src_dir, media_root)] if not allowed]
    if outside:
        more = f"\n... and {len(outside) - MAX_LISTED} more" if len(outside) > MAX_LISTED else ""
        raise DataError(f"{len(outside)} media reference(s) of {input_path} lie outside its directory"
                        f"{' and --media-root ' + media_root if media_root else ''} (nothing was read or written); "
                        f"{MEDIA_ROOT_FIX}:\n" + "\n".join(outside[:MAX_LISTED]) + more)
    kept_by_hash: dict[str, tuple[int, PromptRecord]] = {}
    digests = MediaDigests()
    for lineno, rec in records:
        for ref in rec.media():
            # a FIFO, a device, a /proc file or an oversized one named as media is refused, not
            # dropped as missing and never read (its hash could take minutes, or never end)
            full = resolve_media_path(ref, src_dir)
            problem = os.path.exists(full) and media_file_problem(full)
            if problem:
                raise DataError(f"{where(input_path, lineno)}: media file {ref!r}: {problem}; fix or delete the record")
        if check_media:
            missing = [p for p in rec.media() if not os.path.isfile(resolve_media_path(p, src_dir))]
            if missing:
                drop("missing media file (--no-check-media keeps such records)", lineno)
                continue
        if count_words(rec.prompt) < min_prompt_words:
            drop(f"fewer than {min_prompt_words} words (--min-prompt-words)", lineno)
            continue
        h = record_dedup_key(rec, src_dir, digests)
        if h in kept_by_hash:
            other_line, other = kept_by_hash[h]
            # Keep the smallest sample id so the result does not depend on input order.
            if rec.sample_id < other.sample_id:
                kept_by_hash[h] = (lineno, rec)
                lineno = other_line
            drop("duplicate prompt (same content hash as a kept record)", lineno)
            continue
        kept_by_hash[h] = (lineno, rec)

    kept = sorted(kept_by_hash.values(), key=lambda t: t[0])  # input order
    eval_ids, subsets = split_records([r.sample_id for _, r in kept], eval_size, eval_fraction, subset_sizes)

    out_abs = os.path.abspath(out_dir)
    rows = [(rec.sample_id, rebase_media(rec, src_dir, out_abs).to_dict()) for _, rec in kept]
    train_ids = {sid for sid, _ in rows} - eval_ids
    for path, members in zip(out_paths, [train_ids, eval_ids, *subsets]):
        if os.path.exists(path):
            report.replaced.append(path)
        report.written[path] = write_jsonl(path, (row for sid, row in rows if sid in members))
    report.train = report.written[out_paths[0]]
    report.eval = report.written[out_paths[1]]
    written = {os.path.abspath(p) for p in out_paths}
    pattern = f"{glob.escape(name_prefix(prefix))}eval*.jsonl"
    report.stale = sorted(p for p in glob.glob(os.path.join(glob.escape(out_dir), pattern))
                          if os.path.abspath(p) not in written)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("curate_data", __doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, type=existing_file, help="the prompt JSONL to curate (e.g. prepare_data.py's output)")
    p.add_argument("--output-dir", "--out-dir", dest="output_dir", required=True,
                   help="directory for <prefix>_train.jsonl, <prefix>_eval.jsonl, ... (created if missing)")
    p.add_argument("--prefix", default="",
                   help="file name prefix: 'pickapic' (or 'pickapic_') writes pickapic_train.jsonl (unset: train.jsonl)")
    p.add_argument("--min-prompt-words", type=int, default=0,
                   help="drop prompts with fewer words (media placeholders not counted); the Pick-a-Pic "
                        "preset is 6: one- and two-word captions give almost no intra-group reward variance")
    p.add_argument("--eval-size", type=int, default=None,
                   help="eval split = the N records with the smallest sample-id hash; excludes --eval-fraction")
    p.add_argument("--eval-subset-sizes", type=int, nargs="+", default=[],
                   help="also write <prefix>eval<A>.jsonl for each A: nested subsets of eval (each <= eval size)")
    p.add_argument("--eval-fraction", type=float, default=None,
                   help=f"without --eval-size: eval = records whose sample-id hash is below F "
                        f"(unset: {DEFAULT_EVAL_FRACTION}); must be in (0, 1)")
    p.add_argument("--no-check-media", action="store_true",
                   help="keep records whose media files do not exist (unset: drop them)")
    p.add_argument("--media-root", default=None, type=existing_dir,
                   help="directory whose files the input may also name as media, beside its own directory (a "
                        "path outside both, symlinks followed, is an error; '/' allows any file)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool("curate_data", lambda: _curate(args), (DataError, ToolError))


def _curate(args: argparse.Namespace) -> int:
    report = curate(args.input, args.output_dir, args.prefix, args.min_prompt_words, args.eval_size,
                    args.eval_subset_sizes, args.eval_fraction, not args.no_check_media, args.media_root)
    print(f"curate_data: read {report.read} record(s) from {args.input}")
    for reason, lines in report.dropped.items():
        examples = ", ".join(str(n) for n in lines[:EXAMPLES_PER_REASON])
        more = ", ..." if len(lines) > EXAMPLES_PER_REASON else ""
        print(f"curate_data: dropped {len(lines)}: {reason} (input lines {examples}{more})")
    if not report.dropped:
        print("curate_data: dropped 0")
    print(f"curate_data: split by sha256(sample_id): train {report.train}, eval {report.eval}")
    for path, n in report.written.items():
        note = " (replaced the existing file)" if path in report.replaced else ""
        print(f"curate_data: wrote {path}: {n} record(s){note}")
    for path in report.stale:
        print(f"curate_data: note: {path} was not written by this run (left from an earlier run?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
