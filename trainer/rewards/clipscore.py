"""CLIPScore: how well an image matches its prompt under a CLIP model (Hessel et al., 2021).

    clipscore = 2.5 * max(cos(text_embed(prompt), image_embed(image)), 0)

The 2.5 stretches CLIP's usual cosines (0.2-0.4 for a matching pair) over roughly [0.5, 1];
group normalisation makes the constant irrelevant to training. Which CLIP is the model
directory's business (openai/clip-vit-large-patch14 is FlowGRPO's; any transformers CLIPModel
works): --reward-model-path holds the CLIPModel (config.json + weights) and its processor
(tokenizer files + preprocessor config), side by side or the processor in processor/. Runs in
fp32, like PickScore, so that small within-group differences survive.
"""

from __future__ import annotations

import torch

from trainer.rewards.base import ImageBatch
from trainer.rewards.clip import ClipSimilarityScorer

#: Hessel et al.'s rescaling of the cosine
CLIPSCORE_WEIGHT = 2.5


class ClipScoreScorer(ClipSimilarityScorer):
    """Component "clipscore" (module docstring). Needs --reward-model-path."""

    components = ("clipscore",)
    model_description = "a local transformers CLIP directory, e.g. openai/clip-vit-large-patch14"

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        cos = self.clip.cosine(images, prompts)
        return {"clipscore": (CLIPSCORE_WEIGHT * cos.clamp(min=0.0)).cpu()}

    __call__ = score
