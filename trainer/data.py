"""Prompt sets: the JSONL schema, its validation and hashes, and the training-side reader.

One JSON object per line::

    {"prompt": "a red panda in a teacup", "metadata": {"task": "t2i", "sample_id": "pickapic_..."}}

optionally with media references ``"images": [path, ...]`` / ``"videos": [path, ...]``; the
prompt must then hold exactly one ``<image>`` / ``<video>`` placeholder per reference. Relative
media paths are relative to the directory of the JSONL file that holds them. ``metadata`` may carry
further keys (e.g. ``source``, ``prompt_id``); they are kept as they are.

The same code serves the data tools (tools/prepare_data.py, curate_data.py, inspect_data.py) and
the trainer, so a file the tools accept is a file the trainer accepts. No torch import here: the
tools run on machines without it.

Determinism (docs/data.md has the full story):

- ``content_hash``: sha256 over the whitespace-normalised prompt and the sorted media paths; the
  key of a record without media, and of the sample-id reuse check.
- ``record_dedup_key``: the dedup and leakage key. Without media it is ``content_hash``; with media
  it covers the prompt and the sha256 of each media file's bytes, in record order, so the same image
  under two names is one record and one name in two directories is two.
- ``split_unit``: a number in [0, 1) from sha256 of the sample id; the train/eval split
  thresholds or ranks it, so a record's side never depends on input order or RNG.
- ``PromptOrder``: which prompts rollout k uses, a pure function of (seed, k).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainer.core.media_key import MediaFileError, file_sha256, media_file_problem
from trainer.config import GENERATION_TASKS

#: media reference key -> the placeholder the prompt must hold once per reference
MEDIA_PLACEHOLDERS = {"images": "<image>", "videos": "<video>"}
TOP_LEVEL_KEYS = ("prompt", "metadata", *MEDIA_PLACEHOLDERS)
REQUIRED_METADATA_KEYS = ("task", "sample_id")

#: longest prompt accepted, in characters. The text encoder keeps 512 tokens (a few thousand
#: characters): anything far beyond is a broken line (a pasted document, a binary blob), and
#: would otherwise cost host memory and tokenizer time on every rollout, then be cut off silently.
MAX_PROMPT_CHARS = 10_000

#: longest line read from a prompt file, in bytes: a valid line holds at most MAX_PROMPT_CHARS of
#: prompt (up to 6 bytes each when JSON-escaped) plus metadata, far below this. A longer line is
#: reported without ever being held in memory whole (a multi-GB line must not be read to find out).
MAX_LINE_BYTES = 1 << 20

#: the command that turns a plain-text prompt list (one prompt per line) into a prompt file
PLAIN_TEXT_FIX = "flowgrpo-prepare-data --source prompts --input {path} --output PROMPTS.jsonl"

# A sample id names a record in logs, artifact metadata and the split hash: one token, no spaces.
_SAMPLE_ID_RE = re.compile(r"^[^\s]+$")


class DataError(ValueError):
    """A prompt file is unusable. The message names the file (and line) and what to do."""


def where(path: str | os.PathLike, line: int | None = None) -> str:
    """``path:line`` (or ``path``) for error messages."""
    return f"{os.fspath(path)}:{line}" if line is not None else os.fspath(path)


# ----------------------------------------------------------------------------- serialisation


def canonical_json(obj: Any) -> str:
    """One JSON line, byte-for-byte reproducible: sorted keys, no spaces, UTF-8 text kept as is."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write ``rows`` as canonical JSON lines ending in "\\n"; returns the row count.

    Written to an exclusively created temporary beside ``path`` (never a link planted there)
    and renamed over ``path`` only when complete and fsynced, so a crash never leaves a
    half-written prompt file under the real name; if ``rows`` (or the write) raises, the
    temporary is removed and the error propagates.
    """
    import io

    from trainer.core.files import atomic_writer

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    with atomic_writer(path) as raw:
        f = io.TextIOWrapper(raw, encoding="utf-8", newline="\n", write_through=True)
        try:
            for row in rows:
                f.write(canonical_json(row))
                f.write("\n")
                n += 1
        finally:
            f.detach()  # the writer flushes, fsyncs and closes the file itself
    return n


def iter_lines_bounded(f: Any, max_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | None]]:
    """Yield ``(line_number, raw_line)`` from a binary file, 1-based; ``raw_line`` is None for a
    line longer than ``max_bytes``, whose rest is skipped in bounded chunks, never held whole."""
    lineno = 0
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > max_bytes and not (len(raw) == max_bytes + 1 and raw.endswith(b"\n")):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(1 << 16)
            yield lineno, None
            continue
        yield lineno, raw


def parse_json_line(text: str, path: str | os.PathLike = "FILE") -> tuple[Any, str | None]:
    """``(object, None)`` for one JSON line, or ``(None, what is wrong)`` with a 1-based column;
    a line that does not start like a JSON value is reported as plain text with the command that
    converts such a file (PLAIN_TEXT_FIX). Nesting too deep and integers over Python's digit limit
    are reported too, not raised."""
    if text.startswith("\ufeff"):
        return None, "starts with a UTF-8 byte-order mark; save the file as UTF-8 without one"
    start = len(text) - len(text.lstrip())
    first = text[start:start + 1]
    if first not in ("{", "["):
        try:  # a bare string / number / literal parses but is not a record; anything else is text
            return json.loads(text), None
        except (ValueError, RecursionError):
            pass
        return None, (f"not JSON: the line starts with {text.strip()[:40]!r} at column {start + 1}, so the file "
                      "looks like plain text (one JSON object per line is expected). Convert a plain-text prompt "
                      f"list with: {PLAIN_TEXT_FIX.format(path=os.fspath(path))}")
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno}); fix or delete the line"
    except RecursionError:
        return None, "not a usable JSON object: it nests too deeply to parse; fix or delete the line"
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return None, f"not a usable JSON object ({str(e)[:120]}); fix or delete the line"


def iter_jsonl_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any, str | None]]:
    """Yield ``(line_number, object, error)`` for every line of a JSONL file (1-based lines).

    ``error`` is None for a parsed line; otherwise ``object`` is None and ``error`` says what is
    wrong (bad JSON, plain text, a line over MAX_LINE_BYTES, blank line, bad UTF-8). Nothing is
    skipped: every line is accounted for, and memory stays bounded whatever the file holds.
    """
    with open(path, "rb") as f:
        for lineno, raw in iter_lines_bounded(f):
            if raw is None:
                yield lineno, None, (f"line longer than {MAX_LINE_BYTES} bytes (a prompt may hold at most "
                                     f"{MAX_PROMPT_CHARS} characters); shorten or delete it")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"not valid UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
                continue
            if not text.strip():
                yield lineno, None, "blank line; delete it (one JSON object per line)"
                continue
            obj, error = parse_json_line(text, path)
            yield lineno, obj, error


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)`` per line; the first malformed line raises DataError
    naming ``file:line``. Malformed lines are never dropped silently."""
    if not os.path.isfile(path):
        raise DataError(f"{where(path)}: no such file; check the path")
    for lineno, obj, error in iter_jsonl_lines(path):
        if error is not None:
            raise DataError(f"{where(path, lineno)}: {error}")
        yield lineno, obj


