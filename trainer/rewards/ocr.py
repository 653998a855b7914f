"""Text-rendering reward, as in FlowGRPO's OCR task.

The target is the text between the first pair of double quotes in the prompt (straight "..." or
curly “...”), or metadata["ocr_text"] when given. With both the target and the OCR'd text
lower-cased and stripped of spaces:

    ocr = 1                                     if target is a substring of the recognised text
    ocr = 1 - min(edit_distance(rec, target), len(target)) / len(target)   otherwise

so 1 is a perfect rendering and 0 means nothing useful was read. A prompt with no quoted text, or
an OCR engine failure, scores NaN: the group fails visibly instead of training on a made-up 0.

The target comes from a prompt file (untrusted input, docs/security.md), and the edit distance
costs len(rec) x len(target). A target longer than MAX_OCR_TARGET_CHARS (1000, after dropping
spaces) is refused: it scores NaN with a warning, rather than being truncated, because a
truncated target would quietly reward rendering a prefix the prompt did not ask for, and no
legible image carries more text than that. A recognised text at least twice the target's length
is at distance >= len(target) (unless it contains the target), so it scores 0 without the table.

The OCR engine is rapidocr-onnxruntime (the `ocr` extra), whose detection / recognition models
ship inside the wheel: nothing is downloaded. It runs on the CPU (onnxruntime's CPU provider).
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import torch

from trainer.rewards.base import ImageBatch

log = logging.getLogger(__name__)

_QUOTED_RE = re.compile(r'"([^"]*)"|“([^”]*)”')


#: longest OCR target accepted, in characters after dropping spaces (module docstring)
MAX_OCR_TARGET_CHARS = 1000


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (unit-cost insert / delete / substitute), O(len(a) * len(b)) work in
    min(len) numpy row updates of max(len) + 1 entries.

    Row i of the table over the longer string b: D[i, j] = min(D[i-1, j] + 1, D[i-1, j-1] + [a_i != b_j],
    D[i, j-1] + 1). The last term chains along the row; with E[j] = D[i, j] - j it is
    E[j] = min(C[j] - j, E[j-1]) for the first two terms C, a running minimum (np.minimum.accumulate).
    """
    if len(a) > len(b):
        a, b = b, a
    if not a:
        return len(b)
    codes = np.frombuffer(b.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    cols = np.arange(len(b) + 1, dtype=np.int64)
    prev = cols.copy()
    for i, ca in enumerate(a, 1):
        cand = np.empty_like(prev)
        cand[0] = i
        np.minimum(prev[1:] + 1, prev[:-1] + (codes != ord(ca)), out=cand[1:])
        prev = np.minimum.accumulate(cand - cols) + cols
    return int(prev[-1])


def ocr_target(prompt: str, metadata: dict | None = None) -> str | None:
    """The text the image should show: metadata["ocr_text"], else the first quoted span."""
    if metadata and metadata.get("ocr_text"):
        return str(metadata["ocr_text"])
    m = _QUOTED_RE.search(prompt or "")
    if not m:
        return None
    return m.group(1) if m.group(1) is not None else m.group(2)


def _normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def ocr_reward(recognised: str, target: str) -> float:
    """1 - min(edit distance, len) / len on lower-cased, space-stripped text; 1 if the target
    is a substring of what was read. NaN for an empty target or one over MAX_OCR_TARGET_CHARS."""
    t, r = _normalise(target), _normalise(recognised)
    if not t or len(t) > MAX_OCR_TARGET_CHARS:
        return math.nan
    if t in r:
        return 1.0
    if len(r) >= 2 * len(t):  # distance >= len(r) - len(t) >= len(t): the cap is reached
        return 0.0
    return 1.0 - min(edit_distance(r, t), len(t)) / len(t)


class OcrScorer:
    """Component "ocr" (module docstring). Needs no --reward-model-path: the models are in the wheel."""

    components = ("ocr",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        del device  # onnxruntime CPU provider whatever the runtime
        if model_path:
            log.info("OcrScorer ignores --reward-model-path=%s: rapidocr's models ship in its wheel", model_path)
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise ImportError(
                "trainer.rewards.ocr.OcrScorer needs rapidocr-onnxruntime: pip install '.[ocr]'"
            ) from e
        self._engine = RapidOCR()

    def recognise(self, image) -> str:
        """All text lines the engine read in one RGB uint8 [H, W, 3] image, concatenated in its
        order. rapidocr takes numpy input as OpenCV BGR; the angle classifier is off, as in
        FlowGRPO (rendered text is upright, and it saves a model call per line)."""
        result, _ = self._engine(np.ascontiguousarray(image[:, :, ::-1]), use_cls=False)
        return "".join(line[1] for line in (result or []))

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        out = []
        for img, prompt, md in zip(images.uint8, prompts, metadata):
            target = ocr_target(prompt, md)
            if target is None:
                out.append(math.nan)
                continue
            if len(_normalise(target)) > MAX_OCR_TARGET_CHARS:
                log.warning("OCR target of %d characters is longer than the %d accepted (trainer.rewards.ocr."
                            "MAX_OCR_TARGET_CHARS); its group is left out: shorten the quoted text or "
                            "metadata.ocr_text", len(_normalise(target)), MAX_OCR_TARGET_CHARS)
                out.append(math.nan)
                continue
            try:
                text = self.recognise(img)
            except Exception as e:  # one unreadable image must not take the rollout down
                log.warning("OCR failed on an image (%s: %s); its group will be left out", type(e).__name__, e)
                out.append(math.nan)
                continue
            out.append(ocr_reward(text, target))
        return {"ocr": torch.tensor(out, dtype=torch.float32)}

    __call__ = score
