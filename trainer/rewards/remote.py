"""Remote scoring: the JSON protocol and its client (`--reward-runtime remote`).

Protocol (version 1), spoken by tools/reward_server.py and by any service that wants to score
for this trainer:

    POST <endpoint>            Content-Type: application/json
      {"protocol": 1,
       "prompts":  ["a red cube", ...],                  # B strings
       "metadata": [{"sample_id": "..."}, ...],           # B JSON objects (or null / omitted)
       "images":   ["<base64 PNG, RGB 8-bit>", ...],      # B images, lossless (same pixels as the rollout PNGs)
       "source_images": ["<base64 PNG>", ...],           # optional (image editing): the DISTINCT sources,
       "source_index":  [[0], [0], [1], ...]}            # and per image the indices of its sources, in order
    or, for a scorer that requires the "video" track, instead of "images" (and never with sources):
       "videos":   [["<base64 PNG>", ...], ...]          # B lists of frames, in time order, one size per video
    200 -> {"<component>": [B numbers or null], ...}     # null = could not score this image (NaN)
                                                          # anything but a finite number counts as null
    4xx/5xx -> {"error": "<message>"}

    GET <endpoint>  -> {"protocol": 1, "scorer": "<dotpath>", "components": [...], "required_tracks": [...],
                        "source_images": true,             # false from a video scorer's server
                        "limits": {"max_request_bytes": ..., "max_image_pixels": ..., "max_request_pixels": ...,
                                   "max_request_images": ..., "max_request_frames": ..., "max_json_nodes": ...}}

The client sends a batch in as many requests as the advertised limits need (SERVER_LIMIT_FLAGS;
a limit an older server does not advertise is not split for): each request as many candidates
as fit, a candidate's sources with it; a candidate that fits in no request is an error naming
the server's flag, before anything is sent.

Source images (an edit scorer scores an edit against its source): the client takes them out of
metadata[b]["source_images"] (SOURCE_IMAGES_KEY; arrays are not JSON), sends each distinct source
once (a group's candidates share one) and the server puts the decoded arrays back under the same
key, so a scorer reads them where it would in-process. A "source_images" key a peer puts inside
metadata is dropped: only decoded PNGs reach a scorer there, never a path a peer names. The
sources count against the same pixel limits as the images. A server that does not answer
"source_images": true in its GET is an older one: the client refuses to send it sources (they
would be silently ignored) and says so. A batch without sources is encoded exactly as before.
Sources travel with "images" only: a request with "videos" and "source_images" or "source_index"
is refused (400) naming the field, and the client refuses to build one (RewardError).

With FLOWGRPO_REWARD_TOKEN set, every request carries ``Authorization: Bearer <token>``.

A request carries the track its server's scorer requires (GET "required_tracks"): images for an
image scorer, videos for a video scorer; the other is refused (400) naming both. Every video frame
is counted against the pixel limits like an image, before any frame is decoded.

Strict JSON has no NaN, so a non-finite score travels as null and comes back as NaN (its group
then fails, visibly). The client retries connection errors, timeouts, HTTP 429 and 5xx a bounded
number of times with exponential backoff (backoff_s * 2**attempt), never a 4xx or a redirect (they
repeat themselves, and raise RewardEndpointError naming the endpoint), and then raises
EndpointUnavailable: the reward manager fails the candidates of that call (counted as
reward/failed_candidates_unavailable), so an outage costs failed rollouts, which
--reward-max-failed-rollouts bounds, rather than the run. The first contact (the trainer's GET
at start-up) keeps retrying for STARTUP_WAIT_S, for a server that is still starting. An answer
that is not a valid score table (not JSON, too large, nested too deeply or holding more than
MAX_ANSWER_NODES values, a component the server did not declare, a wrong length) is not retried
either: the request's candidates score NaN, so their groups fail and are counted
(reward/failed_groups, reward/failed_candidates_malformed), and the run goes on.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import math
import os
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from trainer.core.redact import redact_url
from trainer.rewards.base import SOURCE_IMAGES_KEY, ImageBatch, RewardError, ScorerUnavailable, check_scores
from trainer.rewards.transport import TOKEN_ENV, HttpFailure, TooManyNodes, exchange, json_nodes, loads_bounded

PROTOCOL_VERSION = 1
#: most source images one candidate may reference (Qwen-Image-Edit-2509 takes up to 3)
MAX_SOURCES_PER_IMAGE = 8
#: how long the first contact with an endpoint (the trainer's start-up GET) keeps retrying an
#: endpoint that does not answer yet (a server still loading its model, restarting), and the
#: longest wait between those tries
STARTUP_WAIT_S = 30.0
STARTUP_BACKOFF_CAP_S = 5.0
#: JSON values an answer may hold (transport.json_nodes): a batch's scores are a few hundred
MAX_ANSWER_NODES = 100_000
#: the server's advertised limits (its GET "limits") a request is split to fit: key -> its flag
SERVER_LIMIT_FLAGS = {
    "max_request_bytes": "--max-request-mb", "max_image_pixels": "--max-image-pixels",
    "max_request_pixels": "--max-request-pixels", "max_request_images": "--max-request-images",
    "max_request_frames": "--max-request-frames", "max_json_nodes": "--max-json-nodes",
}

logger = logging.getLogger(__name__)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# what a refused image most likely is, for the message (magic bytes -> format name)
_OTHER_FORMATS = (
    (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"), (b"%!PS", "EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"), (b"\x00\x00\x00\x0cjP", "JPEG 2000"),
    (b"P1", "PBM/PGM/PPM"), (b"P2", "PBM/PGM/PPM"), (b"P3", "PBM/PGM/PPM"), (b"P4", "PBM/PGM/PPM"),
    (b"P5", "PBM/PGM/PPM"), (b"P6", "PBM/PGM/PPM"), (b"P7", "PAM"), (b"\x00\x00\x01\x00", "ICO"),
)


class RewardEndpointError(RewardError):
    """The remote reward endpoint could not be reached or answered with an error."""


class MalformedAnswer(RewardEndpointError):
    """The endpoint answered 200 with something that is not a valid score table."""


class EndpointUnavailable(RewardEndpointError, ScorerUnavailable):
    """The endpoint did not answer (refused, timed out, 429 or 5xx) through every retry: an
    outage, whose batches the reward manager fails rather than the run."""


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestLimits:
    """What one request may make the server decode (tools/reward_server.py flags of the same names).

    A PNG of 20000 x 20000 black pixels is a few KB on the wire and 1.2 GB decoded, so the body
    size alone bounds nothing: the pixels are checked from the PNG header before any decoding.
    """

    #: pixels of one image (4096 x 4096; 48 MB as RGB)
    max_image_pixels: int = 4096 * 4096
    #: pixels of all the images of one request together (64 Mi, e.g. 64 images of 1024 x 1024; 192 MB as RGB)
    max_request_pixels: int = 64 * 1024 * 1024
    #: images of one request, edit source images included (a client sends 32 at a time)
    max_request_images: int = 256
    #: video frames of one request, all its videos together (32 videos of 81 frames are 2592)
    max_request_frames: int = 4096
    #: JSON values of one request body (transport.json_nodes), counted before it is parsed
    max_json_nodes: int = 100_000


def encode_png_b64(image: np.ndarray) -> str:
    """uint8 [H, W, 3] -> base64 PNG string (lossless)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk, without decoding anything;
    ValueError naming the format when `data` is not a PNG."""
    if not data.startswith(PNG_MAGIC):
        fmt = next((name for magic, name in _OTHER_FORMATS if data.startswith(magic)), None)
        if fmt is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            fmt = "WEBP"
        raise ValueError(f"is {fmt or 'not an image format this server reads'}, not PNG; only PNG is accepted")
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError("is a truncated PNG (no IHDR header)")
    return struct.unpack(">II", data[16:24])


def decode_png(data: bytes) -> np.ndarray:
    """PNG bytes -> uint8 [H, W, 3] (RGB). Only Pillow's PNG reader is tried."""
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=("PNG",)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def decode_png_b64(data: str) -> np.ndarray:
    """base64 PNG -> uint8 [H, W, 3] (RGB)."""
    return decode_png(base64.b64decode(data, validate=True))


