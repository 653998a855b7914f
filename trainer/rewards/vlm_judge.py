"""A vision-language model as the judge, over an OpenAI-compatible chat endpoint.

What vLLM (`vllm serve`) and SGLang (`python -m sglang.launch_server`) expose for a Qwen2.5-VL or
UnifiedReward model: POST /v1/chat/completions with the image as a data URL. Per image:

    answer = chat(image, template.format(prompt=prompt))
    raw    = float(first match of --reward-judge-score-regex in answer, its first group)
    vlm_judge = (raw - min) / (max - min)      with raw required to lie in [min, max]

so the judge's 0-10 (or 1-5 ...) scale lands on [0, 1]. Each image is one request; up to
--reward-judge-max-concurrency are in flight at once (the batch is the manager's, 32 images by
default). A request that times out or fails (connection error, HTTP 429 / 5xx) is retried up to
--reward-judge-max-retries times with backoff; an answer with no score in range is not retried
(a deterministic judge repeats itself). Whatever fails scores NaN, so its group is left out of the
update and counted (reward/failed_groups), and the reason is counted too
(reward/failed_candidates_<reason>: timeout, http, connection, malformed); the run goes on.

The judge is a network peer, so its answers are untrusted (docs/security.md): --reward-judge-timeout-s
is one deadline for the whole request, an answer over 1 MB, one that is not a chat completion
(deep nesting, huge numbers, wrong types included) counts as malformed, and a redirect is not
followed (http). With FLOWGRPO_JUDGE_TOKEN set, it is sent as ``Authorization: Bearer <token>``
(vLLM / SGLang `--api-key`); the endpoint is logged without userinfo or query string.

Nothing is loaded here: the model is the server's business. --reward-judge-model is the served
model name (omitted from the request when unset; SGLang and recent vLLM then use the one model
they serve).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from trainer.config import RewardConfig
from trainer.core.redact import redact_url
from trainer.rewards.base import ImageBatch
from trainer.rewards.remote import encode_png_b64
from trainer.rewards.transport import JUDGE_TOKEN_ENV, HttpFailure, exchange, loads_bounded

log = logging.getLogger(__name__)

_DEFAULTS = RewardConfig()  # the flags' defaults are the constructor's, declared once
DEFAULT_ENDPOINT = _DEFAULTS.reward_judge_endpoint
DEFAULT_TEMPLATE = _DEFAULTS.reward_judge_prompt_template
DEFAULT_SCORE_REGEX = _DEFAULTS.reward_judge_score_regex
#: largest chat-completion answer read (a score in a few tokens is < 1 KB; reasoning text a few KB)
MAX_JUDGE_RESPONSE_BYTES = 1024 * 1024
#: characters of the answer text searched for the score (--reward-judge-max-tokens bounds an honest one)
MAX_ANSWER_CHARS = 16_384


class _Failed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _answer_text(body: bytes) -> str:
    """The assistant's text of a chat-completion answer; _Failed("malformed") when the body is not one."""
    try:
        data = loads_bounded(body, "the answer")
        content = data["choices"][0]["message"]["content"]
    except ValueError as e:
        raise _Failed("malformed", str(e)) from None
    except (KeyError, IndexError, TypeError) as e:
        raise _Failed("malformed", f"not a chat-completion response ({type(e).__name__}: {e})") from None
    if content is not None and not isinstance(content, str):
        raise _Failed("malformed", f"message content is {type(content).__name__}, not text")
    return (content or "")[:MAX_ANSWER_CHARS]


