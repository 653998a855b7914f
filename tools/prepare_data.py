"""Convert a public prompt source into the unified prompt JSONL (one record per line).

    python tools/prepare_data.py --source pickapic --input /data/pick_a_pic_prompts \\
        --task t2i --output data/raw/t2i/pickapic.jsonl

Sources (the CONVERTERS registry):

- ``pickapic``: Pick-a-Pic parquet files (a file, or a directory searched recursively for
  ``*.parquet``, in sorted path order). Only the ``caption`` column is read, one record batch at a
  time, so multi-GB files with image bytes never load whole; a row group whose prompt column is
  larger than ``--max-parquet-chunk-mb`` (or 1 MiB a row on average) is refused from the file's
  metadata before it is read.
- ``prompts``: a parquet file with a prompt column (``--column``; default the first of
  prompt / caption / text), a ``.jsonl`` file with a ``prompt`` field (``--column`` picks another
  field), or any other file as plain text with one prompt per line.
- ``edit``: image-editing pairs, a ``.jsonl`` or ``.parquet`` file with a source-image column
  (``--image-column``; a path, encoded image bytes, a {"bytes", "path"} struct as Hugging Face
  datasets store images, or a list of those for several sources) and an instruction column
  (``--column``). Bytes are written once per distinct image to ``--media-dir`` as
  ``<sha256>.<ext>``; paths are kept (relative ones are under ``--media-root``). Each record is
  ``{"prompt": "<image> <instruction>", "images": [...]}`` with media paths relative to the
  output's directory, and its sample id hashes the instruction AND the image bytes.

Every prompt is whitespace-normalised. Its sample id is ``<id-prefix>_<16 hex of its content
hash>`` (trainer.data.stable_sample_id): stable across file names, shards and row order. Identical
prompts therefore share an id, so repeats are written once and counted as duplicates. Empty prompts
are skipped and counted; a malformed JSONL line, a missing column, a prompt over the trainer's
10,000 characters or a record line over 1 MiB (in every source) is an error naming the file (and
line or row). The output is byte-for-byte reproducible, written to a fresh temporary beside it
(``<output>.<random>.tmp``) and renamed over ``--output`` when complete: a failed run removes the
temporary; an ``<output>.tmp`` left by a killed run of an earlier version is reported and removed
by the next successful run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.data import (MAX_LINE_BYTES, MAX_PROMPT_CHARS, DataError, canonical_json, content_hash, file_sha256,
                          iter_lines_bounded, media_content_hash, normalize_prompt, read_jsonl, stable_media_sample_id,
                          stable_sample_id, where, write_jsonl)
from trainer.cli import ToolError, existing_path, output_file, run_tool, tool_parser  # noqa: E402
from trainer.core.files import atomic_writer  # noqa: E402
from trainer.data import confined_media_path  # noqa: E402
from trainer.models.edit_source import header_problem  # noqa: E402
from trainer.core.media_key import MediaFileError, media_file_problem  # noqa: E402
from trainer.config import GENERATION_TASKS  # noqa: E402

#: rows per pyarrow record batch: bounds memory whatever the file size
PARQUET_BATCH_ROWS = 8192
PROMPT_COLUMN_CANDIDATES = ("prompt", "caption", "text")
#: the most uncompressed bytes the prompt column may hold in one row group (parquet metadata,
#: checked before the row group is read). The reader decodes a page at a time, but a page holds
#: whole values, so one huge cell (a 1 GiB "caption" compresses to kilobytes) would be held at
#: once, several times over; this bounds what it can be. A million 200-character captions in one
#: row group fit; --max-parquet-chunk-mb changes it
MAX_PARQUET_CHUNK_BYTES = 256 << 20

# A converter yields (origin, raw_prompt): origin is "file:row" / "file:line" for messages,
# raw_prompt is the text or None when the source row has no prompt (counted as empty).
RawPrompts = Iterator[tuple[str, "str | None"]]


def _column_leaves(pf, column: str) -> list[int]:
    """Indices of the parquet leaf columns that hold arrow column `column` (one for a string
    column, several for a nested one)."""
    schema = pf.metadata.schema
    return [k for k in range(len(schema)) if schema.column(k).path == column
            or schema.column(k).path.startswith(column + ".")]


def check_row_group(pf, path: str, group: int, first_row: int, column: str, max_chunk_bytes: int | None,
                    max_row_bytes: int = MAX_LINE_BYTES) -> None:
    """DataError naming the file and rows when `column` holds, in row group `group` (whose first
    row is `first_row`), more than `max_chunk_bytes` uncompressed (None: no total bound) or more
    than `max_row_bytes` a row on average (so at least one cell over it): from the file's metadata,
    before the row group is decoded. A page holds whole values, so decoding one huge cell holds it
    at once, several times over."""
    meta = pf.metadata.row_group(group)
    size, n = sum(meta.column(k).total_uncompressed_size for k in _column_leaves(pf, column)), meta.num_rows
    rows = f"row {first_row}" if n == 1 else f"rows {first_row}-{first_row + n - 1}"
    if max_chunk_bytes is not None and size > max_chunk_bytes:
        limit = f"more than the {max_chunk_bytes} bytes one row group of it may hold (--max-parquet-chunk-mb)"
    elif n and size > n * max_row_bytes:
        limit = f"more than {max_row_bytes} bytes a row"
    else:
        return
    what = (f"a prompt has at most {MAX_PROMPT_CHARS} characters" if max_row_bytes == MAX_LINE_BYTES
            else f"a source image has at most {MAX_IMAGE_BYTES} bytes")
    raise DataError(f"{where(path)}:{rows}: column {column!r} holds {size} bytes uncompressed there, {limit}; {what}: "
                    "drop the oversized rows, or choose the right column with --column / --image-column")


def iter_parquet_column(path: str, column: str, max_chunk_bytes: int = MAX_PARQUET_CHUNK_BYTES) -> RawPrompts:
    """Stream one string column of a parquet file, row group by row group and batch by batch
    (0-based row numbers). Before a row group is read, its size in the metadata is checked: more
    than `max_chunk_bytes` uncompressed, or more than MAX_LINE_BYTES a row on average (at least
    one cell over the limit a prompt line has), is a DataError naming the file and rows; a value
    longer than MAX_PROMPT_CHARS is one naming its row (bounded: its row group passed the check)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{where(path)}: no column {column!r}; columns are {names}; choose one with --column")
    row = 0
    for group in range(pf.metadata.num_row_groups):
        check_row_group(pf, path, group, row, column, max_chunk_bytes)
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[column]):
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
    odd = [f for f in files if not os.path.isfile(f)]
    if odd:  # a FIFO would block the reader, a dangling link fail it midway
        raise DataError(f"--input {input_path}: {odd[0]} is not a regular file; remove it or name the files' directory")
    if not files:
        raise DataError(f"--input {input_path}: no *.parquet files under this directory")
    return files