def has_sources(metadata: list[dict]) -> bool:
    """Whether any candidate's metadata carries source images (SOURCE_IMAGES_KEY)."""
    return any(isinstance(m, dict) and m.get(SOURCE_IMAGES_KEY) for m in metadata)


def split_sources(metadata: list[dict]) -> tuple[list[dict], list[np.ndarray], list[list[int]]] | None:
    """(metadata without SOURCE_IMAGES_KEY, the distinct source arrays, each candidate's source
    indices), or None when no candidate has sources. Sources are told apart by identity first (the
    rollout shares one array per group) and then by content, so each is sent once."""
    if not has_sources(metadata):
        return None
    distinct: list[np.ndarray] = []
    by_id: dict[int, int] = {}
    by_bytes: dict[tuple, int] = {}
    index: list[list[int]] = []
    clean = []
    for b, m in enumerate(metadata):
        m = dict(m or {})
        entries = m.pop(SOURCE_IMAGES_KEY, None) or []
        clean.append(m)
        row = []
        for entry in entries:
            if id(entry) not in by_id:
                try:
                    arr = ImageBatch.from_any([entry]).uint8[0]
                except (TypeError, ValueError) as e:
                    raise RewardError(f"metadata {b}: a source image sent to a reward server must be decoded (a uint8 "
                                      f"array, a float tensor or a PIL image): {e}") from None
                key = (arr.shape, arr.tobytes())
                if key not in by_bytes:
                    by_bytes[key] = len(distinct)
                    distinct.append(arr)
                by_id[id(entry)] = by_bytes[key]
            row.append(by_id[id(entry)])
        index.append(row)
    return clean, distinct, index


