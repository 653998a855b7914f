"""Rewards for image edits: each scores an edited image AGAINST its source image.

How a scorer receives the source. The scorer protocol stays `score(images, prompts, metadata)`;
candidate b's source image(s) travel in ``metadata[b]["source_images"]`` (SOURCE_IMAGES_KEY), a
list with one entry per source in record order. The rollout puts there the very pixels the engine
conditioned on (uint8 [H, W, 3], after its resize), decoded once per record and shared by the
group's candidates; an entry may also be a float tensor [3, H, W] in [0, 1], a PIL image, or a
file path (tools/score.py re-scoring saved rollouts), which are converted here. `source_batch`
turns them into one ImageBatch of the first source per candidate, resized to that candidate's size
so that pixel-wise terms compare aligned pixels. A candidate without a source is a wiring error
(RewardError naming the key), not a zero reward.

The scorers (weightless first):

ColorEditScorer, components "color_edit" (trained), "edit_color" and "edit_preserve" (read). For
an instruction naming a target colour c ("make the circle red") and source / edit pixels s_p, e_p
in [0, 1]^3 of an H x W image:

    R        = the source's object: largest_component(object_mask(source)) (trainer.rewards.color)
    colour   C = mean_{p in R} q_c(e_p)        q_c: hue_posterior, the softmax over the six HUES
    preserve P = mean_{p not in R} exp(-||e_p - s_p||^2 / (2 PRESERVE_SIGMA^2)),  PRESERVE_SIGMA = 0.15
    color_edit = C * P

Both factors lie in [0, 1], so the product does: 1 for an edit that paints the object entirely in
c and leaves every other pixel as it was; ~0 for an edit that changes nothing (unless the object
was already c), and ~0 for one that paints the whole picture c (P collapses). A pixel moved by
0.15 in RGB keeps exp(-1/2) = 0.61 of its preservation, one moved by 0.3 keeps 0.14. The target
colour is metadata["color"] when set, else the LAST palette word of the instruction ("make the
blue circle red" asks for red). No colour named, or a source with no object: NaN (the group fails,
visibly).

ClipPreservationScorer, component "clip_preserve" = cos(CLIP_image(source), CLIP_image(edit)),
the image-image similarity of source and edit in a local CLIP (--reward-model-path: the same
transformers CLIP directory PickScore / CLIPScore load), as FlowGRPO's FLUX.1-Kontext counting
recipe weights it beside its instruction reward. Range [-1, 1]; 1 for an unchanged picture.

EditJudgeScorer, component "edit_judge": the VLM judge (trainer.rewards.vlm_judge, the same
--reward-judge-* flags) shown BOTH images in one chat message, source first, then the edit, with a
template that asks whether the instruction was followed and the rest kept. A served Qwen2.5-VL
needs two images per prompt allowed (vLLM: --limit-mm-per-prompt image=2).

Through the remote route (--reward-runtime remote) the client sends the sources beside the edits
(trainer.rewards.remote, "source_images"), so EditReward- or UnifiedReward-Edit-shaped models
behind tools/reward_server.py receive them in the same metadata key.
"""

from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from trainer.rewards.base import SOURCE_IMAGES_KEY, ImageBatch, RewardError
from trainer.rewards.clip import ClipSimilarityScorer
from trainer.rewards.color import color_palette, hue_posterior, largest_component, metadata_color, object_mask
from trainer.rewards.remote import encode_png_b64
from trainer.rewards.vlm_judge import DEFAULT_TEMPLATE, VlmJudgeScorer

__all__ = ["SOURCE_IMAGES_KEY", "ClipPreservationScorer", "ColorEditScorer", "EditJudgeScorer", "source_batch",
           "edit_target_color", "color_edit_terms"]
#: largest source image read from a file path (4096 x 4096, as the reward server's per-image limit)
MAX_SOURCE_PIXELS = 4096 * 4096
#: ColorEditScorer's preservation kernel width, in RGB units (module docstring)
PRESERVE_SIGMA = 0.15

_PALETTE = color_palette()
_COLOR_WORD = re.compile(r"\b(" + "|".join(_PALETTE) + r")\b", re.IGNORECASE)

#: the edit judge's question; {prompt} is the instruction
EDIT_JUDGE_TEMPLATE = (
    "The first image is the original. The second image is the result of editing it with the instruction: "
    "\"{prompt}\". Rate from 0 (worst) to 10 (best) how well the second image follows the instruction while "
    "keeping everything the instruction does not mention unchanged. Answer with the number only."
)


# ----------------------------------------------------------------------------- the source images


def _to_uint8(entry: Any, where: str) -> np.ndarray:
    """One source entry (uint8 array, float tensor, PIL image or file path) -> uint8 [H, W, 3]."""
    if isinstance(entry, (str, bytes)) or hasattr(entry, "__fspath__"):
        from trainer.core.image_file import ImageFileError, decode_rgb

        try:  # an untrusted file: the accepted formats only, its size checked from the header
            return np.asarray(decode_rgb(entry, f"source image {os.fsdecode(entry)}", max_pixels=MAX_SOURCE_PIXELS),
                              dtype=np.uint8).copy()
        except (ImageFileError, OSError) as e:
            raise RewardError(f"{where}: {e}") from None
    try:
        return ImageBatch.from_any([entry]).uint8[0]
    except (TypeError, ValueError) as e:
        raise RewardError(f"{where}: {e}") from None