# ----------------------------------------------------------------------------- records


def normalize_prompt(text: str) -> str:
    """Collapse every whitespace run (spaces, tabs, newlines) to one space and strip the ends."""
    return " ".join(text.split())


def count_words(prompt: str) -> int:
    """Whitespace-separated words of ``prompt``, media placeholders not counted."""
    for placeholder in MEDIA_PLACEHOLDERS.values():
        prompt = prompt.replace(placeholder, " ")
    return len(prompt.split())


@dataclass(frozen=True)
class PromptRecord:
    """One validated line of a prompt file."""

    prompt: str
    task: str
    sample_id: str
    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()
    #: metadata keys other than task / sample_id, kept verbatim
    extra: dict = field(default_factory=dict, compare=True, hash=False)
    #: real path of the directory the media references were resolved under (the prompt file's),
    #: "" when they were not resolved: what a sidecar records them relative to
    media_dir: str = field(default="", compare=False)

    def media(self) -> tuple[str, ...]:
        """All media references, images first, in record order."""
        return self.images + self.videos

    def to_dict(self) -> dict:
        """The schema object; media keys only when non-empty (so t2i lines stay minimal)."""
        out: dict[str, Any] = {
            "prompt": self.prompt,
            "metadata": {**self.extra, "task": self.task, "sample_id": self.sample_id},
        }
        if self.images:
            out["images"] = list(self.images)
        if self.videos:
            out["videos"] = list(self.videos)
        return out


