"""HPSv2.1 (Human Preference Score v2.1): an OpenCLIP ViT-H/14 fine-tuned on human preferences.

    hpsv21 = cos(text_embed(prompt), image_embed(image))

(the hpsv2 package's score, without CLIP's temperature; ~0.25-0.35 for typical images).

The `hpsv2` package downloads its checkpoint from the Hugging Face Hub at scoring time and builds
the model with a vendored copy of open_clip (torchvision, timm), so this scorer does not use it.
The architecture is plain CLIP: the OpenCLIP state dict is renamed onto a transformers CLIPModel
(`openclip_to_transformers`, q/k/v split out of the fused in-projection, projections
transposed) whose dimensions are read from the checkpoint itself; head counts follow OpenCLIP's
ViT-H-14 (head width 80 in the vision tower, 64 in the text tower).

--reward-model-path is a local directory holding
  - `HPS_v2.1_compressed.pt` (xswu/HPSv2 on the Hub: {"state_dict": OpenCLIP names}) and
  - the tokenizer files of the CLIP it was trained from (laion/CLIP-ViT-H-14-laion2B-s32B-b79K,
    the same files PickScore uses; only the tokenizer is read).
Preprocessing is HPSv2's evaluation transform, done here on the [0, 1] tensors: bicubic
(antialiased) resize of the longer side to 224, centred zero (black) padding to a square, then
CLIP's mean/std. Runs in fp32.
"""

from __future__ import annotations

import math
import os

import torch

from trainer.rewards.base import ImageBatch
from trainer.rewards.clip import TOKENIZER_FILES, ClipEmbedder, processor_dir, require_files

CHECKPOINT_FILE = "HPS_v2.1_compressed.pt"
#: per-head widths of OpenCLIP's ViT-H-14 (not recoverable from tensor shapes)
VISION_HEAD_WIDTH, TEXT_HEAD_WIDTH = 80, 64
#: CLIP's (OpenAI's) image normalisation
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_SCORER = "trainer.rewards.hpsv2.Hpsv21Scorer"

_BLOCK = {  # OpenCLIP residual block -> transformers CLIPEncoderLayer
    "ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
}
_TOP = {
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight", "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight", "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}


def openclip_to_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an OpenCLIP CLIP state dict onto transformers' CLIPModel names.

    OpenCLIP keeps q, k, v as one in_proj [3w, w] (rows q, then k, then v) and applies its
    projections as x @ proj [w, d]; transformers has separate q/k/v Linears and Linear(w, d)
    whose weight is proj.T. Unknown keys raise (a checkpoint of another architecture)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key in _TOP:
            out[_TOP[key]] = t
        elif key == "visual.proj":
            out["visual_projection.weight"] = t.t().contiguous()
        elif key == "text_projection":
            out["text_projection.weight"] = t.t().contiguous()
        elif key.endswith("attn_mask"):
            continue  # a causal-mask buffer some OpenCLIP versions save; transformers builds its own
        elif ".resblocks." in key:
            tower, rest = key.split(".resblocks.", 1)
            prefix = {"visual.transformer": "vision_model", "transformer": "text_model"}.get(tower)
            index, name = rest.split(".", 1)
            if prefix is None:
                raise KeyError(f"unexpected OpenCLIP key {key!r}")
            base = f"{prefix}.encoder.layers.{index}."
            if name.startswith("attn.in_proj_"):
                kind = name.rsplit("_", 1)[1]  # weight / bias
                for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                    out[f"{base}self_attn.{part}_proj.{kind}"] = chunk.contiguous()
            else:
                module, kind = name.rsplit(".", 1)
                if module not in _BLOCK:
                    raise KeyError(f"unexpected OpenCLIP key {key!r}")
                out[f"{base}{_BLOCK[module]}.{kind}"] = t
        else:
            raise KeyError(f"unexpected OpenCLIP key {key!r}")
    return out


