"""Convert a public prompt source into the unified prompt JSONL (one record per line).

    python tools/prepare_data.py --source pickapic --input /data/pick_a_pic_prompts \\
        --task t2i --output data/raw/t2i/pickapic.jsonl

Sources (the CONVERTERS registry):

- ``pickapic``: Pick-a-Pic parquet files (a file, or a directory searched recursively for
  ``*.parquet``, in sorted path order). Only the ``caption`` column is read, one record batch at a
  time, so multi-GB files with image bytes never load whole.
- ``prompts``: a parquet file with a prompt column (``--column``; default the first of
  prompt / caption / text), a ``.jsonl`` file with a ``prompt`` field (``--column`` picks another
  field), or any other file as plain text with one prompt per line.

Every prompt is whitespace-normalised. Its sample id is ``<id-prefix>_<16 hex of its content
hash>`` (trainer.data.stable_sample_id): stable across file names, shards and row order. Identical
prompts therefore share an id, so repeats are written once and counted as duplicates. Empty prompts
are skipped and counted; a malformed JSONL line or a missing column is an error naming the file
(and line). The output is byte-for-byte reproducible, written to ``<output>.tmp`` and renamed
over ``--output`` when complete: a failed run removes the ``.tmp``; one left by a killed run is
reported and replaced by the next run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.data import (MAX_LINE_BYTES, DataError, content_hash, iter_lines_bounded, normalize_prompt, read_jsonl,
                          stable_sample_id, where, write_jsonl)
from trainer.cli import ToolError, existing_path, output_file, run_tool, tool_parser  # noqa: E402
from trainer.models.base import GENERATION_TASKS

#: rows per pyarrow record batch: bounds memory whatever the file size
PARQUET_BATCH_ROWS = 8192
PROMPT_COLUMN_CANDIDATES = ("prompt", "caption", "text")

# A converter yields (origin, raw_prompt): origin is "file:row" / "file:line" for messages,
# raw_prompt is the text or None when the source row has no prompt (counted as empty).
RawPrompts = Iterator[tuple[str, "str | None"]]


def iter_parquet_column(path: str, column: str) -> RawPrompts:
    """Stream one string column of a parquet file, batch by batch (0-based row numbers)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{where(path)}: no column {column!r}; columns are {names}; choose one with --column")
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
        for value in batch.column(0).to_pylist():
            if value is not None and not isinstance(value, str):
                raise DataError(f"{where(path)}: row {row} of column {column!r} is {type(value).__name__}, "
                                "not text; choose a text column with --column")
            yield f"{path}:row {row}", value
            row += 1


def parquet_files(input_path: str) -> list[str]:
    """The parquet files of ``input_path`` (a file, or a directory searched recursively), sorted."""
    if os.path.isfile(input_path):
        return [input_path]
    if not os.path.isdir(input_path):
        raise DataError(f"--input {input_path}: no such file or directory")
    files = sorted(os.path.join(root, name)
                   for root, _, names in os.walk(input_path) for name in names if name.endswith(".parquet"))
    if not files:
        raise DataError(f"--input {input_path}: no *.parquet files under this directory")
    return files


def convert_pickapic(input_path: str, column: str | None) -> RawPrompts:
    """Pick-a-Pic: the ``caption`` column (or ``--column``) of every parquet file under the input."""
    for path in parquet_files(input_path):
        yield from iter_parquet_column(path, column or "caption")


def convert_prompts(input_path: str, column: str | None) -> RawPrompts:
    """Generic prompts: parquet column, JSONL field, or plain text lines (chosen by extension)."""
    if not os.path.isfile(input_path):
        raise DataError(f"--input {input_path}: no such file (the prompts source takes one file)")
    lower = input_path.lower()
    if lower.endswith(".parquet"):
        if column is None:
            import pyarrow.parquet as pq

            names = pq.ParquetFile(input_path).schema_arrow.names
            column = next((c for c in PROMPT_COLUMN_CANDIDATES if c in names), None)
            if column is None:
                raise DataError(f"{where(input_path)}: none of the columns {list(PROMPT_COLUMN_CANDIDATES)} "
                                f"exists (columns: {names}); choose one with --column")
        yield from iter_parquet_column(input_path, column)
    elif lower.endswith((".jsonl", ".ndjson")):
        field = column or "prompt"
        for lineno, obj in read_jsonl(input_path):
            if not isinstance(obj, dict) or field not in obj:
                raise DataError(f"{where(input_path, lineno)}: expected an object with a {field!r} field; "
                                "fix the line or choose the field with --column")
            value = obj[field]
            if value is not None and not isinstance(value, str):
                raise DataError(f"{where(input_path, lineno)}: {field!r} is {type(value).__name__}, not text")
            yield f"{input_path}:{lineno}", value
    else:
        with open(input_path, "rb") as f:
            for lineno, raw in iter_lines_bounded(f):
                if raw is None:
                    raise DataError(f"{where(input_path, lineno)}: line longer than {MAX_LINE_BYTES} bytes; "
                                    "a prompt is one line of at most a few thousand characters")
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # drop a BOM
                except UnicodeDecodeError as e:
                    raise DataError(f"{where(input_path, lineno)}: not valid UTF-8 ({e.reason}); "
                                    "re-encode the file as UTF-8") from None
                yield f"{input_path}:{lineno}", line


