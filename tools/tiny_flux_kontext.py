"""Build a tiny, random-weight FLUX.1-Kontext pipeline directory, entirely offline.

The directory has the layout of a real black-forest-labs/FLUX.1-Kontext-dev checkout
(model_index.json naming FluxKontextPipeline, transformer/, vae/, text_encoder/ (CLIP-L),
text_encoder_2/ (T5), tokenizer/, tokenizer_2/, scheduler/) and loads with
`FluxKontextPipeline.from_pretrained(dir)`.

Kontext is FLUX.1-dev's architecture: the source image is VAE-encoded, packed like the target
latents and concatenated to the image tokens (with position ids whose first axis is 1), and the
DiT's output over the source tokens is dropped. So every piece is tools/tiny_flux.py's tiny
FLUX.1 (same configs, same seeds); only the pipeline class differs.

    python tools/tiny_flux_kontext.py --output-dir tiny_kontext [--seed 0]
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's tools/trainer, not installed ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: black-forest-labs/FLUX.1-Kontext-dev's transformer/config.json equals FLUX.1-dev's
#: (tools/bench_flux.py REAL_FLUX_TRANSFORMER_CONFIG: 19 + 38 blocks, width 3072, guidance
#: embedding); its vae/, text encoders and scheduler/scheduler_config.json are FLUX.1-dev's too
#: (tools/tiny_flux.py FLUX_DEV_SCHEDULER_CONFIG).
KONTEXT_SAME_AS_FLUX_DEV = ("transformer", "vae", "text_encoder", "text_encoder_2", "scheduler")

#: FluxKontextPipeline's defaults (diffusers 0.42): the output area max_area = 1024 ** 2, and with
#: _auto_resize the source is resized to the nearest of Kontext's preferred resolutions (about one
#: megapixel, multiples of 16); guidance_scale 3.5 goes into the guidance embedding.
KONTEXT_MAX_AREA = 1024 ** 2
KONTEXT_GUIDANCE_SCALE = 3.5


def build_tiny_flux_kontext_pipeline(output_dir, seed: int = 0, vae_output_gain: float = 1.0) -> Path:
    """Write a complete tiny FluxKontextPipeline to `output_dir` (created; an existing
    model_index.json there is overwritten) and return its path. Deterministic in `seed`; the
    weights equal tools/tiny_flux.py's FLUX.1 ones of the same seed."""
    from diffusers import FluxKontextPipeline

    from tools.make_tiny_model import save_tiny_pipeline
    from tools.tiny_flux import build_tiny_flux_parts

    pipe = FluxKontextPipeline(**build_tiny_flux_parts(seed, vae_output_gain))
    return save_tiny_pipeline(pipe, output_dir, {"family": "flux_kontext", "seed": seed, "random_weights": True,
                                                 "vae_output_gain": vae_output_gain})


def main(argv=None) -> int:
    from pathlib import Path

    from tools.make_tiny_model import add_output_flags, build_staged
    from trainer.cli import run_tool, tool_parser

    parser = tool_parser("tiny_flux_kontext", __doc__)
    add_output_flags(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--vae-output-gain", type=float, default=1.0,
                        help="scale of the VAE decoder's output convolution (1: plain random init)")
    args = parser.parse_args(argv)

    def build() -> int:
        path = build_staged(lambda d: build_tiny_flux_kontext_pipeline(d, seed=args.seed,
                                                                       vae_output_gain=args.vae_output_gain),
                            Path(args.output_dir), overwrite=args.overwrite)
        print(f"wrote tiny FLUX.1-Kontext pipeline to {path}")
        return 0

    return run_tool("tiny_flux_kontext", build)


if __name__ == "__main__":
    raise SystemExit(main())