def convert_pickapic(input_path: str, column: str | None,
                     max_chunk_bytes: int = MAX_PARQUET_CHUNK_BYTES) -> RawPrompts:
    """Pick-a-Pic: the ``caption`` column (or ``--column``) of every parquet file under the input."""
    for path in parquet_files(input_path):
        yield from iter_parquet_column(path, column or "caption", max_chunk_bytes)


def convert_prompts(input_path: str, column: str | None, max_chunk_bytes: int = MAX_PARQUET_CHUNK_BYTES) -> RawPrompts:
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
        yield from iter_parquet_column(input_path, column, max_chunk_bytes)
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


CONVERTERS: dict[str, Callable[..., RawPrompts]] = {
    "pickapic": convert_pickapic,
    "prompts": convert_prompts,
}

# ------------------------------------------------------------------------------------- edit pairs

#: rows per parquet batch of an edit file: its rows hold image bytes (a few MB each), so the
#: batch is small to keep host memory bounded
PARQUET_EDIT_BATCH_ROWS = 64
#: defaults of --image-column / --column for the edit source, first present wins (the layouts of
#: InstructPix2Pix / MagicBrush / UltraEdit / OmniEdit-style dumps and plain {image, prompt} files)
EDIT_IMAGE_COLUMNS = ("source_image", "input_image", "source_img", "src_img", "image", "images")
EDIT_INSTRUCTION_COLUMNS = ("instruction", "edit_instruction", "edit_prompt", "prompt", "text", "caption")
#: largest source image accepted, bytes or file: beyond any real photo, far below host memory
MAX_IMAGE_BYTES = 64 << 20
#: leading bytes -> extension of the image formats a source image may have; anything else is
#: refused by its bytes (not decoded: inspect_data --decode-media does that, in one place)
IMAGE_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", ".png"), (b"\xff\xd8\xff", ".jpg"))

#: a source image as read: ("path", the path as written) or ("bytes", the encoded image)
SourceImage = tuple[str, "str | bytes"]
RawEdits = Iterator[tuple[str, "str | None", "list[SourceImage] | None"]]