def record_problems(obj: Any, tasks: Iterable[str] = GENERATION_TASKS) -> list[str]:
    """Every schema violation of one parsed line (empty list: valid).

    Checks: a JSON object with only known top-level keys; ``prompt`` a non-empty string of at
    most MAX_PROMPT_CHARS; ``metadata`` an object with ``task`` in ``tasks`` and a one-token
    string ``sample_id``;
    ``images`` / ``videos`` lists of non-empty strings whose lengths equal the prompt's
    ``<image>`` / ``<video>`` placeholder counts.
    """
    tasks = tuple(tasks)
    if isinstance(obj, str):
        return ["expected a JSON object, got a string: a plain-text prompt list is converted with "
                + PLAIN_TEXT_FIX.format(path="FILE")]
    if not isinstance(obj, dict):
        return [f"expected a JSON object, got {type(obj).__name__}"]
    problems = []
    unknown = sorted(set(obj) - set(TOP_LEVEL_KEYS))
    if unknown:
        problems.append(f"unknown top-level key(s) {unknown}; allowed: {list(TOP_LEVEL_KEYS)} "
                        "(extra fields belong in metadata)")
    prompt = obj.get("prompt")
    if "prompt" not in obj:
        problems.append("missing required key 'prompt'")
    elif not isinstance(prompt, str) or not prompt.strip():
        problems.append(f"'prompt' must be a non-empty string, got {prompt!r}")
        prompt = None
    elif len(prompt) > MAX_PROMPT_CHARS:
        problems.append(f"'prompt' is {len(prompt)} characters, more than the {MAX_PROMPT_CHARS} accepted (the text "
                        "encoder reads 512 tokens); shorten it or drop the line")
    meta = obj.get("metadata")
    if "metadata" not in obj:
        problems.append("missing required key 'metadata' (an object with 'task' and 'sample_id')")
    elif not isinstance(meta, dict):
        problems.append(f"'metadata' must be an object, got {type(meta).__name__}")
    else:
        for key in REQUIRED_METADATA_KEYS:
            if key not in meta:
                problems.append(f"missing required key 'metadata.{key}'")
        task = meta.get("task")
        if "task" in meta and task not in tasks:
            problems.append(f"metadata.task {task!r} is not a generation task; valid: {list(tasks)}")
        sid = meta.get("sample_id")
        if "sample_id" in meta and not (isinstance(sid, str) and _SAMPLE_ID_RE.match(sid)):
            problems.append(f"metadata.sample_id must be a non-empty string without whitespace, got {sid!r}")
    for key, placeholder in MEDIA_PLACEHOLDERS.items():
        refs = obj.get(key, [])
        if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
            problems.append(f"'{key}' must be a list of non-empty path strings, got {refs!r}")
            continue
        if isinstance(prompt, str) and prompt.count(placeholder) != len(refs):
            problems.append(f"prompt has {prompt.count(placeholder)} {placeholder} placeholder(s) but "
                            f"'{key}' lists {len(refs)} file(s); they must match one to one")
    return problems


