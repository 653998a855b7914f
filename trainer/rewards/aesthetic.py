"""The LAION aesthetic predictor (v2, "improved aesthetic predictor"): an MLP on CLIP ViT-L/14
image embeddings, trained to predict human 1-10 aesthetic ratings (SAC + LOGOS + AVA).

    aesthetic = MLP(image_embed(image) / ||image_embed(image)||)

The MLP is 768 -> 1024 -> 128 -> 64 -> 16 -> 1 (dropout between the first four layers, off at
inference, no activations: as published). --reward-model-path is a local directory holding
  - the CLIP vision tower: a transformers CLIPModel or CLIPVisionModelWithProjection
    (config.json + weights; openai/clip-vit-large-patch14) and its preprocessor config;
  - the head's weights as `sac+logos+ava1-l14-linearMSE.pth` (the published file, a plain
    state dict; read with torch.load(weights_only=True)).
The prompt is not used. Runs in fp32.
"""

from __future__ import annotations

import os

import torch

from trainer.rewards.base import ImageBatch
from trainer.rewards.clip import PREPROCESSOR_FILES, WEIGHT_FILES, processor_dir, require_files

#: the published head file (improved-aesthetic-predictor)
HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
#: hidden widths of the head after its input (the input is the CLIP projection width, 768 for ViT-L/14)
HEAD_WIDTHS = (1024, 128, 64, 16)
_SCORER = "trainer.rewards.aesthetic.AestheticScorer"


class AestheticHead(torch.nn.Module):
    """The published MLP; parameter names match its state dict (layers.0, .2, .4, .6, .7)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        w = HEAD_WIDTHS
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(input_size, w[0]), torch.nn.Dropout(0.2),
            torch.nn.Linear(w[0], w[1]), torch.nn.Dropout(0.2),
            torch.nn.Linear(w[1], w[2]), torch.nn.Dropout(0.1),
            torch.nn.Linear(w[2], w[3]),
            torch.nn.Linear(w[3], 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_head(path: str, input_size: int) -> AestheticHead:
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    first = state.get("layers.0.weight") if isinstance(state, dict) else None
    if first is None:
        raise ValueError(f"--reward-model-path: {path} is not the aesthetic head's state dict (no layers.0.weight)")
    if first.shape[1] != input_size:
        raise ValueError(
            f"--reward-model-path: {path} takes {first.shape[1]}-wide embeddings but the CLIP beside it "
            f"projects to {input_size}: the head needs CLIP ViT-L/14 (openai/clip-vit-large-patch14)"
        )
    head = AestheticHead(input_size)
    head.load_state_dict(state)
    return head


class AestheticScorer:
    """Component "aesthetic" (module docstring). Needs --reward-model-path."""

    components = ("aesthetic",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        what = f"CLIP ViT-L/14 (openai/clip-vit-large-patch14) with {HEAD_FILE} beside it"
        require_files(model_path, _SCORER, ["config.json", WEIGHT_FILES, HEAD_FILE], what=what)
        require_files(processor_dir(model_path), _SCORER, [PREPROCESSOR_FILES], what=what)
        from transformers import AutoConfig, AutoImageProcessor, CLIPVisionModelWithProjection

        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        if hasattr(config, "vision_config"):  # a full CLIPModel: keep its vision tower and projection only
            projection_dim = config.projection_dim
            config = config.vision_config
            config.projection_dim = projection_dim
        vision = CLIPVisionModelWithProjection.from_pretrained(model_path, config=config, local_files_only=True,
                                                               dtype=torch.float32)
        head = load_head(os.path.join(model_path, HEAD_FILE), int(vision.config.projection_dim))
        processor = AutoImageProcessor.from_pretrained(processor_dir(model_path), local_files_only=True)
        self._setup(vision, head, processor, device, torch.float32)

    @classmethod
    def from_modules(cls, vision, head, image_processor, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """A scorer over in-memory modules (benchmarks at random weights)."""
        self = cls.__new__(cls)
        self._setup(vision, head, image_processor, device, dtype)
        return self

    def _setup(self, vision, head, processor, device, dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.vision = vision.eval().requires_grad_(False).to(self.device, dtype)
        self.head = head.eval().requires_grad_(False).to(self.device, dtype)
        self.processor = processor

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        px = self.processor(images=images.pil, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        emb = self.vision(pixel_values=px).image_embeds
        emb = emb / emb.norm(dim=-1, keepdim=True)
        return {"aesthetic": self.head(emb).float().reshape(-1).cpu()}

    __call__ = score