def image_extension(data: bytes) -> str | None:
    """The file extension of encoded image bytes by their signature (WebP: RIFF....WEBP); None
    when the bytes are no known image format."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    return next((ext for magic, ext in IMAGE_SIGNATURES if data.startswith(magic)), None)


def source_images(value, origin: str, column: str) -> "list[SourceImage] | None":
    """The source image(s) of one cell: a path, bytes, a {"bytes", "path"} struct or a list of
    those; None for a missing value. DataError (naming the row) for anything else."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    out: list[SourceImage] = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("bytes") if item.get("bytes") is not None else item.get("path")
        if isinstance(item, (bytes, bytearray)) and item:
            out.append(("bytes", bytes(item)))
        elif isinstance(item, str) and item.strip():
            out.append(("path", item.strip()))
        else:
            raise DataError(f"{origin}: column {column!r} holds {type(item).__name__} {str(item)[:40]!r}, not an "
                            "image path, image bytes or a {'bytes', 'path'} struct; choose the source-image "
                            "column with --image-column")
    return out or None


def _first_present(names, candidates, flag: str, origin: str) -> str:
    found = next((c for c in candidates if c in names), None)
    if found is None:
        raise DataError(f"{origin}: none of the columns {list(candidates)} exists (columns: {sorted(names)}); "
                        f"choose one with {flag}")
    return found


def convert_edit(input_path: str, column: str | None, image_column: str | None) -> RawEdits:
    """Edit pairs from one .jsonl / .parquet file: yields (origin, instruction, source images)."""
    if not os.path.isfile(input_path):
        raise DataError(f"--input {input_path}: no such file (the edit source takes one .jsonl or .parquet file)")
    lower = input_path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(input_path)
        names = pf.schema_arrow.names
        text_col = column or _first_present(names, EDIT_INSTRUCTION_COLUMNS, "--column", where(input_path))
        img_col = image_column or _first_present(names, EDIT_IMAGE_COLUMNS, "--image-column", where(input_path))
        for flag, col in (("--column", text_col), ("--image-column", img_col)):
            if col not in names:
                raise DataError(f"{where(input_path)}: no column {col!r}; columns are {names}; choose one with {flag}")
        row = 0
        for group in range(pf.metadata.num_row_groups):
            # a huge cell is refused before it is decoded: the instruction column as the prompts',
            # the image column at MAX_IMAGE_BYTES a row (its row groups are large by nature)
            check_row_group(pf, input_path, group, row, text_col, MAX_PARQUET_CHUNK_BYTES)
            check_row_group(pf, input_path, group, row, img_col, None, MAX_IMAGE_BYTES)
            for batch in pf.iter_batches(batch_size=PARQUET_EDIT_BATCH_ROWS, row_groups=[group],
                                         columns=[text_col, img_col]):
                texts, images = batch.column(0).to_pylist(), batch.column(1).to_pylist()
                for text, image in zip(texts, images):
                    origin = f"{input_path}:row {row}"
                    if text is not None and not isinstance(text, str):
                        raise DataError(f"{origin}: column {text_col!r} is {type(text).__name__}, not text; "
                                        "choose the instruction column with --column")
                    yield origin, text, source_images(image, origin, img_col)
                    row += 1
    elif lower.endswith((".jsonl", ".ndjson")):
        for lineno, obj in read_jsonl(input_path):
            origin = where(input_path, lineno)
            if not isinstance(obj, dict):
                raise DataError(f"{origin}: expected a JSON object, got {type(obj).__name__}")
            text_col = column or _first_present(obj, EDIT_INSTRUCTION_COLUMNS, "--column", origin)
            img_col = image_column or _first_present(obj, EDIT_IMAGE_COLUMNS, "--image-column", origin)
            for flag, col in (("--column", text_col), ("--image-column", img_col)):
                if col not in obj:
                    raise DataError(f"{origin}: no field {col!r}; fix the line or choose the field with {flag}")
            text = obj[text_col]
            if text is not None and not isinstance(text, str):
                raise DataError(f"{origin}: {text_col!r} is {type(text).__name__}, not text")
            yield origin, text, source_images(obj[img_col], origin, img_col)
    else:
        raise DataError(f"--input {input_path}: the edit source reads .jsonl / .ndjson or .parquet files")