@dataclass
class EncodedBatch:
    """A batch encoded once (every frame a base64 PNG), from which the request of any range of
    its candidates is assembled without encoding again (RemoteScorer splits a batch to the
    server's limits). `media[b]` is candidate b's image, or its video's frames; `pixels[b]` its
    pixels (all frames); sources are the distinct edit source images and `source_index[b]` the
    ones candidate b uses."""

    key: str  # "images" or "videos"
    prompts: list[str]
    metadata: list[dict]
    media: list[Any]
    pixels: list[int]
    largest: list[int]  # pixels of candidate b's largest image or frame
    sources: list[str]
    source_pixels: list[int]
    source_index: list[list[int]] | None

    def __len__(self) -> int:
        return len(self.prompts)

    def counts(self, start: int, stop: int) -> tuple[int, int, int]:
        """(pixels, images, frames) of the request for candidates [start, stop): images are the
        images and the distinct sources they use, frames the videos' frames."""
        used = self.sources_of(start, stop)
        pixels = sum(self.pixels[start:stop]) + sum(self.source_pixels[k] for k in used)
        if self.key == "videos":
            return pixels, 0, sum(len(v) for v in self.media[start:stop])
        return pixels, stop - start + len(used), 0

    def sources_of(self, start: int, stop: int) -> list[int]:
        if self.source_index is None:
            return []
        return list(dict.fromkeys(k for row in self.source_index[start:stop] for k in row))

    def body(self, start: int = 0, stop: int | None = None) -> bytes:
        """The POST body for candidates [start, stop), its sources renumbered in order of first
        use (so the whole batch's body is the one encode_request always gave)."""
        stop = len(self) if stop is None else stop
        body: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "prompts": self.prompts[start:stop],
                                "metadata": self.metadata[start:stop], self.key: self.media[start:stop]}
        if self.source_index is not None:
            used = self.sources_of(start, stop)
            new = {k: i for i, k in enumerate(used)}
            body["source_images"] = [self.sources[k] for k in used]
            body["source_index"] = [[new[k] for k in row] for row in self.source_index[start:stop]]
        return json.dumps(body, default=str).encode("utf-8")


