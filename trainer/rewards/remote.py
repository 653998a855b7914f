"""Remote scoring: the JSON protocol and its client (`--reward-runtime remote`).

Protocol (version 1), spoken by tools/reward_server.py and by any service that wants to score
for this trainer:

    POST <endpoint>            Content-Type: application/json
      {"protocol": 1,
       "prompts":  ["a red cube", ...],                  # B strings
       "metadata": [{"sample_id": "..."}, ...],           # B JSON objects
       "images":   ["<base64 PNG, RGB 8-bit>", ...]}      # B images, lossless (same pixels as the rollout PNGs)
    200 -> {"<component>": [B numbers or null], ...}     # null = could not score this image (NaN)
                                                          # anything but a finite number counts as null
    4xx/5xx -> {"error": "<message>"}

    GET <endpoint>  -> {"protocol": 1, "scorer": "<dotpath>", "components": [...], "required_tracks": [...]}

Strict JSON has no NaN, so a non-finite score travels as null and comes back as NaN (its group
then fails, visibly). The client retries connection errors, timeouts, HTTP 429 and 5xx a bounded
number of times with exponential backoff (backoff_s * 2**attempt), never a 4xx (a bad request
does not get better), and then raises RewardEndpointError naming the endpoint.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Mapping

import numpy as np
import torch

from trainer.rewards.base import ImageBatch, RewardError, check_scores

PROTOCOL_VERSION = 1

logger = logging.getLogger(__name__)


class RewardEndpointError(RewardError):
    """The remote reward endpoint could not be reached or answered with an error."""


def encode_png_b64(image: np.ndarray) -> str:
    """uint8 [H, W, 3] -> base64 PNG string (lossless)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_png_b64(data: str) -> np.ndarray:
    """base64 PNG/any PIL-readable image -> uint8 [H, W, 3] (RGB)."""
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def encode_request(images: ImageBatch, prompts: list[str], metadata: list[dict]) -> bytes:
    """The POST body for one batch (see the module docstring)."""
    if not (len(images) == len(prompts) == len(metadata)):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
    body = {
        "protocol": PROTOCOL_VERSION,
        "prompts": list(prompts),
        "metadata": list(metadata),
        "images": [encode_png_b64(a) for a in images.uint8],
    }
    return json.dumps(body, default=str).encode("utf-8")


def decode_request(body: bytes) -> tuple[ImageBatch, list[str], list[dict]]:
    """Parse and validate a POST body; raises ValueError with what is wrong."""
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"request body is not JSON: {e}") from e
    if not isinstance(req, dict):
        raise ValueError("request body must be a JSON object")
    if req.get("protocol", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ValueError(f"unsupported protocol {req.get('protocol')!r}; this server speaks {PROTOCOL_VERSION}")
    prompts, images = req.get("prompts"), req.get("images")
    if not isinstance(prompts, list) or not isinstance(images, list):
        raise ValueError('request needs "prompts" and "images" lists')
    metadata = req.get("metadata") or [{} for _ in prompts]
    if not (len(prompts) == len(images) == len(metadata)):
        raise ValueError(f"{len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata entries")
    try:
        arrays = [decode_png_b64(s) for s in images]
    except Exception as e:
        raise ValueError(f"an image is not a base64-encoded PNG: {e}") from e
    return ImageBatch(arrays), [str(p) for p in prompts], [dict(m or {}) for m in metadata]


def encode_response(scores: Mapping[str, torch.Tensor]) -> bytes:
    """{component: [floats]} with non-finite values as null."""
    out = {}
    for name, t in scores.items():
        out[name] = [v if math.isfinite(v) else None for v in torch.as_tensor(t).float().reshape(-1).tolist()]
    return json.dumps(out).encode("utf-8")


def decode_response(body: bytes, batch_size: int, endpoint: str) -> dict[str, torch.Tensor]:
    """Parse a 200 response into fp32 tensors [B] (null -> NaN); raises RewardEndpointError."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RewardEndpointError(f"reward endpoint {endpoint} returned a body that is not JSON: {e}") from e
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise RewardEndpointError(
            f"reward endpoint {endpoint} must return {{component: [numbers]}}, got {str(data)[:200]}"
        )
    scores = {k: [_reward_value(x) for x in v] for k, v in data.items()}
    bad = sum(1 for k, v in data.items() for x in v if x is not None and not _is_finite_number(x))
    if bad:
        logger.warning("reward endpoint %s returned %d score(s) that are not finite numbers (e.g. %r); their groups "
                       "fail (reward/failed_groups)", endpoint, bad,
                       next(x for v in data.values() for x in v if x is not None and not _is_finite_number(x)))
    return check_scores(scores, batch_size, f"reward endpoint {endpoint}")


def _is_finite_number(x: Any) -> bool:
    # bool is an int subclass in Python: `true` must not become a reward of 1.0
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _reward_value(x: Any) -> float:
    """A JSON score -> float; null, strings ("0"), booleans and non-finite values -> NaN, which
    fails the image's group instead of passing for a real score."""
    return float(x) if _is_finite_number(x) else math.nan


class RemoteScorer:
    """A scorer that POSTs each batch to `endpoint` (module docstring for the protocol).

    timeout_s bounds one HTTP exchange; max_retries is the number of retries after the first
    attempt; backoff_s the first wait (doubling).
    """

    required_tracks = ("image",)

    def __init__(self, endpoint: str, timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 1.0):
        if not endpoint or not endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"--reward-endpoint={endpoint!r} must be an http(s):// URL, e.g. http://host:8000/score"
            )
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self._info: dict | None = None

    def _exchange(self, data: bytes | None) -> bytes:
        """One request (GET if data is None, else POST) with bounded retries."""
        attempts = self.max_retries + 1
        start = time.monotonic()
        last = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(
                self.endpoint, data=data, method="GET" if data is None else "POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return resp.read()
            except urllib.error.HTTPError as e:
                detail = _error_detail(e)
                last = f"HTTP {e.code}: {detail}"
                if e.code != 429 and e.code < 500:
                    raise RewardEndpointError(
                        f"reward endpoint {self.endpoint} (--reward-endpoint) rejected the request: {last}"
                    ) from None
            except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise RewardEndpointError(
            f"reward endpoint {self.endpoint} (--reward-endpoint) failed {attempts} attempt(s) over "
            f"{time.monotonic() - start:.1f}s; last error: {last}. Check that the reward server is running "
            f"and reachable (python tools/reward_server.py --reward-scorer-path ... --host ... --port ...)."
        )

    def info(self) -> dict:
        """The server's GET answer: scorer dotpath, components, required tracks (cached)."""
        if self._info is None:
            try:
                self._info = json.loads(self._exchange(None))
            except json.JSONDecodeError as e:
                raise RewardEndpointError(f"reward endpoint {self.endpoint}: GET did not return JSON: {e}") from e
        return self._info

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self.info().get("components", ()))

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        body = self._exchange(encode_request(images, prompts, metadata))
        return decode_response(body, len(images), self.endpoint)

    __call__ = score


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        body: Any = json.loads(e.read() or b"{}")
        return str(body.get("error", body)) if isinstance(body, dict) else str(body)
    except Exception:
        return str(e.reason)