class MediaWriter:
    """Source images of an edit set: bytes written once as ``<media_dir>/<sha256>.<ext>``, paths
    resolved under ``media_root``; every image becomes (path relative to the output's directory,
    its "sha256:<hex>" key, the same key trainer.data.MediaDigests gives the file)."""

    def __init__(self, media_dir: str, media_root: str, out_dir: str, allow_outside: bool = False):
        self.media_dir, self.media_root, self.out_dir = media_dir, media_root, out_dir
        #: whether a source path may lie outside media_root (--allow-media-outside-root)
        self.allow_outside = allow_outside
        self.written = 0

    def place(self, image: SourceImage, origin: str) -> tuple[str, str]:
        kind, value = image
        if kind == "bytes":
            data = value
            if len(data) > MAX_IMAGE_BYTES:
                raise DataError(f"{origin}: a source image of {len(data)} bytes is over the {MAX_IMAGE_BYTES} "
                                "accepted; drop or downscale that row")
            ext = image_extension(data)
            if ext is None:
                raise DataError(f"{origin}: the source-image bytes are no PNG / JPEG / WebP image "
                                f"(they start {data[:8]!r}); check --image-column")
            problem = header_problem(data)
            if problem:
                raise DataError(f"{origin}: the source image {problem}; drop or fix that row")
            digest = hashlib.sha256(data).hexdigest()
            path = os.path.join(self.media_dir, digest + ext)
            # a regular file of these bytes is kept; anything else there (a planted symlink, a
            # partial file) is replaced by a rename, never written through
            if not (os.path.isfile(path) and not os.path.islink(path) and file_sha256(path) == digest):
                os.makedirs(self.media_dir, exist_ok=True)
                with atomic_writer(path) as f:
                    f.write(data)
                self.written += 1
        else:
            path, allowed = confined_media_path(value, self.media_root)
            if not (allowed or self.allow_outside):
                raise DataError(f"{origin}: source image {value!r} ({path}) lies outside --media-root "
                                f"{self.media_root} (symlinks followed); move it there, point --media-root at the "
                                "directory that holds it, or pass --allow-media-outside-root")
            if not os.path.exists(path):
                raise DataError(f"{origin}: source image {value!r} is not a file ({path}); relative paths are "
                                "under --media-root (default: the input file's directory)")
            problem = media_file_problem(path, MAX_IMAGE_BYTES)  # a FIFO or /proc file is never opened
            if problem:
                raise DataError(f"{origin}: source image {value!r}: {problem}; drop that row")
            try:
                digest = file_sha256(path, MAX_IMAGE_BYTES)
            except MediaFileError as e:  # changed since the check
                raise DataError(f"{origin}: source image {value!r}: {e}") from None
            problem = header_problem(path)
            if problem:
                raise DataError(f"{origin}: source image {value!r} {problem}; drop or fix that row")
        rel = os.path.relpath(os.path.abspath(path), self.out_dir).replace(os.sep, "/")
        return rel, "sha256:" + digest


def bounded_prompt(prompt: str, origin: str) -> str:
    """`prompt` when it holds at most MAX_PROMPT_CHARS characters (the trainer's limit: a longer
    one is refused there), else DataError naming its row: never written, never cut short."""
    if len(prompt) > MAX_PROMPT_CHARS:
        raise DataError(f"{origin}: the prompt has {len(prompt)} characters, more than the {MAX_PROMPT_CHARS} a prompt "
                        "may hold; shorten or drop that row")
    return prompt


def bounded_record(record: dict, origin: str) -> dict:
    """`record` when its JSONL line fits MAX_LINE_BYTES (the readers refuse a longer line), else
    DataError naming its row."""
    size = len(canonical_json(record).encode("utf-8"))
    if size > MAX_LINE_BYTES:
        raise DataError(f"{origin}: its record would be a line of {size} bytes, more than the {MAX_LINE_BYTES} a "
                        "prompt file's line may have; drop that row (or shorten its paths / --id-prefix)")
    return record


def edit_prompt(instruction: str, n_images: int) -> str:
    """The record prompt of an edit: one <image> placeholder per source image, then the
    instruction (the family adapter takes the images from the record's list, in order)."""
    return " ".join(["<image>"] * n_images + [instruction])


def first_seen(seen: dict[str, str], sid: str, full: str, counts: Counter, collision: str) -> bool:
    """Record sample id `sid` with its full content hash in `seen`; False (counting a
    ``duplicate``) when the same content came before. A different content under the same 64-bit
    id is a hash collision: DataError starting with `collision`, never a silent merge."""
    if sid in seen:
        if seen[sid] != full:
            raise DataError(f"{collision} (64-bit hash collision); use another --id-prefix for one of the sources")
        counts["duplicate"] += 1
        return False
    seen[sid] = full
    return True


