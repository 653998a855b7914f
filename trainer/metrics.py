"""Metrics: TensorBoard scalars and images, a one-line console summary per rollout.

Every series shares one x-axis, the rollout id. Only rank 0 writes; the other ranks hold a
logger that does nothing, so call sites need no rank checks. The events of a run go to
<tensorboard_dir>/<run name> (the recipe's file name), so `tensorboard --logdir` over several
runs lists each under its recipe, and a resumed run continues its own curves.
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

# What the console line shows, in order, when present (name in the line, series name).
_CONSOLE = (
    ("loss", "train/loss"),
    ("clip", "train/clip_fraction"),
    ("kl", "train/approx_kl"),
    ("gnorm", "train/grad_norm"),
    ("lr", "train/lr"),
    ("ver", "train/policy_version"),
    ("step_s", "perf/step_time"),
)

#: the step's stages as the loop times them (name in the line, series name), in the step's order
_STAGES = (
    ("rollout", "perf/rollout_time"),
    ("reward", "perf/reward_time"),
    ("update", "perf/train_time"),
    ("sync", "perf/sync_time"),
    ("save", "perf/checkpoint_time"),
    ("eval", "perf/eval_time"),
)


def format_seconds(seconds: float) -> str:
    """H:MM:SS (whole seconds)."""
    s = int(round(max(float(seconds), 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricsLogger:
    """TensorBoard under `log_dir`/`run_name` on rank 0; a no-op elsewhere."""

    def __init__(self, log_dir: str | Path | None, rank: int = 0, console_keys: Sequence[tuple[str, str]] = _CONSOLE,
                 run_name: str | None = None):
        self.enabled = rank == 0 and log_dir is not None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.run_dir = self.log_dir / run_name if self.log_dir is not None and run_name else self.log_dir
        self.console_keys = console_keys
        self._writer = None
        #: the failure count where no writer holds it (another rank, or after close)
        self._restored_failures = 0
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._writer = _EventWriter(self.run_dir)

    @property
    def failures(self) -> int:
        """Rollouts (steps) whose TensorBoard events could not all be written (see _EventWriter)."""
        return self._writer.failures if self._writer is not None else self._restored_failures

    @failures.setter
    def failures(self, n: int) -> None:
        """A resumed run's count so far (checkpointed with the trainer's state)."""
        if self._writer is not None:
            self._writer.failures = int(n)
        self._restored_failures = int(n)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        for name, value in clean.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def log_run(self, step: int, name: str, config: dict[str, Any]) -> None:
        """The run's name and its resolved config, as the `run` text of TensorBoard's Text tab."""
        if not self.enabled:
            return
        from trainer.core.redact import redact_urls

        # a credential in an endpoint URL must not reach everyone who can open the run's events
        body = json.dumps(redact_urls(config), indent=2, sort_keys=True, default=str)
        # four-space indent: TensorBoard renders text as markdown, this keeps the JSON verbatim
        self._writer.add_text("run", f"**{name}**\n\n" + textwrap.indent(body, "    "), step)
        self._writer.flush()

    def log_image_grid(self, step: int, tag: str, images: Sequence[Any], captions: Sequence[str],
                       cols: int | None = None, **grid: Any) -> None:
        """A grid of images ([3, H, W] floats in [0, 1]), each tile with its caption drawn
        under it; the captions also go to the Text tab as `<tag>/captions`. `grid`: captioned_grid's
        options (tile_side)."""
        if not self.enabled or not images:
            return
        self._writer.add_image(tag, captioned_grid(images, captions, cols=cols, **grid), step, dataformats="HWC")
        self._writer.add_text(tag + "/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
        self._writer.flush()

    def log_rows_grid(self, step: int, tag: str, rows: Sequence[tuple[str, Sequence[Any], Sequence[str]]],
                      **grid: Any) -> None:
        """One image of several prompts, one row each: (title, images, captions) per row, the title
        (the prompt, wrapped, never cut) above the row's tiles; the titles and captions also go
        to the Text tab as `<tag>/captions`. `grid`: prompt_rows_grid's options (tile_side)."""
        if not self.enabled or not rows:
            return
        self._writer.add_image(tag, prompt_rows_grid(rows, **grid), step, dataformats="HWC")
        text = "\n\n".join(f"**{title}**  \n" + "  \n".join(caps) for title, _, caps in rows)
        self._writer.add_text(tag + "/captions", text, step)
        self._writer.flush()

    def log_histograms(self, step: int, values: dict[str, Any]) -> None:
        """TensorBoard histograms (tag -> 1-D values); non-finite entries are left out."""
        if not self.enabled:
            return
        for tag, v in values.items():
            a = np.asarray(v.detach().float().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float64).ravel()
            a = a[np.isfinite(a)]
            if a.size:
                self._writer.add_histogram(tag, a, step)
        self._writer.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Markdown text (a table, a note) under `tag` in TensorBoard's Text tab."""
        if not self.enabled:
            return
        self._writer.add_text(tag, text, step)
        self._writer.flush()

    def console_line(self, rollout_id: int, metrics: dict[str, Any], components: Sequence[str] = (),
                     total: int | None = None, eta_s: float | None = None) -> str:
        """One rollout as one line: `rollout k/N`, the rewards and the update's figures, the
        step's seconds with each stage's (as the loop timed them), and the time left at the
        pace so far: a log file (nohup, a job scheduler) has no progress bar to show them."""
        parts = [f"rollout {rollout_id}" + (f"/{total}" if total else "")]
        keys = [(c, f"reward/{c}_mean") for c in components] + list(self.console_keys)
        for short, key in keys:
            if key in metrics and _is_number(metrics[key]):
                v = float(metrics[key])
                parts.append(f"{short}={v:.4g}")
        stages = [f"{short} {float(metrics[key]):.3g}" for short, key in _STAGES
                  if key in metrics and _is_number(metrics[key])]
        if stages:
            parts.append("stages_s: " + ", ".join(stages))
        if eta_s is not None:
            parts.append(f"ETA {format_seconds(eta_s)}")
        failed = metrics.get("reward/failed_groups")
        if _is_number(failed) and float(failed) > 0:
            # a failed group trains nothing: the line must not look like a healthy step
            total = float(failed) + float(metrics.get("reward/num_groups", 0) or 0)
            parts.insert(1, f"FAILED groups={int(failed)}/{int(total)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            self._restored_failures = self._writer.failures
            self._writer.close()
            self._writer = None


class _EventWriter:
    """TensorBoard's SummaryWriter with its writes guarded: a write that fails (a full disk, a
    quota, a file-size limit: TensorBoard's writer thread dies with the OSError and every later
    call raises it again) is counted, warned about once, and never raised, so a run's metrics
    cannot end the run; whether to stop stays the run's own decision. `failures` counts the steps
    (rollouts) whose events were not all written. The broken writer is dropped; the next step
    opens a new event file in the same directory (TensorBoard reads them all as one run), so the
    events come back once there is room again. An event file that a failed open left empty is
    removed, so a full disk does not collect one empty file per rollout."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.failures = 0
        self._writer = None
        self._file: Path | None = None
        self._step: int | None = None
        self._failed_step: int | None = None
        self._warned = False
        self._closed = False
        _quiet_event_writer_threads()
        self._open(None)

    def _open(self, step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        before = set(self.run_dir.glob("events.out.tfevents.*"))
        try:
            self._writer = SummaryWriter(str(self.run_dir))
        except OSError as e:
            self._failed(step, e)
        finally:
            created = set(self.run_dir.glob("events.out.tfevents.*")) - before
            self._file = next(iter(created), None)
        if self._writer is None:
            self._drop_empty_file()

    def _call(self, step: int | None, write: Any) -> None:
        if self._closed:
            return
        if step is not None:
            self._step = step
        step = self._step
        if self._writer is None:
            if step == self._failed_step:
                return  # this step is counted already; a new file is tried at the next one
            self._open(step)
            if self._writer is None:
                return
        try:
            write(self._writer)
        except OSError as e:
            self._failed(step, e)

    def _failed(self, step: int | None, error: OSError) -> None:
        if self._failed_step is None or step != self._failed_step:
            self.failures += 1
        self._failed_step = step
        if not self._warned:
            self._warned = True
            logger.warning("TensorBoard events could not be written to %s (%s: %s); the run goes on, counting each "
                           "rollout whose events are lost in train/metrics_write_failures and the end summary, and "
                           "tries a new event file at the next rollout (free space or raise the file-size limit to "
                           "have them back). This is warned once.", self.run_dir, type(error).__name__, error)
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:  # the same failure again, on the way out
                pass
        self._drop_empty_file()

    def _drop_empty_file(self) -> None:
        try:
            if self._file is not None and self._file.stat().st_size == 0:
                self._file.unlink()
        except OSError:
            pass

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._call(step, lambda w: w.add_scalar(tag, value, step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._call(step, lambda w: w.add_text(tag, text, step))

    def add_image(self, tag: str, image: Any, step: int, **kwargs: Any) -> None:
        self._call(step, lambda w: w.add_image(tag, image, step, **kwargs))

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        self._call(step, lambda w: w.add_histogram(tag, values, step))

    def flush(self) -> None:
        self._call(None, lambda w: w.flush())

    def close(self) -> None:
        self._call(None, lambda w: w.close())
        self._closed = True
        self._writer = None


def _quiet_event_writer_threads() -> None:
    """TensorBoard's writer thread dies with a write's OSError and prints its traceback to stderr
    (threading.excepthook) before the main thread sees the error on its next call, where
    _EventWriter counts it and warns once. Leave that one traceback out; every other thread's
    exception is printed as before."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "_quiet_event_writers", False):
        return

    def hook(args: Any) -> None:
        if (type(args.thread).__module__ == "tensorboard.summary.writer.event_file_writer"
                and issubclass(args.exc_type, OSError)):
            return
        previous(args)

    hook._quiet_event_writers = True
    threading.excepthook = hook


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def _to_uint8_hwc(im: Any) -> np.ndarray:
    """[3, H, W] floats in [0, 1] (or uint8 0-255) -> HWC uint8."""
    if getattr(im, "dtype", None) is not None and str(im.dtype) in ("torch.uint8", "uint8"):
        a = im.cpu().numpy() if hasattr(im, "cpu") else np.asarray(im)
        return np.ascontiguousarray(a.transpose(1, 2, 0))
    a = im.detach().float().cpu().numpy() if hasattr(im, "detach") else np.asarray(im, dtype=np.float32)
    return np.clip(a.transpose(1, 2, 0) * 255.0 + 0.5, 0, 255).astype(np.uint8)


#: a tile's long side is brought into this range: small images are enlarged so a caption fits
#: under them, large ones shrunk so a grid per rollout keeps the event file small
TILE_SIDE = (160, 256)
CAPTION_LINES = 3


def _tile_scale(h: int, w: int, tile_side: tuple[int, int] | None) -> float:
    """The factor that brings an h x w tile's long side into `tile_side` (1 for None: the caller
    sized the tiles itself, as the loop does a video's frame strip, whose long side is several
    frames wide and would otherwise shrink each frame to a few pixels)."""
    if tile_side is None:
        return 1.0
    return min(max(tile_side[0] / max(h, w), 1.0), tile_side[1] / max(h, w))


def captioned_grid(images: Sequence[Any], captions: Sequence[str], cols: int | None = None,
                   tile_side: tuple[int, int] | None = TILE_SIDE, caption_lines: int = CAPTION_LINES) -> np.ndarray:
    """Tile [3, H, W] float images in [0, 1] into one HWC uint8 array with each caption
    written (wrapped, at most `caption_lines` lines) on a white strip under its tile; every tile
    at the largest one's size, its long side brought into `tile_side` (None: as given)."""
    from PIL import Image, ImageDraw, ImageFont

    if len(captions) != len(images):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    arrs = [_to_uint8_hwc(im) for im in images]
    h = max(a.shape[0] for a in arrs)
    w = max(a.shape[1] for a in arrs)
    scale = _tile_scale(h, w, tile_side)
    tw, th = max(1, round(w * scale)), max(1, round(h * scale))
    font = ImageFont.load_default()
    line_h = font.getbbox("Ag")[3] + 3
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    chars = max(4, int((tw - 4) * len(alphabet) // max(font.getlength(alphabet), 1.0)))
    gap = 4
    cell_w, cell_h = tw + gap, th + caption_lines * line_h + 4
    cols = cols or min(len(arrs), 4)
    rows = (len(arrs) + cols - 1) // cols
    canvas = Image.new("RGB", (cols * cell_w - gap, rows * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (a, caption) in enumerate(zip(arrs, captions)):
        r, c = divmod(i, cols)
        x, y = c * cell_w, r * cell_h
        tile = Image.fromarray(a)
        if tile.size != (tw, th):
            # nearest when enlarging: the pixels of a tiny image stay visible as they are
            tile = tile.resize((tw, th), Image.NEAREST if scale > 1 else Image.BILINEAR)
        canvas.paste(tile, (x, y))
        lines = textwrap.wrap(str(caption), chars) or [""]
        if len(lines) > caption_lines:
            lines = lines[:caption_lines]
            lines[-1] = lines[-1][: max(chars - 3, 1)] + "..."
        for j, line in enumerate(lines):
            draw.text((x + 2, y + th + 2 + j * line_h), line, fill="black", font=font)
    return np.asarray(canvas)


#: a row title's lines at most (a prompt longer than this many wrapped lines ends in "...")
TITLE_LINES = 6


def prompt_rows_grid(rows: Sequence[tuple[str, Sequence[Any], Sequence[str]]],
                     tile_side: tuple[int, int] | None = TILE_SIDE,
                     caption_lines: int = CAPTION_LINES, title_lines: int = TITLE_LINES) -> np.ndarray:
    """One HWC uint8 array: per row (title, images, captions), the title wrapped across the
    row's width on a grey strip, then the row's [3, H, W] images in [0, 1] side by side, each
    with its caption (wrapped, at most `caption_lines` lines) under it; tiles sized as in
    captioned_grid."""
    from PIL import Image, ImageDraw, ImageFont

    if not rows:
        raise ValueError("no rows to draw")
    for title, images, captions in rows:
        if len(images) != len(captions) or not images:
            raise ValueError(f"row {title!r}: {len(images)} images and {len(captions)} captions")
    arrs = [[_to_uint8_hwc(im) for im in images] for _, images, _ in rows]
    h = max(a.shape[0] for row in arrs for a in row)
    w = max(a.shape[1] for row in arrs for a in row)
    scale = _tile_scale(h, w, tile_side)
    tw, th = max(1, round(w * scale)), max(1, round(h * scale))
    font = ImageFont.load_default()
    line_h = font.getbbox("Ag")[3] + 3
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    per_char = max(font.getlength(alphabet), 1.0) / len(alphabet)
    gap = 4
    cols = max(len(row) for row in arrs)
    width = cols * (tw + gap) - gap
    tile_chars = max(4, int((tw - 4) / per_char))
    title_chars = max(8, int((width - 8) / per_char))

    def wrapped(text: str, chars: int, limit: int) -> list[str]:
        lines = textwrap.wrap(str(text), chars) or [""]
        if len(lines) > limit:
            lines = lines[:limit]
            lines[-1] = lines[-1][: max(chars - 3, 1)] + "..."
        return lines

    titles = [wrapped(title, title_chars, title_lines) for title, _, _ in rows]
    heights = [len(t) * line_h + 6 + th + caption_lines * line_h + 4 + gap for t in titles]
    canvas = Image.new("RGB", (width, sum(heights)), "white")
    draw = ImageDraw.Draw(canvas)
    y = 0
    for (title, _, captions), row, lines, height in zip(rows, arrs, titles, heights):
        strip = len(lines) * line_h + 6
        draw.rectangle((0, y, width, y + strip - 2), fill=(232, 232, 232))
        for j, line in enumerate(lines):
            draw.text((4, y + 3 + j * line_h), line, fill="black", font=font)
        for i, (a, caption) in enumerate(zip(row, captions)):
            x = i * (tw + gap)
            tile = Image.fromarray(a)
            if tile.size != (tw, th):
                tile = tile.resize((tw, th), Image.NEAREST if scale > 1 else Image.BILINEAR)
            canvas.paste(tile, (x, y + strip))
            for j, line in enumerate(wrapped(caption, tile_chars, caption_lines)):
                draw.text((x + 2, y + strip + th + 2 + j * line_h), line, fill="black", font=font)
        y += height
    return np.asarray(canvas)


def event_run_dir(log_dir: str | Path) -> Path:
    """The directory holding a run's event files: `log_dir` itself, or its one run below it."""
    root = Path(log_dir)
    if any(root.glob("events.out.tfevents.*")):
        return root
    runs = sorted({p.parent for p in root.rglob("events.out.tfevents.*")})
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise ValueError(f"{root}: no TensorBoard event files in it or below it")
    raise ValueError(f"{root} holds {len(runs)} runs ({', '.join(str(r.relative_to(root)) for r in runs)}); "
                     "pass one run's directory")


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of a run's TensorBoard directory (see event_run_dir):
    {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_run_dir(log_dir)), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