def parse_record(obj: Any, tasks: Iterable[str] = GENERATION_TASKS) -> PromptRecord:
    """A PromptRecord from one parsed line; ValueError listing every problem if invalid."""
    problems = record_problems(obj, tasks)
    if problems:
        raise ValueError("; ".join(problems))
    meta = obj["metadata"]
    return PromptRecord(
        prompt=obj["prompt"],
        task=meta["task"],
        sample_id=meta["sample_id"],
        images=tuple(obj.get("images", ())),
        videos=tuple(obj.get("videos", ())),
        extra={k: v for k, v in meta.items() if k not in REQUIRED_METADATA_KEYS},
    )


#: the prompt-metadata key under which an editing candidate carries its source files (record
#: order): in memory their real paths, where the loop reads the pixels the scorers get under
#: SOURCE_IMAGES_KEY; in a sidecar the paths relative to the prompt file's directory
#: (SOURCE_REFS_KEY's), so an artifact names no directory of the host that wrote it (a sidecar
#: written before holds absolute paths, read as such)
SOURCE_PATHS_KEY = "source_paths"
#: the in-memory key of the same sources relative to the prompt file's directory: what the sidecar
#: records under SOURCE_PATHS_KEY (recorded_metadata); never sent to a scorer
SOURCE_REFS_KEY = "source_refs"


def recorded_metadata(metadata: dict) -> dict:
    """A candidate's metadata as its sidecar records it: SOURCE_PATHS_KEY holds the
    SOURCE_REFS_KEY paths (relative to the prompt file's directory) where the candidate has them,
    and SOURCE_REFS_KEY is dropped."""
    if SOURCE_REFS_KEY not in metadata:
        return metadata
    out = {k: v for k, v in metadata.items() if k != SOURCE_REFS_KEY}
    out[SOURCE_PATHS_KEY] = list(metadata[SOURCE_REFS_KEY])
    return out


def resolve_media_path(ref: str, base_dir: str | os.PathLike) -> str:
    """An absolute media path: absolute refs as is, relative ones under the JSONL's directory."""
    return os.path.normpath(ref if os.path.isabs(ref) else os.path.join(os.fspath(base_dir), ref))


#: how a media file outside its allowed roots is fixed, for the commands with --media-root
MEDIA_ROOT_FIX = ("move it under the prompt file's directory, or name the directory that holds it with "
                  "--media-root DIR (--media-root / allows any file)")


def within(path: str, root: str) -> bool:
    """Whether real path `path` is `root` (a real path) or under it."""
    return os.path.commonpath([path, root]) == root


def confined_media_path(ref: str, base_dir: str | os.PathLike, media_root: str | os.PathLike | None = None,
                        ) -> tuple[str, bool]:
    """(real path, allowed) of media `ref` named by a prompt file in `base_dir`: the path with every
    symlink followed, and whether it lies inside base_dir's real path or media_root's (a prompt
    file may name only its own data, so a shared prompt file cannot send another file of this host
    to a model or a remote scorer; media_root "/" allows any file)."""
    real = os.path.realpath(resolve_media_path(ref, base_dir))
    roots = [os.path.realpath(base_dir)] + ([os.path.realpath(media_root)] if media_root else [])
    return real, any(within(real, r) for r in roots)


# ----------------------------------------------------------------------------- hashes


def content_hash(prompt: str, media: Iterable[str] = ()) -> str:
    """sha256 hex of the whitespace-normalised prompt and the sorted media paths.

    Case is kept (it can matter for text rendering prompts); whitespace is not (it never matters
    to the text encoder's meaning, and Pick-a-Pic captions differ in it a lot).
    """
    payload = canonical_json({"media": sorted(media), "prompt": normalize_prompt(prompt)})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def record_content_hash(record: PromptRecord) -> str:
    """content_hash of a record's prompt and media references (as written in the file)."""
    return content_hash(record.prompt, record.media())