def prepare_edit(input_path: str, task: str, output: str, column: str | None = None, image_column: str | None = None,
                 id_prefix: str | None = None, media_dir: str | None = None,
                 media_root: str | None = None, allow_media_outside_root: bool = False) -> Counter:
    """Convert an edit-pair file and write ``output``; returns the counts (``read``, ``written``,
    ``empty``, ``no_image``, ``duplicate``, ``images_written``)."""
    prefix = id_prefix or "edit"
    if not prefix or any(c.isspace() for c in prefix):
        raise DataError(f"--id-prefix {prefix!r}: must be non-empty without whitespace")
    out_dir = os.path.dirname(os.path.abspath(output))
    writer = MediaWriter(os.path.abspath(media_dir or os.path.join(out_dir, "media")),
                         os.path.abspath(media_root or os.path.dirname(os.path.abspath(input_path))), out_dir,
                         allow_outside=allow_media_outside_root)
    counts: Counter = Counter()
    seen: dict[str, str] = {}

    def rows() -> Iterator[dict]:
        for origin, raw, images in convert_edit(input_path, column, image_column):
            counts["read"] += 1
            instruction = normalize_prompt(raw) if raw is not None else ""
            if not instruction:
                counts["empty"] += 1
                continue
            if not images:
                counts["no_image"] += 1
                continue
            bounded_prompt(edit_prompt(instruction, len(images)), origin)  # before any image is written
            placed = [writer.place(image, origin) for image in images]
            prompt = edit_prompt(instruction, len(placed))
            keys = [key for _, key in placed]
            full = media_content_hash(prompt, keys)
            sid = stable_media_sample_id(prefix, prompt, keys)
            if not first_seen(seen, sid, full, counts, f"{origin}: sample id {sid} collides with a different record"):
                continue
            yield bounded_record({"prompt": prompt, "images": [rel for rel, _ in placed],
                                  "metadata": {"sample_id": sid, "source": "edit", "task": task}}, origin)

    counts["written"] = write_jsonl(output, rows())
    counts["images_written"] = writer.written
    return counts


#: every --source: the prompt converters and the edit-pair one
SOURCES = (*CONVERTERS, "edit")


