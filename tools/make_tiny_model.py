"""Build a tiny, random-weight pipeline directory of a model family, entirely offline.

The directory has the same layout as a real checkout of the family (Qwen-Image:
model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/; sd3: see
tools/tiny_sd3.py) so that every consumer loads it through the same code path as the real
model. It is what the tests and the demo run on.

    python tools/make_tiny_model.py --output-dir tiny [--family qwen_image|sd3|flux|wan] [--seed 0] [--overwrite]

A non-empty --output-dir is refused unless --overwrite (then its contents are replaced once the
new model is complete); the build goes to a hidden directory beside it first.

The Qwen-Image builder is this file's; each other family's lives in tools/tiny_<family>.py
(the image-editing ones in tools/tiny_qwen_image_edit.py and tools/tiny_flux_kontext.py).

Sizes follow diffusers' own Qwen-Image unit tests: a 2-block DiT (3 heads x 16), a
4-channel VAE with spatial factor 4, and a 2-layer Qwen2.5-VL text encoder of width 16.
The tokenizer is a real byte-level BPE (transformers' Qwen2Tokenizer) with the 256 byte
symbols, no merges and Qwen's special tokens, so prompts tokenize to one token per byte.
The scheduler config carries the real Qwen-Image values (dynamic exponential shift).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import tool_parser  # noqa: E402

#: the real Qwen-Image scheduler/scheduler_config.json values (FlowMatchEulerDiscreteScheduler
#: with resolution-dependent exponential shift and a 0.02 terminal stretch)
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

#: Qwen2 / Qwen2.5-VL special tokens, in the order the real tokenizer numbers them
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

TINY_TRANSFORMER_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=3,
    joint_attention_dim=16,
    guidance_embeds=False,
    axes_dims_rope=(8, 4, 4),
)

TINY_VAE_CONFIG = dict(
    base_dim=24,
    z_dim=4,
    dim_mult=[1, 2, 4],
    num_res_blocks=1,
    temperal_downsample=[False, True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
)


def byte_level_symbols() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for the bytes 0..255 (GPT-2 scheme:
    printable Latin-1 bytes map to themselves, the rest to code points 256+)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols = {}
    extra = 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_tokenizer():
    """A byte-level Qwen2 BPE tokenizer with no merges (one token per byte) plus the
    Qwen special tokens; ids 0..255 are bytes, specials follow."""
    from transformers import Qwen2Tokenizer

    vocab = {sym: i for i, sym in enumerate(byte_level_symbols())}
    for tok in QWEN_SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    tokenizer.model_max_length = 32768
    return tokenizer


def build_text_encoder(tokenizer):
    """A 2-layer Qwen2.5-VL of width 16 (head_dim 8, mrope_section [1,1,2]) with a 2-block
    vision tower; special-token ids are the tokenizer's own so nothing warns on load."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    vocab_size = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=16,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def scale_vae_output(vae, vae_output_gain: float) -> None:
    """Scale the decoder's last convolution by `vae_output_gain` and zero its bias (a no-op at
    1). At random init a tiny decoder maps every latent to nearly the same grey (one latent std
    moves the mean colour by ~0.02), so no policy can reach a colour in minutes; a gain of ~8
    spreads the decodable colours over the RGB cube while the weights stay random. It draws no
    random numbers, so the weights after it do not depend on the gain."""
    import torch

    if vae_output_gain != 1.0:
        with torch.no_grad():
            vae.decoder.conv_out.weight.mul_(float(vae_output_gain))
            vae.decoder.conv_out.bias.zero_()