def split_unit(sample_id: str) -> float:
    """A uniform number in [0, 1) from the sample id: first 8 bytes of sha256("split:" + id) / 2**64.

    Fixed by the id alone, so the train/eval side of a record survives reordering and additions.
    """
    digest = hashlib.sha256(("split:" + sample_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def stable_sample_id(prefix: str, prompt: str) -> str:
    """``<prefix>_<16 hex>``: a content-derived id, the first 64 bits of content_hash(prompt).

    The same prompt gets the same id from any file, shard or download order, so a prompt's
    train/eval side is a function of its text: one prompt cannot land on both sides.
    """
    return f"{prefix}_{content_hash(prompt)[:16]}"


def stable_media_sample_id(prefix: str, prompt: str, media_keys: Iterable[str]) -> str:
    """``<prefix>_<16 hex>`` of media_content_hash: an edit record's id is a function of its
    instruction and the bytes of its source image(s), whatever their file names or row order."""
    return f"{prefix}_{media_content_hash(prompt, media_keys)[:16]}"


class MediaDigests:
    """Content keys of media files, each file read once: an edit set shows one source image to
    many instructions, so the same file is asked for again and again. The key of a readable file
    is the one the engine's condition cache uses (trainer.core.media_key)."""

    def __init__(self) -> None:
        self._keys: dict[str, str] = {}

    def key(self, full_path: str) -> str:
        """``sha256:<hex>`` of a readable regular file; ``path:<full_path>`` otherwise (a record
        kept by --no-check-media still gets a key, equal only for the same missing path). A file
        media_file_problem refuses (a FIFO, a device, a /proc file, one over MAX_MEDIA_BYTES) is
        never read: the tools report it through media_file_problem themselves."""
        if full_path not in self._keys:
            try:
                self._keys[full_path] = "path:" + full_path if media_file_problem(full_path) \
                    else "sha256:" + file_sha256(full_path)
            except (OSError, MediaFileError):  # gone or changed since the check
                self._keys[full_path] = "path:" + full_path
        return self._keys[full_path]


def media_content_hash(prompt: str, media_keys: Iterable[str], metadata: dict | None = None) -> str:
    """sha256 hex of the whitespace-normalised prompt and the media keys IN ORDER (an edit's
    "Picture 1" and "Picture 2" are not interchangeable, unlike content_hash's sorted paths), and
    `metadata` when it is not empty (without it the hash is the one sample ids are made of)."""
    fields = {"media_keys": list(media_keys), "prompt": normalize_prompt(prompt)}
    if metadata:
        fields["metadata"] = metadata
    payload = canonical_json(fields)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


#: metadata keys that say where a record came from, not what it asks: left out of its dedup key
RECORD_PROVENANCE_KEYS = frozenset({"source"})


def record_dedup_key(record: PromptRecord, base_dir: str | os.PathLike, digests: MediaDigests) -> str:
    """The dedup / leakage key of a record read from a file in ``base_dir``: content_hash when it
    has no media (t2i files keep their keys), else media_content_hash over the bytes of its media
    and its metadata but the provenance (RECORD_PROVENANCE_KEYS): two edits of one source under
    one instruction that ask for different targets (metadata.color "red" and "green") are two
    records, whatever the files are named or the rows ordered."""
    if not record.media():
        return record_content_hash(record)
    defining = {k: v for k, v in record.extra.items() if k not in RECORD_PROVENANCE_KEYS}
    return media_content_hash(record.prompt, (digests.key(resolve_media_path(ref, base_dir))
                                              for ref in record.media()), defining)


def find_leakage(a: Iterable[PromptRecord], b: Iterable[PromptRecord], keys_a: Iterable[str] | None = None,
                 keys_b: Iterable[str] | None = None) -> list[tuple[str, int, int]]:
    """Records of ``b`` that also occur in ``a``, as ``(kind, index_in_a, index_in_b)``.

    kind ``"sample_id"``: the same id; ``"prompt"``: the same content key (``keys_a`` / ``keys_b``,
    parallel to the records, e.g. record_dedup_key computed against each file's directory;
    content_hash when not given; a record matching on both is reported twice). Indices are 0-based
    positions in the iterables.
    """
    a, b = list(a), list(b)
    keys_a = list(keys_a) if keys_a is not None else [record_content_hash(r) for r in a]
    keys_b = list(keys_b) if keys_b is not None else [record_content_hash(r) for r in b]
    if len(keys_a) != len(a) or len(keys_b) != len(b):
        raise ValueError("find_leakage: keys_a / keys_b must hold one key per record")
    by_id: dict[str, int] = {}
    by_hash: dict[str, int] = {}
    for i, r in enumerate(a):
        by_id.setdefault(r.sample_id, i)
        by_hash.setdefault(keys_a[i], i)
    hits = []
    for j, r in enumerate(b):
        if r.sample_id in by_id:
            hits.append(("sample_id", by_id[r.sample_id], j))
        h = keys_b[j]
        if h in by_hash:
            hits.append(("prompt", by_hash[h], j))
    return hits


# ----------------------------------------------------------------------------- training side


@dataclass
class PromptDataset:
    """A validated prompt set held in memory (a million prompts is ~200 MB of Python strings)."""

    path: str
    records: list[PromptRecord]
    #: 1-based source line of records[i], for messages
    lines: list[int]

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, task: str | None = None,
                   media_root: str | os.PathLike | None = None) -> "PromptDataset":
        """Read and validate a prompt file; DataError naming ``file:line`` on the first bad line,
        a duplicate sample id, a record of another task, or an empty file.

        Media references are resolved to real paths (relative to the file's directory, symlinks
        followed); DataError listing every one that lies outside the file's directory and
        `media_root` (confined_media_path).
        """
        path = os.fspath(path)
        base = os.path.dirname(os.path.abspath(path))
        records: list[PromptRecord] = []
        lines: list[int] = []
        seen: dict[str, int] = {}
        outside: list[str] = []
        for lineno, obj in read_jsonl(path):
            try:
                rec = parse_record(obj)
            except ValueError as e:
                raise DataError(f"{where(path, lineno)}: {e}; fix the line or rebuild the file with "
                                "tools/curate_data.py and check it with tools/inspect_data.py") from None
            if task is not None and rec.task != task:
                raise DataError(f"{where(path, lineno)}: metadata.task is {rec.task!r} but the run's "
                                f"--generation-task is {task!r}; use a prompt set made for {task!r}")
            if rec.sample_id in seen:
                raise DataError(f"{where(path, lineno)}: sample_id {rec.sample_id!r} already used at line "
                                f"{seen[rec.sample_id]}; sample ids must be unique (run tools/curate_data.py)")
            seen[rec.sample_id] = lineno
            if rec.media():
                resolved = {}
                for ref in rec.media():
                    resolved[ref], allowed = confined_media_path(ref, base, media_root)
                    if not allowed:
                        outside.append(f"{where(path, lineno)}: {ref!r} ({resolved[ref]})")
                rec = PromptRecord(rec.prompt, rec.task, rec.sample_id, tuple(resolved[p] for p in rec.images),
                                   tuple(resolved[p] for p in rec.videos), rec.extra, os.path.realpath(base))
            records.append(rec)
            lines.append(lineno)
        if outside:
            roots = base + (f" or --media-root {media_root}" if media_root else "")
            raise DataError(f"{len(outside)} media file(s) lie outside {roots}: {'; '.join(outside[:5])}"
                            f"{'; ...' if len(outside) > 5 else ''}; {MEDIA_ROOT_FIX}")
        if not records:
            raise DataError(f"{where(path)}: the prompt file is empty; point the flag at a prepared "
                            "prompt set (tools/prepare_data.py, tools/curate_data.py)")
        return cls(path=path, records=records, lines=lines)

    def __len__(self) -> int:
        return len(self.records)

    def order(self, rollout_batch_size: int, seed: int) -> "PromptOrder":
        """The PromptOrder over this set (its errors name this file)."""
        return PromptOrder(len(self.records), rollout_batch_size, seed, source=self.path)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]


