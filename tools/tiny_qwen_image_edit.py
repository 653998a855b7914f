"""Build a tiny, random-weight Qwen-Image-Edit pipeline directory (the 2509 / 2511 "plus"
layout), entirely offline.

The directory has the layout of a real Qwen-Image-Edit-2509 / -2511 checkout (model_index.json
naming QwenImageEditPlusPipeline, transformer/, vae/, text_encoder/, tokenizer/, processor/,
scheduler/) and loads with `QwenImageEditPlusPipeline.from_pretrained(dir)`, so every consumer
reads it through the same code as the real model.

What makes it an edit model, and what the tiny one keeps of it:
- the Qwen2.5-VL text encoder sees the source image(s) through its vision tower: the prompt is
  "Picture 1: <|vision_start|><|image_pad|><|vision_end|>" + instruction, and the processor/
  (a Qwen2VLProcessor: Qwen2VLImageProcessor + the tokenizer) expands <|image_pad|> to one token
  per merged 2x2 group of 14-pixel patches;
- the source latents join the DiT's image sequence as condition tokens (img_shapes lists the
  target first, then each source); the 2511 variant's DiT sets zero_cond_t, which modulates the
  condition tokens with timestep 0.

The transformer, VAE, text encoder, tokenizer and scheduler are tools/make_tiny_model.py's tiny
Qwen-Image pieces (the edit models share Qwen-Image's shapes). The tiny image processor keeps the
real patch / merge / temporal sizes and normalisation but caps an image at 112 x 112 pixels
(16 vision tokens) so that tests stay fast; the real one allows 12845056 pixels and the
pipeline hands it a ~384 x 384 condition image.

    python tools/tiny_qwen_image_edit.py --output-dir tiny_edit [--variant 2509|2511] [--seed 0]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's tools/trainer, not installed ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: variant -> the transformer config keys it adds to Qwen-Image's. Qwen/Qwen-Image-Edit-2509's
#: transformer/config.json equals Qwen-Image's; Qwen/Qwen-Image-Edit-2511's adds "zero_cond_t": true.
EDIT_VARIANTS = {"2509": {}, "2511": {"zero_cond_t": True}}

#: Qwen/Qwen-Image-Edit-2509's processor/preprocessor_config.json (Qwen2VLImageProcessor; the
#: Qwen2.5-VL-7B-Instruct values: OpenAI-CLIP normalisation, 14-pixel patches merged 2 x 2)
REAL_EDIT_IMAGE_PROCESSOR_CONFIG = dict(
    min_pixels=3136,
    max_pixels=12845056,
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)

#: the tiny processor: the real patching and normalisation, at most 112 x 112 pixels per image
TINY_EDIT_IMAGE_PROCESSOR_CONFIG = dict(REAL_EDIT_IMAGE_PROCESSOR_CONFIG, max_pixels=112 * 112)

#: QwenImageEditPlusPipeline's module constants (diffusers 0.42): the source image is resized to
#: ~384 x 384 pixels (same aspect) for the text encoder and ~1024 x 1024 for the VAE.
EDIT_PLUS_CONDITION_IMAGE_AREA = 384 * 384
EDIT_PLUS_VAE_IMAGE_AREA = 1024 * 1024


def edit_transformer_config(base: dict, variant: str) -> dict:
    """A Qwen-Image transformer config turned into the `variant` edit model's ("2509" | "2511")."""
    if variant not in EDIT_VARIANTS:
        raise ValueError(f"--variant {variant!r} is not one of {sorted(EDIT_VARIANTS)}")
    return dict(base, **EDIT_VARIANTS[variant])


def write_processor_dir(path, tokenizer, image_processor_config: dict | None = None) -> Path:
    """Write a checkout's processor/ directory: the image processor config (also as the video
    processor config, as the real checkout has one) and the tokenizer files. Written by hand
    because transformers 5's Qwen2VLProcessor cannot be built without torchvision;
    Qwen2VLProcessor.from_pretrained (with torchvision) and
    trainer.models.qwen_vl_processor.ImagePromptProcessor.from_pretrained both read it."""
    from trainer.models.qwen_vl_processor import build_image_processor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_image_processor(image_processor_config or TINY_EDIT_IMAGE_PROCESSOR_CONFIG).save_pretrained(path)
    config = json.loads((path / "preprocessor_config.json").read_text())
    config.update(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    (path / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    video = {k: v for k, v in config.items() if k != "image_processor_type"}
    (path / "video_preprocessor_config.json").write_text(
        json.dumps(dict(video, video_processor_type="Qwen2VLVideoProcessor"), indent=2) + "\n")
    tokenizer.save_pretrained(path)
    return path


def edit_prompt_template_start_idx(pipe) -> int:
    """Tokens of the edit template's system turn, which encode_prompt drops (64 for the real
    tokenizer; longer for the tiny byte-level one). save_pretrained does not store it: set
    `pipe.prompt_template_encode_start_idx` to this after loading a tiny directory."""
    from trainer.models.qwen_image import prompt_template_start_idx

    return prompt_template_start_idx(pipe.tokenizer, pipe.prompt_template_encode)


def build_tiny_qwen_image_edit_pipeline(output_dir, seed: int = 0, vae_output_gain: float = 1.0,
                                        variant: str = "2511") -> Path:
    """Write a complete tiny QwenImageEditPlusPipeline to `output_dir` (created; an existing
    model_index.json there is overwritten) and return its path. Deterministic in `seed`; the
    weights equal tools/make_tiny_model.py's Qwen-Image ones of the same seed (an edit model is
    a fine-tune of it). vae_output_gain as in make_tiny_model."""
    from diffusers import QwenImageEditPlusPipeline

    from tools.make_tiny_model import TINY_TRANSFORMER_CONFIG, build_tiny_qwen_image_parts, save_tiny_pipeline

    config = edit_transformer_config(TINY_TRANSFORMER_CONFIG, variant)
    parts = build_tiny_qwen_image_parts(seed, vae_output_gain, transformer_config=config)
    pipe = QwenImageEditPlusPipeline(processor=None, **parts)
    out = save_tiny_pipeline(pipe, output_dir, {"family": "qwen_image_edit", "variant": variant, "seed": seed,
                                                "random_weights": True, "vae_output_gain": vae_output_gain})
    # the processor is written beside the pipeline (see write_processor_dir) and named in the index
    # as the real checkout names it
    write_processor_dir(out / "processor", parts["tokenizer"])
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def main(argv=None) -> int:
    from pathlib import Path

    from tools.make_tiny_model import add_output_flags, build_staged
    from trainer.cli import run_tool, tool_parser

    parser = tool_parser("tiny_qwen_image_edit", __doc__)
    add_output_flags(parser)
    parser.add_argument("--variant", default="2511", choices=sorted(EDIT_VARIANTS),
                        help="2509: Qwen-Image's DiT config; 2511: adds zero_cond_t (condition tokens "
                             "modulated at timestep 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--vae-output-gain", type=float, default=1.0,
                        help="scale of the VAE decoder's output convolution (1: plain random init)")
    args = parser.parse_args(argv)

    def build() -> int:
        path = build_staged(lambda d: build_tiny_qwen_image_edit_pipeline(d, seed=args.seed,
                                                                          vae_output_gain=args.vae_output_gain,
                                                                          variant=args.variant),
                            Path(args.output_dir), overwrite=args.overwrite)
        print(f"wrote tiny Qwen-Image-Edit-{args.variant} pipeline to {path}")
        return 0

    return run_tool("tiny_qwen_image_edit", build)


if __name__ == "__main__":
    raise SystemExit(main())