def encode_batch(images: Any, prompts: list[str], metadata: list[dict]) -> EncodedBatch:
    """An ImageBatch (sent as "images") or a VideoBatch (trainer.rewards.video; sent as "videos")
    encoded once, every frame a lossless PNG. Source images go with "images" only; a VideoBatch
    whose metadata carries them is refused (RewardError)."""
    from trainer.rewards.video import VideoBatch  # lazy: that module imports the judge, which imports this one

    if not (len(images) == len(prompts) == len(metadata)):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
    video = isinstance(images, VideoBatch)
    if video and has_sources(metadata):
        # the protocol pairs sources with "images" only; sending the frames without them would
        # score against no source at all, so say so here rather than be answered 400
        raise RewardError(f'metadata carries "{SOURCE_IMAGES_KEY}", but a video batch cannot send source '
                          'images to a reward server (they go with "images" only); drop them from the '
                          "metadata or score images")
    sources = None if video else split_sources(metadata)
    arrays = images.uint8
    if video:
        media: list[Any] = [[encode_png_b64(frame) for frame in clip] for clip in arrays]
        pixels = [int(c.shape[0] * c.shape[1] * c.shape[2]) for c in arrays]
    else:
        media = [encode_png_b64(a) for a in arrays]
        pixels = [int(a.shape[0] * a.shape[1]) for a in arrays]
    largest = [int(a.shape[-3] * a.shape[-2]) for a in arrays]
    return EncodedBatch(
        key="videos" if video else "images", prompts=list(prompts),
        metadata=list(metadata) if sources is None else sources[0], media=media, pixels=pixels, largest=largest,
        sources=[] if sources is None else [encode_png_b64(a) for a in sources[1]],
        source_pixels=[] if sources is None else [int(a.shape[0] * a.shape[1]) for a in sources[1]],
        source_index=None if sources is None else sources[2])


def encode_request(images: Any, prompts: list[str], metadata: list[dict]) -> bytes:
    """The POST body for one batch (see the module docstring)."""
    return encode_batch(images, prompts, metadata).body()


def _source_index(raw: Any, n_images: int, n_sources: int) -> list[list[int]]:
    """The validated "source_index": n_images lists of at most MAX_SOURCES_PER_IMAGE indices in
    [0, n_sources); RequestError otherwise."""
    if not isinstance(raw, list) or len(raw) != n_images:
        raise RequestError(f'"source_index" must be a list of {n_images} lists (one per image)')
    out = []
    for i, row in enumerate(raw):
        if not isinstance(row, list) or len(row) > MAX_SOURCES_PER_IMAGE:
            raise RequestError(f'source_index {i} must be a list of at most {MAX_SOURCES_PER_IMAGE} indices')
        for k in row:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < n_sources:
                raise RequestError(f"source_index {i} holds {str(k)[:20]!r}, not an index into the "
                                   f"{n_sources} source_images")
        out.append(list(row))
    return out


def _check_rows(prompts: list, metadata: Any, items: list, noun: str,
                item_problem: Callable[[int, Any], str | None]) -> list:
    """The request's per-candidate lists checked together: `metadata` (None: one empty object per
    prompt) a list, prompts / metadata / `items` ("images" or "videos", the `noun`) of one
    length, each prompt a string, each metadata entry an object or null, and each item passing
    `item_problem` (which returns the error, or None). Returns the metadata list."""
    if metadata is None:
        metadata = [{} for _ in prompts]
    if not isinstance(metadata, list):
        raise RequestError(f'"metadata" must be a list of objects, got {type(metadata).__name__}')
    if not (len(prompts) == len(items) == len(metadata)):
        raise RequestError(f"{len(items)} {noun}, {len(prompts)} prompts, {len(metadata)} metadata entries")
    for i, (p, m, item) in enumerate(zip(prompts, metadata, items)):
        if not isinstance(p, str):
            raise RequestError(f"prompt {i} must be a string, got {type(p).__name__}")
        if m is not None and not isinstance(m, dict):
            raise RequestError(f"metadata {i} must be an object, got {type(m).__name__}")
        problem = item_problem(i, item)
        if problem is not None:
            raise RequestError(problem)
    return metadata


def _png_header(what: str, s: str, limits: RequestLimits,
                first_frame: tuple[int, int] | None = None) -> tuple[bytes, int, int]:
    """The bytes and (width, height) of one base64 PNG (`what` names it in errors), read from its
    header only: refused when its size differs from the video's `first_frame` (when given), and
    (413) above --max-image-pixels, before anything decodes it."""
    try:
        data = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{what} is not base64: {e}") from None
    try:
        w, h = png_size(data)
    except ValueError as e:
        raise RequestError(f"{what} {e}") from None
    if first_frame is not None and (w, h) != first_frame:
        raise RequestError(f"{what} is {w}x{h}, but the video's first frame is {first_frame[0]}x{first_frame[1]}")
    if w * h > limits.max_image_pixels:
        raise RequestError(f"{what} is {w}x{h} = {w * h} pixels, more than --max-image-pixels="
                           f"{limits.max_image_pixels}", 413)
    return data, w, h