class PromptOrder:
    """Which prompts each rollout uses: a pure function of (seed, rollout id).

    Epoch e is the permutation ``numpy.random.default_rng((seed, e)).permutation(num_prompts)``
    cut into ``num_prompts // rollout_batch_size`` consecutive batches; rollout k is batch
    ``k % batches_per_epoch`` of epoch ``k // batches_per_epoch``. A batch never straddles two
    epochs, so its prompts are distinct. The last ``num_prompts % rollout_batch_size`` indices of
    each epoch's permutation are not used in that epoch; since every epoch has a fresh permutation,
    each prompt is left out with the same probability, not the same prompts every time.

    No state: a resumed run (or any rank) gets the same groups from the rollout id alone.
    """

    def __init__(self, num_prompts: int, rollout_batch_size: int, seed: int, source: str | None = None):
        """``source``: the prompt file, named in errors (PromptDataset.order passes it)."""
        if rollout_batch_size < 1:
            raise ValueError(f"--rollout-batch-size must be >= 1, got {rollout_batch_size}")
        if num_prompts < rollout_batch_size:
            what = f"the prompt set {source}" if source else "the prompt set"
            raise DataError(f"{what} has {num_prompts} prompt(s), fewer than --rollout-batch-size "
                            f"{rollout_batch_size}; use a larger prompt set or a smaller --rollout-batch-size")
        if seed < 0:
            raise ValueError(f"--rollout-seed must be >= 0 (numpy seeds are non-negative), got {seed}")
        self.num_prompts = int(num_prompts)
        self.rollout_batch_size = int(rollout_batch_size)
        self.seed = int(seed)
        self.batches_per_epoch = self.num_prompts // self.rollout_batch_size
        self._cached_epoch: int | None = None
        self._cached_perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s prompt order (int64 [num_prompts]); the last one is cached."""
        if self._cached_epoch != epoch:
            self._cached_perm = np.random.default_rng((self.seed, epoch)).permutation(self.num_prompts)
            self._cached_epoch = epoch
        return self._cached_perm

    def groups_for_rollout(self, rollout_id: int) -> list[int]:
        """Prompt indices (``rollout_batch_size`` distinct ints) for rollout ``rollout_id`` >= 0."""
        if rollout_id < 0:
            raise ValueError(f"rollout id must be >= 0, got {rollout_id}")
        epoch, batch = divmod(int(rollout_id), self.batches_per_epoch)
        start = batch * self.rollout_batch_size
        return [int(i) for i in self.permutation(epoch)[start:start + self.rollout_batch_size]]


def load_eval_sets(pairs: Iterable[tuple[str, str | os.PathLike]], task: str | None = None,
                   media_root: str | os.PathLike | None = None) -> dict[str, PromptDataset]:
    """``--eval-prompt-data NAME PATH [NAME PATH ...]`` -> {name: PromptDataset}, in the given order.

    DataError for a duplicate name, or any error ``PromptDataset.from_jsonl`` raises (which names
    the file and line).
    """
    out: dict[str, PromptDataset] = {}
    for name, path in pairs:
        if not name:
            raise DataError(f"--eval-prompt-data: empty eval set name for {where(path)}; give NAME PATH pairs")
        if name in out:
            raise DataError(f"--eval-prompt-data: eval set name {name!r} given twice "
                            f"({out[name].path} and {where(path)}); names must be unique")
        out[name] = PromptDataset.from_jsonl(path, task=task, media_root=media_root)
    return out