def save_tiny_pipeline(pipe, output_dir, marker: dict) -> Path:
    """Save `pipe` to `output_dir` (created; files there are overwritten) with safetensors
    weights, plus TINY_RANDOM_MODEL.json holding `marker`: a note for humans and tools that the
    directory holds random weights. Returns the directory."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "TINY_RANDOM_MODEL.json").write_text(json.dumps(marker, indent=2) + "\n")
    return out


def build_tiny_qwen_image_parts(seed: int = 0, vae_output_gain: float = 1.0,
                                transformer_config: dict = TINY_TRANSFORMER_CONFIG) -> dict:
    """The tiny Qwen-Image components (transformer, vae, tokenizer, text_encoder, scheduler) as
    pipeline keyword arguments, each model drawn after its own seed (seed, seed + 1, seed + 2) so
    the edit models, which pass their own transformer_config, get the same weights."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**transformer_config)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(**TINY_VAE_CONFIG)
    scale_vae_output(vae, vae_output_gain)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed + 2)
    text_encoder = build_text_encoder(tokenizer)
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae,
                text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def build_tiny_pipeline(output_dir, seed: int = 0, vae_output_gain: float = 1.0) -> Path:
    """Write a complete tiny Qwen-Image pipeline to `output_dir` (created; an existing
    model_index.json there is overwritten) and return its path. Deterministic in `seed`.
    vae_output_gain: see scale_vae_output; the demo uses 8."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(**build_tiny_qwen_image_parts(seed, vae_output_gain))
    return save_tiny_pipeline(pipe, output_dir, {"seed": seed, "random_weights": True,
                                                 "vae_output_gain": vae_output_gain})


#: family -> (module, builder function, what it writes); each builder takes (output_dir, seed,
#: vae_output_gain) and returns the directory
BUILDERS = {
    "qwen_image": ("tools.make_tiny_model", "build_tiny_pipeline", "Qwen-Image"),
    "sd3": ("tools.tiny_sd3", "build_tiny_sd3_pipeline", "Stable Diffusion 3.5"),
    "flux": ("tools.tiny_flux", "build_tiny_flux_pipeline", "FLUX.1"),
    # image-editing families (docs/editing.md); tools/tiny_qwen_image_edit.py --variant picks 2509
    "qwen_image_edit": ("tools.tiny_qwen_image_edit", "build_tiny_qwen_image_edit_pipeline", "Qwen-Image-Edit-2511"),
    "flux_kontext": ("tools.tiny_flux_kontext", "build_tiny_flux_kontext_pipeline", "FLUX.1-Kontext"),
    # text-to-video (docs/video.md)
    "wan": ("tools.tiny_wan", "build_tiny_wan_pipeline", "Wan2.1 text-to-video"),
}


def build_family(family: str, output_dir, seed: int = 0, vae_output_gain: float = 1.0) -> Path:
    """The tiny pipeline of `family` (a BUILDERS key) written to `output_dir`."""
    import importlib

    if family not in BUILDERS:
        raise ValueError(f"--family {family!r} is not one of {sorted(BUILDERS)}")
    module, fn, _ = BUILDERS[family]
    return getattr(importlib.import_module(module), fn)(output_dir, seed=seed, vae_output_gain=vae_output_gain)


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse an --output-dir that is a file or a link, or a non-empty directory unless
    --overwrite: pointed at a real model directory, a build would replace its weights."""
    from trainer.cli import ToolError

    if path.is_symlink():
        raise ToolError(f"--output-dir {path} is a symbolic link; pass a real directory path")
    if path.exists() and not path.is_dir():
        raise ToolError(f"--output-dir {path} is a file, not a directory; choose another path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ToolError(f"--output-dir {path} is not empty; nothing was written. Choose a new directory, or pass "
                        "--overwrite to replace its contents with the tiny random-weight model")


def build_staged(build: Callable[[Path], object], out: Path, *, overwrite: bool) -> Path:
    """build(directory) in a fresh directory beside `out`, then put it in place: an interrupted
    build never leaves a half-written --output-dir, a non-empty one is refused unless
    --overwrite, and with --overwrite the old contents go only once the new model is complete.
    Every tiny-model command writes through here."""
    from trainer.core.files import staged_dir

    check_output_dir(out, overwrite)
    with staged_dir(out) as staging:
        build(staging)
        check_output_dir(out, overwrite)  # nothing appeared there meanwhile
    return out


def build_into(family: str, out: Path, *, seed: int, vae_output_gain: float, overwrite: bool) -> Path:
    """The tiny pipeline of `family` staged into `out` (build_staged)."""
    return build_staged(lambda d: build_family(family, d, seed=seed, vae_output_gain=vae_output_gain), out,
                        overwrite=overwrite)


def add_output_flags(parser) -> None:
    """--output-dir and --overwrite, as every tiny-model command takes them."""
    parser.add_argument("--output-dir", "--output", dest="output_dir", required=True,
                        help="directory to write the pipeline to (created; must not exist or be empty, unless "
                             "--overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the contents of a non-empty --output-dir instead of refusing")


def main(argv=None) -> int:
    from trainer.cli import run_tool

    parser = tool_parser("make_tiny_model", __doc__)
    add_output_flags(parser)
    parser.add_argument("--family", default="qwen_image", choices=sorted(BUILDERS),
                        help="model family of the pipeline (qwen_image: QwenImagePipeline; sd3: "
                             "StableDiffusion3Pipeline with an SD3.5-Medium style dual-attention DiT; flux: "
                             "FluxPipeline with FLUX.1-dev's layout; image editing: qwen_image_edit "
                             "(QwenImageEditPlusPipeline, 2511 layout), flux_kontext (FluxKontextPipeline); "
                             "text-to-video: "
                             "wan (WanPipeline, Wan2.1 T2V))")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--vae-output-gain", type=float, default=1.0,
                        help="scale of the VAE decoder's output convolution (1: plain random init); "
                             "the demo uses 8 so that image colours depend visibly on the latents")
    args = parser.parse_args(argv)

    def build() -> int:
        path = build_into(args.family, Path(args.output_dir), seed=args.seed, vae_output_gain=args.vae_output_gain,
                          overwrite=args.overwrite)
        print(f"wrote tiny {BUILDERS[args.family][2]} pipeline to {path}")
        return 0

    return run_tool("make_tiny_model", build)


if __name__ == "__main__":
    raise SystemExit(main())
