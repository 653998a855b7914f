"""PickScore: CLIP text-image alignment with the PickScore_v1 weights (a fine-tuned CLIP-H).

    pickscore = logit_scale.exp() * cos(text_embed(prompt), image_embed(image)) / 26

logit_scale.exp() is CLIP's learned temperature (100 for PickScore_v1), so the raw value is the
logit PickScore ranks with; dividing by 26 puts it in the range the reference's evaluation
figures are quoted in (0.81-0.86 for Qwen-Image). Group normalisation makes the constant
irrelevant to training; it only matters for comparing logged numbers.

--reward-model-path is a local directory holding the CLIPModel (config.json + weights) and its
processor (tokenizer files + preprocessor config) side by side, or the processor in a
`processor/` subdirectory. Nothing is downloaded. The model runs in fp32: intra-group reward
differences are ~1e-2 of the score, which bf16's 3 significant digits would blur.
"""

from __future__ import annotations

import os

import torch

from trainer.rewards.base import ImageBatch

#: divisor that maps logit_scale * cos onto the reference's reported scale
PICKSCORE_DIVISOR = 26.0


def _load_processor(model_path: str):
    from transformers import AutoProcessor

    errors = []
    for path in (model_path, os.path.join(model_path, "processor")):
        if not os.path.isdir(path):
            continue
        try:
            return AutoProcessor.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as e:
            errors.append(f"{path}: {type(e).__name__}: {e}")
    raise FileNotFoundError(
        f"--reward-model-path={model_path}: no CLIP processor (tokenizer + preprocessor config) found there "
        f"or in its processor/ subdirectory; copy the processor files of the CLIP the scorer was trained "
        f"from (laion/CLIP-ViT-H-14-laion2B-s32B-b79K for PickScore_v1) next to the model. Tried: {errors}"
    )


class PickScoreScorer:
    """Component "pickscore" (module docstring). Needs --reward-model-path."""

    components = ("pickscore",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        if not model_path:
            raise ValueError(
                "trainer.rewards.pickscore.PickScoreScorer needs --reward-model-path "
                "(a local PickScore_v1 directory)"
            )
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"--reward-model-path={model_path} is not a directory")
        from transformers import CLIPModel

        self.device = torch.device(device)
        self.processor = _load_processor(model_path)
        self.model = CLIPModel.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
        self.model.eval().requires_grad_(False).to(self.device)
        tok = self.processor.tokenizer
        self._max_len = min(int(tok.model_max_length), int(self.model.config.text_config.max_position_embeddings))

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        # A group's candidates share one prompt: encode each distinct prompt once.
        unique = list(dict.fromkeys(prompts))
        column = torch.tensor([unique.index(p) for p in prompts])
        text = self.processor.tokenizer(
            unique, padding=True, truncation=True, max_length=self._max_len, return_tensors="pt"
        )
        pixels = self.processor.image_processor(images=images.pil, return_tensors="pt")["pixel_values"]
        out = self.model(
            input_ids=text["input_ids"].to(self.device),
            attention_mask=text["attention_mask"].to(self.device),
            pixel_values=pixels.to(self.device, torch.float32),
        )
        img = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)
        txt = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
        cos = (img * txt[column.to(img.device)]).sum(dim=-1)
        score = self.model.logit_scale.float().exp() * cos / PICKSCORE_DIVISOR
        return {"pickscore": score.cpu()}

    __call__ = score
