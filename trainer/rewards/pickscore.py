"""PickScore: CLIP text-image alignment with the PickScore_v1 weights (a fine-tuned CLIP-H).

    pickscore = logit_scale.exp() * cos(text_embed(prompt), image_embed(image)) / 26

logit_scale.exp() is CLIP's learned temperature (100 for PickScore_v1), so the raw value is the
logit PickScore ranks with; dividing by 26 puts it in the range published Qwen-Image PickScore
figures are quoted in (0.81-0.86 in the Relax system's documentation). Group normalisation makes
the constant irrelevant to training; it only matters for comparing logged numbers.

--reward-model-path is a local directory holding the CLIPModel (config.json + weights) and its
processor (tokenizer files + preprocessor config) side by side, or the processor in a
`processor/` subdirectory. Nothing is downloaded. The model runs in fp32: intra-group reward
differences are ~1e-2 of the score, which bf16's 3 significant digits would blur.
"""

from __future__ import annotations

import torch

from trainer.rewards.base import ImageBatch
from trainer.rewards.clip import ClipSimilarityScorer

#: divisor that maps logit_scale * cos onto the scale published figures use (module docstring)
PICKSCORE_DIVISOR = 26.0


class PickScoreScorer(ClipSimilarityScorer):
    """Component "pickscore" (module docstring). Needs --reward-model-path."""

    components = ("pickscore",)
    model_description = "a local PickScore_v1 directory (processor: laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        cos = self.clip.cosine(images, prompts)
        score = self.model.logit_scale.float().exp() * cos / PICKSCORE_DIVISOR
        return {"pickscore": score.cpu()}

    __call__ = score
