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
from trainer.rewards.clip import ClipEmbedder, load_clip_processor, require_clip_dir

#: Hessel et al.'s rescaling of the cosine
CLIPSCORE_WEIGHT = 2.5


class ClipScoreScorer:
    """Component "clipscore" (module docstring). Needs --reward-model-path."""

    components = ("clipscore",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        require_clip_dir(model_path, "trainer.rewards.clipscore.ClipScoreScorer",
                         "a local transformers CLIP directory, e.g. openai/clip-vit-large-patch14")
        from transformers import CLIPModel

        model = CLIPModel.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.clip = ClipEmbedder.from_processor(model, load_clip_processor(model_path), device)

    @classmethod
    def from_modules(cls, model, processor, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """A scorer over an in-memory CLIPModel (benchmarks at random weights)."""
        self = cls.__new__(cls)
        self.clip = ClipEmbedder.from_processor(model, processor, device, dtype)
        return self

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        cos = self.clip.cosine(images, prompts)
        return {"clipscore": (CLIPSCORE_WEIGHT * cos.clamp(min=0.0)).cpu()}

    __call__ = score