def prepare(source: str, input_path: str, task: str, output: str, column: str | None = None,
            id_prefix: str | None = None, max_parquet_chunk_bytes: int = MAX_PARQUET_CHUNK_BYTES,
            **edit_options) -> Counter:
    """Convert ``input_path`` with CONVERTERS[source] (or prepare_edit for ``edit``, which takes
    ``edit_options``) and write ``output``; returns the counts (``read``, ``written``, ``empty``,
    ``duplicate``, and for edit ``no_image`` and ``images_written``). A prompt over
    MAX_PROMPT_CHARS or a record over MAX_LINE_BYTES is a DataError naming its row, in every
    route (bounded_prompt, bounded_record)."""
    if source not in SOURCES:
        raise DataError(f"--source {source!r}: unknown; choose one of {sorted(SOURCES)}")
    if task not in GENERATION_TASKS:
        raise DataError(f"--task {task!r}: not a generation task; choose one of {list(GENERATION_TASKS)}")
    if source == "edit":
        return prepare_edit(input_path, task, output, column, id_prefix=id_prefix, **edit_options)
    prefix = id_prefix or source
    if not prefix or any(c.isspace() for c in prefix):
        raise DataError(f"--id-prefix {prefix!r}: must be non-empty without whitespace")
    counts: Counter = Counter()
    # id -> full content hash: a 64-bit id collision between two different prompts is reported,
    # not merged. ~100 bytes per distinct prompt.
    seen: dict[str, str] = {}

    def rows() -> Iterator[dict]:
        for origin, raw in CONVERTERS[source](input_path, column, max_parquet_chunk_bytes):
            counts["read"] += 1
            prompt = normalize_prompt(raw) if raw is not None else ""
            if not prompt:
                counts["empty"] += 1
                continue
            bounded_prompt(prompt, origin)
            full = content_hash(prompt)
            sid = stable_sample_id(prefix, prompt)
            if not first_seen(seen, sid, full, counts, f"{origin}: sample id {sid} collides with a different prompt"):
                continue
            yield bounded_record({"prompt": prompt, "metadata": {"sample_id": sid, "source": source, "task": task}},
                                 origin)

    counts["written"] = write_jsonl(output, rows())
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser("prepare_data", __doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, choices=sorted(SOURCES),
                   help="converter: pickapic (parquet caption column), prompts (parquet / JSONL / text) or "
                        "edit (source image + instruction pairs, JSONL / parquet)")
    p.add_argument("--input", required=True, type=existing_path,
                   help="pickapic: a parquet file or a directory of them; prompts: one file "
                        "(.parquet, .jsonl, or text with one prompt per line); edit: one .jsonl or .parquet")
    p.add_argument("--task", "--generation-task", dest="task", default="t2i",
                   help=f"metadata.task of every record; one of {list(GENERATION_TASKS)}")
    p.add_argument("--output", required=True, help="the JSONL file to write (replaced atomically)")
    p.add_argument("--column", default=None,
                   help="parquet column / JSONL field holding the prompt (unset: pickapic 'caption'; "
                        "prompts parquet the first of prompt/caption/text, prompts JSONL 'prompt'; edit the "
                        f"first of {'/'.join(EDIT_INSTRUCTION_COLUMNS)})")
    p.add_argument("--image-column", default=None,
                   help="edit only: column / field with the source image(s): a path, image bytes, a "
                        "{bytes, path} struct or a list of them (unset: the first of "
                        f"{'/'.join(EDIT_IMAGE_COLUMNS)})")
    p.add_argument("--media-dir", default=None,
                   help="edit only: where source-image bytes are written as <sha256>.<ext> (unset: media/ "
                        "beside --output); records point at them by paths relative to --output's directory")
    p.add_argument("--media-root", default=None,
                   help="edit only: directory that source-image paths are under, relative ones resolved "
                        "against it; a path outside it, symlinks followed, is refused (unset: the --input file's "
                        "directory)")
    p.add_argument("--allow-media-outside-root", action="store_true",
                   help="edit only: accept source-image paths outside --media-root (any file this user can read)")
    p.add_argument("--id-prefix", default=None,
                   help="sample ids are '<id-prefix>_<content hash>' (unset: the --source name); an edit "
                        "record's hash covers the instruction and the source images' bytes")
    p.add_argument("--max-parquet-chunk-mb", type=int, default=MAX_PARQUET_CHUNK_BYTES >> 20,
                   help="pickapic / prompts parquet: the most MiB (uncompressed, per the file's metadata) the prompt "
                        "column may hold in one row group, checked before it is read; must be > 0 (it bounds the "
                        "memory one oversized cell can take)")
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
    stale = os.path.lexists(tmp)
    if stale:
        # only this tool wrote <output>.tmp (earlier versions), and only until the rename: it is a
        # killed run's. The writer now uses a fresh random name, so the leftover is removed below
        print(f"prepare_data: note: {tmp} is left from an interrupted run; it is replaced")
    edit_flags = {"--image-column": args.image_column, "--media-dir": args.media_dir, "--media-root": args.media_root,
                  "--allow-media-outside-root": args.allow_media_outside_root or None}
    if args.source != "edit":
        given = [flag for flag, value in edit_flags.items() if value is not None]
        if given:
            raise ToolError(f"{', '.join(given)} only apply to --source edit")
        if args.max_parquet_chunk_mb <= 0:
            raise ToolError(f"--max-parquet-chunk-mb must be > 0, got {args.max_parquet_chunk_mb}")
        counts = prepare(args.source, args.input, args.task, args.output, args.column, args.id_prefix,
                         max_parquet_chunk_bytes=args.max_parquet_chunk_mb << 20)
    else:
        counts = prepare(args.source, args.input, args.task, args.output, args.column, args.id_prefix,
                         image_column=args.image_column, media_dir=args.media_dir, media_root=args.media_root,
                         allow_media_outside_root=args.allow_media_outside_root)
    if stale and not os.path.isdir(tmp):
        os.unlink(tmp)  # a link is removed itself, never followed
    print(f"prepare_data: read {counts['read']} prompt(s) from {args.input}; wrote {counts['written']} "
          f"record(s) to {args.output}")
    if args.source == "edit":
        print(f"prepare_data: skipped {counts['empty']} empty instruction(s), {counts['no_image']} row(s) without a "
              f"source image, {counts['duplicate']} duplicate(s) (same instruction and image bytes); wrote "
              f"{counts['images_written']} image file(s)")
    else:
        print(f"prepare_data: skipped {counts['empty']} empty prompt(s), {counts['duplicate']} duplicate(s) "
              "(same prompt after whitespace normalisation, hence the same sample id)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
