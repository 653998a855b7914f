"""What the CLIP-family scorers share: the model-directory check, the processor, the embeddings.

A scorer's constructor is its directory check: `require_files` refuses a missing or partial
--reward-model-path before any weight is read, naming the first missing file, so a run fails
at start-up instead of at the first rollout. Everything loads with local_files_only.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

#: the files a transformers model directory may hold its weights in (any one will do)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: the tokenizer forms a CLIP processor loads from (any one will do)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
#: where the image preprocessing is described (transformers 5 writes processor_config.json)
PREPROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def require_files(model_path: str | None, scorer: str, needs: Sequence[str | tuple[str, ...]], flag: str = "--reward-model-path",
                  what: str = "") -> str:
    """Raise unless `model_path` is a directory holding every entry of `needs` (a file name, or a
    tuple of alternatives of which one must exist). Returns the path."""
    if not model_path:
        raise ValueError(f"{scorer} needs {flag} (a local directory{': ' + what if what else ''})")
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"{flag}={model_path} is not a directory ({scorer} loads {what or 'its model'} from it)")
    for need in needs:
        options = (need,) if isinstance(need, str) else tuple(need)
        if not any(os.path.exists(os.path.join(model_path, name)) for name in options):
            names = " or ".join(options)
            raise FileNotFoundError(
                f"{flag}={model_path} is missing {names}: {scorer} needs {what or 'a complete model directory'}; "
                "download the whole model directory beforehand (nothing is fetched at run time)"
            )
    return model_path


def processor_dir(model_path: str) -> str:
    """The directory holding the CLIP processor: the model directory itself, or its processor/."""
    sub = os.path.join(model_path, "processor")
    return sub if any(os.path.isfile(os.path.join(sub, f)) for f in PREPROCESSOR_FILES) else model_path


def require_clip_dir(model_path: str | None, scorer: str, what: str, weights: bool = True) -> str:
    """A transformers CLIP directory: config + weights (unless `weights` is False) + processor
    (preprocessor config and tokenizer), the processor possibly in processor/."""
    needs: list = ["config.json", WEIGHT_FILES] if weights else []
    require_files(model_path, scorer, needs, what=what)
    require_files(processor_dir(model_path), scorer, [PREPROCESSOR_FILES, TOKENIZER_FILES],
                  what=f"{what} (with its CLIP processor: tokenizer files + preprocessor_config.json, "
                       "beside the model or in processor/)")
    return model_path


def load_clip_processor(model_path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(processor_dir(model_path), local_files_only=True)


def text_max_length(tokenizer, model) -> int:
    cfg = getattr(model.config, "text_config", model.config)
    return min(int(tokenizer.model_max_length), int(cfg.max_position_embeddings))


class ClipEmbedder:
    """Unit-norm CLIP image and text embeddings in the model's dtype, returned as fp32.

    A group's candidates share one prompt, so `text` encodes each distinct prompt once and
    returns the row index of every input prompt.
    """

    def __init__(self, model, tokenizer, image_processor=None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        self.model = model.eval().requires_grad_(False).to(self.device, dtype)
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self._max_len = text_max_length(tokenizer, self.model)

    @classmethod
    def from_processor(cls, model, processor, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        return cls(model, processor.tokenizer, processor.image_processor, device, dtype)

    def pixels(self, images) -> torch.Tensor:
        px = self.image_processor(images=images.pil, return_tensors="pt")["pixel_values"]
        return px.to(self.device, self.dtype)

    def image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        feats = self.model.get_image_features(pixel_values=pixel_values)
        feats = getattr(feats, "pooler_output", feats)  # transformers 5 may return an output object
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    def text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        row_of = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # a dict: list.index is quadratic
        unique = list(row_of)
        rows = torch.tensor([row_of[p] for p in prompts], device=self.device)
        tok = self.tokenizer(unique, padding=True, truncation=True, max_length=self._max_len,
                                       return_tensors="pt")
        feats = self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                             attention_mask=tok["attention_mask"].to(self.device))
        feats = getattr(feats, "pooler_output", feats)
        return torch.nn.functional.normalize(feats.float(), dim=-1), rows

    def cosine(self, images, prompts: list[str], pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """cos(image_embed, text_embed(prompt)) per image, fp32 [B] on the device."""
        img = self.image(self.pixels(images) if pixel_values is None else pixel_values)
        txt, rows = self.text(prompts)
        return (img * txt[rows]).sum(dim=-1)


class ClipSimilarityScorer:
    """Base of the scorers that are a function of cos(text, image) under one transformers CLIP
    directory (PickScore, CLIPScore): the directory check, the fp32 load, the in-memory build."""

    required_tracks = ("image",)
    #: what --reward-model-path must be, for the error message
    model_description = "a local transformers CLIP directory"

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        cls = type(self)
        require_clip_dir(model_path, f"{cls.__module__}.{cls.__qualname__}", cls.model_description)
        from transformers import CLIPModel

        model = CLIPModel.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.clip = ClipEmbedder.from_processor(model, load_clip_processor(model_path), device)

    @classmethod
    def from_modules(cls, model, processor, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """A scorer over an in-memory CLIPModel (benchmarks at random weights)."""
        self = cls.__new__(cls)
        self.clip = ClipEmbedder.from_processor(model, processor, device, dtype)
        return self

    @property
    def model(self):
        return self.clip.model