CONVERTERS: dict[str, Callable[[str, "str | None"], RawPrompts]] = {
    "pickapic": convert_pickapic,
    "prompts": convert_prompts,
}


def prepare(source: str, input_path: str, task: str, output: str, column: str | None = None,
            id_prefix: str | None = None) -> Counter:
    """Convert ``input_path`` with CONVERTERS[source] and write ``output``; returns the counts
    (``read``, ``written``, ``empty``, ``duplicate``)."""
    if source not in CONVERTERS:
        raise DataError(f"--source {source!r}: unknown; choose one of {sorted(CONVERTERS)}")
    if task not in GENERATION_TASKS:
        raise DataError(f"--task {task!r}: not a generation task; choose one of {list(GENERATION_TASKS)}")
    prefix = id_prefix or source
    if not prefix or any(c.isspace() for c in prefix):
        raise DataError(f"--id-prefix {prefix!r}: must be non-empty without whitespace")
    counts: Counter = Counter()
    # id -> full content hash: a 64-bit id collision between two different prompts is reported,
    # not merged. ~100 bytes per distinct prompt.
    seen: dict[str, str] = {}

    def rows() -> Iterator[dict]:
        for origin, raw in CONVERTERS[source](input_path, column):
            counts["read"] += 1
            prompt = normalize_prompt(raw) if raw is not None else ""
            if not prompt:
                counts["empty"] += 1
                continue
            full = content_hash(prompt)
            sid = stable_sample_id(prefix, prompt)
            if sid in seen:
                if seen[sid] != full:
                    raise DataError(f"{origin}: sample id {sid} collides with a different prompt "
                                    "(64-bit hash collision); use another --id-prefix for one of the sources")
                counts["duplicate"] += 1
                continue
            seen[sid] = full
            yield {"prompt": prompt, "metadata": {"sample_id": sid, "source": source, "task": task}}

    counts["written"] = write_jsonl(output, rows())
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("prepare_data", __doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, choices=sorted(CONVERTERS),
                   help="converter: pickapic (parquet caption column) or prompts (parquet / JSONL / text)")
    p.add_argument("--input", required=True, type=existing_path,
                   help="pickapic: a parquet file or a directory of them; prompts: one file "
                        "(.parquet, .jsonl, or text with one prompt per line)")
    p.add_argument("--task", "--generation-task", dest="task", default="t2i",
                   help=f"metadata.task of every record; one of {list(GENERATION_TASKS)}")
    p.add_argument("--output", required=True, help="the JSONL file to write (replaced atomically)")
    p.add_argument("--column", default=None,
                   help="parquet column / JSONL field holding the prompt (unset: pickapic 'caption'; "
                        "prompts parquet the first of prompt/caption/text, prompts JSONL 'prompt')")
    p.add_argument("--id-prefix", default=None,
                   help="sample ids are '<id-prefix>_<content hash>' (unset: the --source name)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_tool("prepare_data", lambda: _prepare(args), (DataError, ToolError))


def _prepare(args: argparse.Namespace) -> int:
    output_file("--output", args.output)
    tmp = args.output + ".tmp"
    if os.path.isdir(tmp):
        raise DataError(f"--output {args.output}: {tmp} (the temporary file this tool writes first) is a directory; "
                        "remove it or choose another --output")
    if os.path.exists(tmp):
        # only this tool writes <output>.tmp, and only until the rename: it is a killed run's
        print(f"prepare_data: note: {tmp} is left from an interrupted run; it is replaced")
    counts = prepare(args.source, args.input, args.task, args.output, args.column, args.id_prefix)
    print(f"prepare_data: read {counts['read']} prompt(s) from {args.input}; wrote {counts['written']} "
          f"record(s) to {args.output}")
    print(f"prepare_data: skipped {counts['empty']} empty prompt(s), {counts['duplicate']} duplicate(s) "
          "(same prompt after whitespace normalisation, hence the same sample id)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