class VlmJudgeScorer:
    """Component "vlm_judge" (module docstring). Its settings are the --reward-judge-* flags."""

    components = ("vlm_judge",)
    required_tracks = ("image",)
    #: RewardConfig fields passed to the constructor as keyword arguments
    config_fields = (
        "reward_judge_endpoint", "reward_judge_model", "reward_judge_prompt_template", "reward_judge_score_regex",
        "reward_judge_score_min", "reward_judge_score_max", "reward_judge_max_concurrency",
        "reward_judge_timeout_s", "reward_judge_max_retries", "reward_judge_max_tokens",
    )

    def __init__(
        self,
        model_path: str | None = None,
        device: str = "cpu",
        *,
        reward_judge_endpoint: str = DEFAULT_ENDPOINT,
        reward_judge_model: str | None = None,
        reward_judge_prompt_template: str = DEFAULT_TEMPLATE,
        reward_judge_score_regex: str = DEFAULT_SCORE_REGEX,
        reward_judge_score_min: float = 0.0,
        reward_judge_score_max: float = 10.0,
        reward_judge_max_concurrency: int = 8,
        reward_judge_timeout_s: float = 60.0,
        reward_judge_max_retries: int = 2,
        reward_judge_max_tokens: int = 64,
        backoff_s: float = 0.5,
    ):
        del model_path, device  # the model lives behind the endpoint
        if not str(reward_judge_endpoint).startswith(("http://", "https://")):
            raise ValueError(f"--reward-judge-endpoint={redact_url(reward_judge_endpoint)!r} must be an http(s):// "
                             "URL, e.g. http://host:8000/v1/chat/completions")
        try:
            reward_judge_prompt_template.format(prompt="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"--reward-judge-prompt-template: {e!r}; the only placeholder is {{prompt}} "
                             "(write literal braces as {{ and }})") from None
        try:
            self.score_re = re.compile(reward_judge_score_regex)
        except re.error as e:
            raise ValueError(f"--reward-judge-score-regex={reward_judge_score_regex!r} is not a regex: {e}") from None
        if not reward_judge_score_max > reward_judge_score_min:
            raise ValueError(f"--reward-judge-score-max ({reward_judge_score_max}) must exceed "
                             f"--reward-judge-score-min ({reward_judge_score_min})")
        for flag, v in (("max-concurrency", reward_judge_max_concurrency), ("max-tokens", reward_judge_max_tokens)):
            if int(v) < 1:
                raise ValueError(f"--reward-judge-{flag} must be >= 1, got {v}")
        self.endpoint, self.model = reward_judge_endpoint, reward_judge_model
        #: the endpoint as messages show it (no credentials); the API key comes from the environment
        self.name = redact_url(reward_judge_endpoint)
        self.token = os.environ.get(JUDGE_TOKEN_ENV) or None
        self.max_response_bytes = MAX_JUDGE_RESPONSE_BYTES
        self.template = reward_judge_prompt_template
        self.lo, self.hi = float(reward_judge_score_min), float(reward_judge_score_max)
        self.max_concurrency = int(reward_judge_max_concurrency)
        self.timeout_s, self.max_retries = float(reward_judge_timeout_s), int(reward_judge_max_retries)
        self.max_tokens, self.backoff_s = int(reward_judge_max_tokens), float(backoff_s)
        self._failures: Counter = Counter()
        self._lock = threading.Lock()

    # -- one image ------------------------------------------------------------------------------
    def request_body(self, png_b64: str | list[str], prompt: str) -> bytes:
        """One chat message: the image(s), in order (an edit judge shows source then edit), then the text."""
        pngs = [png_b64] if isinstance(png_b64, str) else list(png_b64)
        body = {
            "messages": [{"role": "user", "content": [
                *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}} for b in pngs),
                {"type": "text", "text": self.template.format(prompt=prompt)},
            ]}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        if self.model:
            body["model"] = self.model
        return json.dumps(body).encode("utf-8")

    def parse(self, answer: str) -> float:
        """The answer's score mapped onto [0, 1]; _Failed("malformed") when there is none in range."""
        m = self.score_re.search(answer or "")
        if m is None:
            raise _Failed("malformed", f"no score in the answer {answer[:120]!r}")
        try:
            raw = float(m.group(1) if m.groups() else m.group(0))
        except ValueError:
            raise _Failed("malformed", f"{m.group(0)!r} in the answer is not a number") from None
        if not self.lo <= raw <= self.hi:
            raise _Failed("malformed", f"score {raw} outside [{self.lo}, {self.hi}] in the answer {answer[:120]!r}")
        return (raw - self.lo) / (self.hi - self.lo)

    def _ask(self, body: bytes) -> str:
        last: _Failed | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                answer = exchange(self.endpoint, body, self.timeout_s, token=self.token,
                                  max_response_bytes=self.max_response_bytes)
            except HttpFailure as f:
                reason = f.kind if f.kind in ("timeout", "connection", "malformed") else "http"
                last = _Failed(reason, str(f))
                if not f.retryable:
                    raise last from None
                continue
            return _answer_text(answer)
        assert last is not None
        raise last

    def _score_one(self, png_b64: str | list[str], prompt: str) -> float:
        try:
            return self.parse(self._ask(self.request_body(png_b64, prompt)))
        except _Failed as f:
            with self._lock:
                self._failures[f.reason] += 1
            log.warning("VLM judge %s: candidate not scored (%s: %s); its group is left out", self.name, f.reason, f)
            return float("nan")

    # -- the scorer protocol --------------------------------------------------------------------
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        pngs = [encode_png_b64(a) for a in images.uint8]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(pngs), 1))) as pool:
            scores = list(pool.map(self._score_one, pngs, prompts))
        return {"vlm_judge": torch.tensor(scores, dtype=torch.float32)}

    __call__ = score

    def pop_failures(self) -> dict[str, int]:
        """Failed candidates by reason since the last call (the manager reports them as metrics)."""
        with self._lock:
            out, self._failures = dict(self._failures), Counter()
        return out