def clip_config_from_openclip(state: dict[str, torch.Tensor], tokenizer):
    """A CLIPConfig with the checkpoint's dimensions (module docstring for the head counts)."""
    from transformers import CLIPConfig

    def layers(prefix: str) -> int:
        return 1 + max(int(k[len(prefix):].split(".", 1)[0]) for k in state if k.startswith(prefix))

    v_width = int(state["visual.conv1.weight"].shape[0])
    patch = int(state["visual.conv1.weight"].shape[-1])
    grid = int(math.isqrt(int(state["visual.positional_embedding"].shape[0]) - 1))
    t_width = int(state["token_embedding.weight"].shape[1])
    return CLIPConfig(
        text_config=dict(
            vocab_size=int(state["token_embedding.weight"].shape[0]), hidden_size=t_width,
            intermediate_size=int(state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
            num_hidden_layers=layers("transformer.resblocks."), num_attention_heads=t_width // TEXT_HEAD_WIDTH,
            max_position_embeddings=int(state["positional_embedding"].shape[0]), hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=v_width, intermediate_size=int(state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
            num_hidden_layers=layers("visual.transformer.resblocks."), num_attention_heads=v_width // VISION_HEAD_WIDTH,
            image_size=grid * patch, patch_size=patch, hidden_act="gelu",
        ),
        projection_dim=int(state["visual.proj"].shape[1]),
    )


def hps_pixels(images: ImageBatch, size: int) -> torch.Tensor:
    """HPSv2's evaluation transform on [0, 1] tensors -> fp32 [B, 3, size, size] (module docstring)."""
    out = []
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    for x in images.float_tensors:
        h, w = x.shape[1:]
        scale = size / max(h, w)
        nh, nw = round(h * scale), round(w * scale)
        if scale != 1.0:
            x = torch.nn.functional.interpolate(x[None], size=(nh, nw), mode="bicubic", antialias=True,
                                                align_corners=False)[0]
        # HPSv2 pads only after a resize; a non-square image already `size` long would not batch
        ph, pw = size - nh, size - nw
        x = torch.nn.functional.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=0.0)
        out.append((x - mean) / std)
    return torch.stack(out)


class Hpsv21Scorer:
    """Component "hpsv21" (module docstring). Needs --reward-model-path."""

    components = ("hpsv21",)
    required_tracks = ("image",)

    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        what = f"{CHECKPOINT_FILE} and the tokenizer of laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
        require_files(model_path, _SCORER, [CHECKPOINT_FILE], what=what)
        require_files(processor_dir(model_path), _SCORER, [TOKENIZER_FILES], what=what)
        from transformers import AutoTokenizer, CLIPModel

        path = os.path.join(model_path, CHECKPOINT_FILE)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        state = ckpt.get("state_dict", ckpt)
        if "visual.conv1.weight" not in state:
            raise ValueError(f"--reward-model-path: {path} holds no OpenCLIP ViT state dict (no visual.conv1.weight)")
        tokenizer = AutoTokenizer.from_pretrained(processor_dir(model_path), local_files_only=True)
        model = CLIPModel(clip_config_from_openclip(state, tokenizer))
        missing, unexpected = model.load_state_dict(openclip_to_transformers(state), strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"--reward-model-path: {path} does not fit a CLIP: missing {missing[:5]}, "
                             f"unexpected {list(unexpected)[:5]}")
        self._setup(model, tokenizer, device, torch.float32)

    @classmethod
    def from_modules(cls, model, tokenizer, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """A scorer over an in-memory CLIPModel (benchmarks at random weights)."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, device, dtype)
        return self

    def _setup(self, model, tokenizer, device, dtype) -> None:
        # no image processor: the pixels come from hps_pixels (HPSv2's own transform)
        self.clip = ClipEmbedder(model, tokenizer, None, device, dtype)
        self.image_size = int(model.config.vision_config.image_size)

    @torch.no_grad()
    def score(self, images: ImageBatch, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        px = hps_pixels(images, self.image_size).to(self.clip.device, self.clip.dtype)
        return {"hpsv21": self.clip.cosine(images, prompts, pixel_values=px).cpu()}

    __call__ = score