def _resized(array: np.ndarray, height: int, width: int) -> np.ndarray:
    if array.shape[:2] == (height, width):
        return array
    from PIL import Image

    return np.array(Image.fromarray(array).resize((width, height), Image.Resampling.BICUBIC), dtype=np.uint8)


def source_batch(images: ImageBatch, metadata: list[dict], index: int = 0) -> ImageBatch:
    """The `index`-th source image of every candidate, each resized (bicubic) to its candidate's
    size, as one ImageBatch. A source shared by a group's candidates (the same object) is
    converted once. RewardError naming SOURCE_IMAGES_KEY when a candidate has none."""
    out, seen = [], {}
    for b, (edit, md) in enumerate(zip(images.uint8, metadata)):
        sources = (md or {}).get(SOURCE_IMAGES_KEY)
        if not isinstance(sources, (list, tuple)) or len(sources) <= index:
            raise RewardError(f"candidate {b}: metadata[{SOURCE_IMAGES_KEY!r}] holds no source image {index}; an "
                              "edit scorer scores an edit against its source (task i2i)")
        entry = sources[index]
        key = (id(entry), edit.shape[:2])
        if key not in seen:
            seen[key] = _resized(_to_uint8(entry, f"candidate {b}"), *edit.shape[:2])
        out.append(seen[key])
    return ImageBatch(out)


# ----------------------------------------------------------------------------- colour edit


def edit_target_color(instruction: str, metadata: dict | None = None) -> str | None:
    """metadata["color"] if set (a palette name), else the LAST palette word of the instruction
    (an edit instruction names the new colour after the old one), else None."""
    name = metadata_color(metadata)
    if name is not None:
        return name
    words = _COLOR_WORD.findall(instruction or "")
    return words[-1].lower() if words else None


def color_edit_terms(source: torch.Tensor, edit: torch.Tensor, color: str) -> tuple[float, float] | None:
    """(C, P) of the module docstring for fp32 [3, H, W] images in [0, 1] of one size; None when
    the source has no object (nothing to recolour)."""
    region = largest_component(object_mask(source))
    if not region.any():
        return None
    e = edit.float().permute(1, 2, 0)  # [H, W, 3]
    colour = float(hue_posterior(e[region], color).mean())
    outside = ~region
    if not outside.any():
        return colour, 1.0
    d2 = (e[outside] - source.float().permute(1, 2, 0)[outside]).pow(2).sum(dim=1)
    preserve = float(torch.exp(-d2 / (2.0 * PRESERVE_SIGMA ** 2)).mean())
    return colour, preserve


class ColorEditScorer:
    """Components "color_edit" (trained), "edit_color", "edit_preserve" (read): the named colour
    inside the source's object times the preservation of everything else (module docstring)."""

    components = ("color_edit", "edit_color", "edit_preserve")
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        del model_path, device  # no weights; a few CPU ops per image

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        sources = source_batch(images, metadata)
        out: dict[str, list[float]] = {c: [] for c in self.components}
        for src, edit, prompt, md in zip(sources.float_tensors, images.float_tensors, prompts, metadata):
            color = edit_target_color(prompt, md)
            terms = None if color is None else color_edit_terms(src, edit, color)
            c, p = terms if terms is not None else (math.nan, math.nan)
            for name, v in zip(self.components, (c * p, c, p)):
                out[name].append(v)
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}

    __call__ = score


# ----------------------------------------------------------------------------- CLIP preservation


class ClipPreservationScorer(ClipSimilarityScorer):
    """Component "clip_preserve": cos of the CLIP image embeddings of source and edit (module
    docstring). Needs --reward-model-path (a transformers CLIP directory)."""

    components = ("clip_preserve",)
    model_description = "a local transformers CLIP directory (e.g. openai/clip-vit-large-patch14)"

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        sources = source_batch(images, metadata)
        # one forward over edits and sources together: the group's shared source costs a row each,
        # which is cheaper than a second call at these batch sizes
        both = ImageBatch(list(images.uint8) + list(sources.uint8))
        emb = self.clip.image(self.clip.pixels(both))
        n = len(images)
        return {"clip_preserve": (emb[:n] * emb[n:]).sum(dim=-1).cpu()}

    __call__ = score


# ----------------------------------------------------------------------------- VLM judge


class EditJudgeScorer(VlmJudgeScorer):
    """Component "edit_judge": the VLM judge shown the source, then the edit (module docstring).
    Its settings are the --reward-judge-* flags; the t2i default template is replaced by
    EDIT_JUDGE_TEMPLATE (a template given explicitly is kept)."""

    components = ("edit_judge",)

    def __init__(self, model_path: str | None = None, device: str = "cpu", **kwargs):
        if kwargs.get("reward_judge_prompt_template", DEFAULT_TEMPLATE) == DEFAULT_TEMPLATE:
            kwargs["reward_judge_prompt_template"] = EDIT_JUDGE_TEMPLATE
        super().__init__(model_path, device, **kwargs)

    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        sources = source_batch(images, metadata)
        src_png = {}
        pairs = []
        for src, edit in zip(sources.uint8, images.uint8):
            if id(src) not in src_png:  # a group's shared source is encoded once
                src_png[id(src)] = encode_png_b64(src)
            pairs.append([src_png[id(src)], encode_png_b64(edit)])
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(pairs), 1))) as pool:
            scores = list(pool.map(self._score_one, pairs, prompts))
        return {"edit_judge": torch.tensor(scores, dtype=torch.float32)}

    __call__ = score