def _decode_png(what: str, data: bytes) -> np.ndarray:
    """decode_png, with whatever Pillow raises on a corrupt PNG turned into a RequestError naming `what`."""
    try:
        return decode_png(data)
    except Exception as e:  # noqa: BLE001 - whatever Pillow raises on a corrupt PNG
        raise RequestError(f"{what} is not a readable PNG: {type(e).__name__}: {str(e)[:200]}") from None


def decode_request(body: bytes, limits: RequestLimits = RequestLimits(),
                   track: str = "image") -> tuple[Any, list[str], list[dict]]:
    """Parse and validate a POST body; RequestError (400, or 413 for too many pixels) with what is wrong.

    `track` is what the server's scorer reads: "image" (an ImageBatch from "images") or "video"
    (a VideoBatch from "videos"). Every image's or frame's size is read from its PNG header and
    checked against `limits` before the first one is decoded, so a decompression bomb costs nothing."""
    try:
        req = loads_bounded(body, "request body", limits.max_json_nodes, "--max-json-nodes")
    except TooManyNodes as e:
        raise RequestError(f"{e}; send fewer images per request", 413) from None
    except ValueError as e:
        raise RequestError(str(e)) from None
    if not isinstance(req, dict):
        raise RequestError("request body must be a JSON object")
    if req.get("protocol", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise RequestError(f"unsupported protocol {str(req.get('protocol'))[:50]!r}; this server speaks "
                           f"{PROTOCOL_VERSION}")
    if track not in ("image", "video"):
        raise ValueError(f"track must be 'image' or 'video', got {track!r}")
    key, other = ("images", "videos") if track == "image" else ("videos", "images")
    if key not in req and other in req:
        raise RequestError(f'this server\'s scorer reads {key}, but the request carries "{other}": point the '
                           f"trainer at a server whose scorer scores {key}")
    prompts, images, metadata = req.get("prompts"), req.get(key), req.get("metadata")
    if not isinstance(prompts, list) or not isinstance(images, list):
        raise RequestError(f'request needs "prompts" and "{key}" lists')
    if track == "video":
        present = [k for k in ("source_images", "source_index") if k in req]
        if present:
            raise RequestError(f'"{present[0]}" goes with "images" only, but this server\'s scorer reads videos: '
                               "send the videos without source images")
        return _decode_videos(prompts, images, metadata, limits)
    sources = req.get("source_images")
    if sources is not None and (not isinstance(sources, list) or not all(isinstance(x, str) for x in sources)):
        raise RequestError('"source_images" must be a list of base64 PNG strings')
    sources = sources or []
    if len(images) + len(sources) > limits.max_request_images:
        raise RequestError(f"the request holds {len(images)} images and {len(sources)} source images, more than "
                           f"--max-request-images={limits.max_request_images}; send fewer images per request", 413)
    source_index = _source_index(req.get("source_index"), len(images), len(sources)) if sources else None
    metadata = _check_rows(prompts, metadata, images, "images", lambda i, im: None if isinstance(im, str) else
                           f"image {i} must be a base64 string, got {type(im).__name__}")
    raw: list[bytes] = []
    total = 0
    named = [(f"image {i}", s) for i, s in enumerate(images)] + \
        [(f"source image {i}", s) for i, s in enumerate(sources)]
    for what, s in named:
        data, w, h = _png_header(what, s, limits)
        total += w * h
        if total > limits.max_request_pixels:
            raise RequestError(f"the images hold more than --max-request-pixels={limits.max_request_pixels} "
                               f"pixels together ({what} reaches {total}); send fewer images per request", 413)
        raw.append(data)
    arrays = []
    for (what, _), data in zip(named, raw):
        arrays.append(_decode_png(what, data))
    # a peer never names a scorer's source: whatever it put under the key is dropped (module docstring)
    metadata = [{k: v for k, v in (m or {}).items() if k != SOURCE_IMAGES_KEY} for m in metadata]
    if source_index is not None:
        decoded = arrays[len(images):]
        for m, row in zip(metadata, source_index):
            if row:
                m[SOURCE_IMAGES_KEY] = [decoded[k] for k in row]
    return ImageBatch(arrays[:len(images)]), list(prompts), metadata


def _decode_videos(prompts: list, videos: list, metadata: Any,
                   limits: RequestLimits) -> tuple[Any, list[str], list[dict]]:
    """decode_request for "videos": B non-empty lists of base64 PNG frames, one size per video;
    every frame's header checked against the pixel limits (all frames of the request counted
    together) before any frame is decoded."""
    from trainer.rewards.video import VideoBatch

    frames = sum(len(v) for v in videos if isinstance(v, list))
    if frames > limits.max_request_frames:
        raise RequestError(f"the request's {len(videos)} videos hold {frames} frames, more than --max-request-frames="
                           f"{limits.max_request_frames}; send fewer or shorter videos per request", 413)
    metadata = _check_rows(prompts, metadata, videos, "videos", lambda i, v: (
        None if isinstance(v, list) and v and all(isinstance(f, str) for f in v)
        else f"video {i} must be a non-empty list of base64 PNG strings (its frames)"))
    raw: list[list[bytes]] = []
    total = 0
    for i, clip in enumerate(videos):
        frames, size = [], None
        for j, s in enumerate(clip):
            where = f"video {i} frame {j}"
            data, w, h = _png_header(where, s, limits, first_frame=size)
            size = (w, h)
            total += w * h
            if total > limits.max_request_pixels:
                raise RequestError(f"the frames hold more than --max-request-pixels={limits.max_request_pixels} "
                                   f"pixels together ({where} reaches {total}); send fewer or smaller videos per "
                                   "request", 413)
            frames.append(data)
        raw.append(frames)
    clips = []
    for i, frames in enumerate(raw):
        clips.append(np.stack([_decode_png(f"video {i} frame {j}", data) for j, data in enumerate(frames)]))
    # as for images: a peer never names a scorer's source (module docstring)
    return VideoBatch(clips), list(prompts), [{k: v for k, v in (m or {}).items() if k != SOURCE_IMAGES_KEY}
                                              for m in metadata]


def encode_response(scores: Mapping[str, torch.Tensor]) -> bytes:
    """{component: [floats]} with non-finite values as null."""
    out = {}
    for name, t in scores.items():
        out[name] = [v if math.isfinite(v) else None for v in torch.as_tensor(t).float().reshape(-1).tolist()]
    return json.dumps(out).encode("utf-8")


def decode_response(body: bytes, batch_size: int, endpoint: str,
                    components: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Parse a 200 response into fp32 tensors [B] (null -> NaN); MalformedAnswer naming the
    endpoint when it is not {component: [B values]} over the declared `components` (when given)."""
    where = f"reward endpoint {redact_url(endpoint)}"
    try:
        data = loads_bounded(body, "the answer", MAX_ANSWER_NODES, "MAX_ANSWER_NODES")
    except TooManyNodes as e:
        raise MalformedAnswer(f"{where} returned a body that is not a score table: {e}") from None
    except ValueError as e:
        raise MalformedAnswer(f"{where} returned a body that is not JSON: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise MalformedAnswer(f"{where} must return {{component: [numbers]}}, got {str(data)[:200]}")
    if components is not None:
        unknown = sorted(set(data) - set(components))
        if unknown:
            raise MalformedAnswer(f"{where} returned component(s) {[u[:50] for u in unknown[:5]]} it did not "
                                  f"declare (its GET lists {list(components)})")
    for name, v in data.items():
        if len(v) != batch_size:
            raise MalformedAnswer(f"{where} returned {len(v)} values for component {name[:50]!r}, "
                                  f"expected {batch_size} (one per image)")
    scores = {k: [_reward_value(x) for x in v] for k, v in data.items()}
    bad = [x for v in data.values() for x in v if x is not None and not _is_finite_number(x)]
    if bad:
        logger.warning("%s returned %d score(s) that are not finite numbers (e.g. %.80r); their groups "
                       "fail (reward/failed_groups)", where, len(bad), bad[0])
    return check_scores(scores, batch_size, where)


def _is_finite_number(x: Any) -> bool:
    # bool is an int subclass in Python: `true` must not become a reward of 1.0
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer beyond float range
        return False


def _reward_value(x: Any) -> float:
    """A JSON score -> float; null, strings ("0"), booleans, non-finite values and integers
    beyond float range -> NaN, which fails the image's group instead of passing for a real score."""
    return float(x) if _is_finite_number(x) else math.nan


class RemoteScorer:
    """A scorer that POSTs each batch to `endpoint` (module docstring for the protocol).

    timeout_s is one deadline for a whole HTTP exchange (connect, send, answer), per attempt;
    max_retries is the number of retries after the first attempt; backoff_s the first wait
    (doubling). The first contact (the GET of info()) keeps retrying for `startup_wait_s`. A
    batch is sent in as many requests as the server's advertised limits need. The bearer token
    comes from the environment variable FLOWGRPO_REWARD_TOKEN.
    """

    required_tracks = ("image",)

    def __init__(self, endpoint: str, timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 1.0,
                 max_response_bytes: int | None = None, startup_wait_s: float = STARTUP_WAIT_S):
        if not endpoint or not endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"--reward-endpoint={redact_url(endpoint)!r} must be an http(s):// URL, e.g. http://host:8000/score"
            )
        self.endpoint = endpoint
        #: the endpoint as messages show it (no credentials)
        self.name = redact_url(endpoint)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_response_bytes = max_response_bytes
        self.startup_wait_s = float(startup_wait_s)
        self.token = os.environ.get(TOKEN_ENV) or None
        self._info: dict | None = None
        self._failures: Counter = Counter()
        self._lock = threading.Lock()

    def _exchange(self, data: bytes | None, wait_s: float = 0.0) -> bytes:
        """One request (GET if data is None, else POST) with bounded retries; with `wait_s`,
        retried for at least that long (waits capped at STARTUP_BACKOFF_CAP_S)."""
        start = time.monotonic()
        attempt = 0
        last = ""
        kwargs = {} if self.max_response_bytes is None else {"max_response_bytes": self.max_response_bytes}
        while True:
            try:
                return exchange(self.endpoint, data, self.timeout_s, token=self.token, **kwargs)
            except HttpFailure as f:
                last = str(f)
                if f.kind == "malformed":
                    raise MalformedAnswer(f"reward endpoint {self.name} (--reward-endpoint): {f}") from None
                if not f.retryable:
                    raise RewardEndpointError(self._rejected(f, data)) from None
            attempt += 1
            left = wait_s - (time.monotonic() - start)
            if attempt > self.max_retries and left <= 0:
                break
            delay = self.backoff_s * 2 ** (attempt - 1)
            if left > 0:
                if attempt == 1:
                    logger.warning("reward endpoint %s (--reward-endpoint) does not answer yet (%s); retrying for "
                                   "up to %.0fs", self.name, last, wait_s)
                delay = min(delay, STARTUP_BACKOFF_CAP_S, left) if attempt > self.max_retries else delay
            time.sleep(delay)
        raise EndpointUnavailable(
            f"reward endpoint {self.name} (--reward-endpoint) failed {attempt} attempt(s) over "
            f"{time.monotonic() - start:.1f}s; last error: {last}. Check that the reward server is running "
            f"and reachable (python tools/reward_server.py --reward-scorer-path ... --host ... --port ...)."
        )

    def _rejected(self, f: HttpFailure, data: bytes | None) -> str:
        """The message for an answer that another attempt would not change."""
        msg = f"reward endpoint {self.name} (--reward-endpoint) rejected the request: {f}"
        if f.status == 413:
            return (f"{msg}. The request was too large ({len(data or b'')} bytes): score fewer images per "
                    "request or raise the server's limit that the message names")
        if f.status in (401, 403):
            return (f"{msg}. Set {TOKEN_ENV} in the trainer's environment to the server's token "
                    f"({'it is set, but the server did not accept it' if self.token else 'it is not set'})")
        return msg

    def info(self) -> dict:
        """The server's GET answer: scorer dotpath, components, required tracks, limits (cached).
        The first one waits up to `startup_wait_s` for an endpoint that does not answer yet."""
        if self._info is None:
            try:
                info = loads_bounded(self._exchange(None, self.startup_wait_s), "the GET answer", MAX_ANSWER_NODES)
            except ValueError as e:
                raise RewardEndpointError(f"reward endpoint {self.name}: {e}") from None
            comps = info.get("components") if isinstance(info, dict) else None
            if not isinstance(comps, list) or not all(isinstance(c, str) for c in comps):
                raise RewardEndpointError(f"reward endpoint {self.name}: its GET answer must hold a "
                                          f'"components" list of names, got {str(info)[:200]}')
            self._info = info
        return self._info

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self.info()["components"])

    def limits(self) -> dict[str, int]:
        """The server's advertised limits (SERVER_LIMIT_FLAGS) that are positive integers; an
        older server advertises fewer, and what it does not advertise is not split for."""
        raw = self.info().get("limits")
        raw = raw if isinstance(raw, dict) else {}
        return {k: v for k, v in raw.items() if k in SERVER_LIMIT_FLAGS and isinstance(v, int)
                and not isinstance(v, bool) and v > 0}

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """Scores of one batch, sent in as many requests as the server's limits need; a malformed
        answer is logged, counted and scored NaN (module docstring); EndpointUnavailable when the
        endpoint does not answer through the retries."""
        components = self.components
        enc = encode_batch(images, prompts, metadata)  # first: it refuses sources with a video batch
        if enc.source_index is not None and self.info().get("source_images") is not True:
            raise RewardEndpointError(
                f"reward endpoint {self.name} (--reward-endpoint) does not accept source images (its GET has no "
                '"source_images": true: an older reward server); an edit scorer there would never see the '
                "source. Update the server (tools/reward_server.py) to this version")
        out = {c: torch.full((len(enc),), math.nan) for c in components}
        for start, stop, data in self._requests(enc):
            try:
                part = decode_response(self._exchange(data), stop - start, self.endpoint, components)
            except MalformedAnswer as e:
                with self._lock:
                    self._failures["malformed"] += stop - start
                logger.warning("%s; the request's %d candidates score NaN and their groups are left out", e,
                               stop - start)
                continue
            for c, t in part.items():
                out[c][start:stop] = t
        return out

    __call__ = score

    def _requests(self, enc: EncodedBatch) -> Iterator[tuple[int, int, bytes]]:
        """(start, stop, body) of requests covering the batch, each within the server's limits:
        as many candidates as fit, found by bisection (the counts grow with the range); a
        candidate that fits in no request is a RewardEndpointError naming the limit's flag."""
        limits = self.limits()
        start = 0
        while start < len(enc):
            body, problem = self._fit(enc, start, len(enc), limits)
            if body is not None:
                yield start, len(enc), body
                return
            body, problem = self._fit(enc, start, start + 1, limits)
            if body is None:
                raise RewardEndpointError(
                    f"reward endpoint {self.name} (--reward-endpoint): candidate {start} alone {problem}, so no "
                    f"request can carry it; raise that limit on the reward server (tools/reward_server.py) or "
                    "score smaller images or videos")
            lo, hi = start + 1, len(enc)  # [start, lo) fits, [start, hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                fitted, _ = self._fit(enc, start, mid, limits)
                if fitted is None:
                    hi = mid
                else:
                    lo, body = mid, fitted
            yield start, lo, body
            start = lo

    def _fit(self, enc: EncodedBatch, start: int, stop: int, limits: dict[str, int]) -> tuple[bytes | None, str]:
        """(the body of candidates [start, stop), "") when it is within `limits`, else (None,
        what exceeds which flag). The counts are checked before the body is assembled."""
        pixels, images, frames = enc.counts(start, stop)
        largest = max(enc.largest[start:stop] + [enc.source_pixels[k] for k in enc.sources_of(start, stop)])
        for key, value, what in (("max_image_pixels", largest, "has an image or frame of"),
                                 ("max_request_pixels", pixels, "needs"), ("max_request_images", images, "needs"),
                                 ("max_request_frames", frames, "needs")):
            unit = "pixels" if "pixels" in key else key.rsplit("_", 1)[1]
            if key in limits and value > limits[key]:
                return None, f"{what} {value} {unit}, more than the server's {SERVER_LIMIT_FLAGS[key]}={limits[key]}"
        body = enc.body(start, stop)
        if "max_request_bytes" in limits and len(body) > limits["max_request_bytes"]:
            return None, (f"makes a request of {len(body)} bytes, more than the server's --max-request-mb "
                          f"({limits['max_request_bytes']} bytes)")
        if "max_json_nodes" in limits and (n := json_nodes(body)) > limits["max_json_nodes"]:
            return None, f"makes a request of {n} JSON values, more than the server's --max-json-nodes=" \
                         f"{limits['max_json_nodes']}"
        return body, ""

    def pop_failures(self) -> dict[str, int]:
        """Candidates lost to malformed answers since the last call (the manager reports them)."""
        with self._lock:
            out, self._failures = dict(self._failures), Counter()
        return out
