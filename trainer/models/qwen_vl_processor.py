"""The image half of transformers' Qwen2VLProcessor, without its video half.

Qwen-Image-Edit (2509 / 2511, QwenImageEditPlusPipeline) shows the source image(s) to its
Qwen2.5-VL text encoder: the prompt carries "<|vision_start|><|image_pad|><|vision_end|>" per
image, and the processor turns each image into 14-pixel patches (pixel_values, image_grid_thw) and
repeats <|image_pad|> once per merged 2 x 2 patch group. transformers 5's Qwen2VLProcessor cannot
be built or loaded without torchvision (its video processor requires it) although an edit never
has a video; this class does exactly the image path with the PIL image processor, so the edit
family needs no torchvision. Its call signature is the one QwenImageEditPlusPipeline uses
(`processor(text=..., images=..., padding=True, return_tensors="pt")`), so it can also be handed
to the stock pipeline (`from_pretrained(dir, processor=...)`).
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_TOKEN = "<|image_pad|>"
#: keys of processor/preprocessor_config.json this class reads (size is accepted in both the
#: min/max_pixels and the shortest/longest_edge spelling)
_IMAGE_PROCESSOR_KEYS = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std",
                         "min_pixels", "max_pixels", "size", "do_resize", "do_rescale", "rescale_factor",
                         "do_normalize", "do_convert_rgb", "resample")


def image_token_count(grid_thw, merge_size: int) -> int:
    """<|image_pad|> tokens for one image: its t x h x w patch grid over merge_size ** 2 (the
    vision tower merges each merge_size x merge_size group of patches into one token)."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def expand_image_tokens(texts: list[str], grids, merge_size: int, image_token: str = IMAGE_TOKEN) -> list[str]:
    """Each text with its k-th <|image_pad|> (counted over the whole batch, in order) repeated
    image_token_count(grids[k]) times; raises when the placeholders and images disagree."""
    out, k = [], 0
    for text in texts:
        parts = text.split(image_token)
        pieces = [parts[0]]
        for rest in parts[1:]:
            if k >= len(grids):
                raise ValueError(f"the prompts hold more {image_token} placeholders than the {len(grids)} images given")
            pieces.append(image_token * image_token_count(grids[k], merge_size))
            pieces.append(rest)
            k += 1
        out.append("".join(pieces))
    if k != len(grids):
        raise ValueError(f"{len(grids)} images given but the prompts hold {k} {image_token} placeholders")
    return out


def _processor_base():
    # a ProcessorMixin subclass, so that diffusers' from_pretrained accepts it in the "processor"
    # slot; ProcessorMixin.__init__ is not called (it is the part that demands a video processor)
    from transformers import ProcessorMixin

    return ProcessorMixin


class ImagePromptProcessor(_processor_base()):
    """tokenizer + Qwen2VL image processor, called like Qwen2VLProcessor on text and images."""

    def __init__(self, image_processor, tokenizer, image_token: str = IMAGE_TOKEN):
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    @classmethod
    def from_pretrained(cls, processor_dir, tokenizer=None) -> "ImagePromptProcessor":
        """From a checkout's processor/ directory (preprocessor_config.json and the tokenizer
        files, as Qwen-Image-Edit ships it); `tokenizer` overrides the directory's one."""
        from transformers import AutoTokenizer

        path = Path(processor_dir)
        cfg_path = path / "preprocessor_config.json"
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the image processor config {cfg_path}: {e}; a Qwen-Image-Edit "
                             f"checkout has processor/preprocessor_config.json") from e
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(build_image_processor({k: raw[k] for k in _IMAGE_PROCESSOR_KEYS if k in raw}), tokenizer)

    def __call__(self, text, images=None, padding=True, return_tensors="pt", **kwargs):
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        data = {}
        if images is not None:
            images = images if isinstance(images, (list, tuple)) else [images]
            vision = self.image_processor(images=list(images), return_tensors=return_tensors)
            data.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
            texts = expand_image_tokens(texts, vision["image_grid_thw"].tolist(), self.image_processor.merge_size,
                                        self.image_token)
        elif any(self.image_token in t for t in texts):
            raise ValueError(f"the prompts hold {self.image_token} placeholders but no images were given")
        enc = self.tokenizer(texts, padding=padding, return_tensors=return_tensors, **kwargs)
        data.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
        return BatchFeature(data=data, tensor_type=return_tensors)


def build_image_processor(config: dict):
    """transformers' PIL-backed Qwen2VL image processor from a preprocessor config dict
    (min/max_pixels or size; patch, merge and temporal sizes; normalisation)."""
    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: the default processor is the PIL one
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    cfg = dict(config)
    size = cfg.pop("size", None) or {}
    cfg.setdefault("min_pixels", size.get("shortest_edge", size.get("min_pixels")))
    cfg.setdefault("max_pixels", size.get("longest_edge", size.get("max_pixels")))
    return ImageProcessor(**{k: v for k, v in cfg.items() if v is not None})
