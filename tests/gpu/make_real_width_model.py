"""Write a random-weight Qwen-Image pipeline at real width, and a PickScore-shaped CLIP-H, to disk.

    python tests/gpu/make_real_width_model.py --output /tmp/qi --pickscore-output /tmp/pickscore \
        --num-layers 30 --device cuda
    python tests/gpu/make_real_width_model.py --shape tiny --output /tmp/qi --pickscore-output /tmp/ps

The modules are tools/bench.py's builders (meta build, `to_empty` on the device, cheap random
values there), so a 20 B model is materialised in seconds on a GPU; they are then saved with
diffusers' / transformers' own `save_pretrained`, in the layout a real download has
(model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/), and the trainer
loads them through exactly the code that loads the real model. --num-layers keeps the DiT at full
width (3072 wide, 24 heads, joint attention 3584) with fewer blocks, for a disk that cannot hold
all 60 (40.9 GB in bf16). The text encoder is Qwen2.5-VL-7B's shape in full; the tokenizer is the
offline byte-level one of tools/make_tiny_model.py (its 270 ids index the real 152064-row table).

The CLIP is ViT-H/14 (image tower 1280 wide, 32 layers) with its 1024-wide, 24-layer text tower
and a 1024-d projection: PickScore_v1's architecture, saved with a byte-level CLIP tokenizer and
CLIP's 224x224 image processor, the layout trainer/rewards/pickscore.py loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

#: PickScore_v1 = CLIP ViT-H/14 (laion2B) fine-tuned: its config.json sizes
PICKSCORE_TEXT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      max_position_embeddings=77, vocab_size=49408)
PICKSCORE_VISION = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                        image_size=224, patch_size=14)
PICKSCORE_PROJECTION = 1024
TINY_CLIP_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      max_position_embeddings=77, vocab_size=None)
TINY_CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        image_size=32, patch_size=8)


def clip_byte_vocab() -> dict[str, int]:
    """A byte-level CLIP BPE vocabulary without merges: every byte, as itself and word-final."""
    from tools.make_tiny_model import byte_level_symbols

    symbols = byte_level_symbols()
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def write_pickscore(out: Path, shape: str, device: torch.device, dtype: torch.dtype, seed: int = 3) -> Path:
    """A random CLIP of PickScore's architecture (shape "real") or a 2-layer one ("tiny")."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: the PIL processor is the default one
        from transformers import CLIPImageProcessor as ImageProcessor

    from tools.bench import materialise

    vocab = clip_byte_vocab()
    text, vision = (PICKSCORE_TEXT, PICKSCORE_VISION) if shape == "real" else (TINY_CLIP_TEXT, TINY_CLIP_VISION)
    text = dict(text, vocab_size=text["vocab_size"] or len(vocab), bos_token_id=vocab["<|startoftext|>"],
                eos_token_id=vocab["<|endoftext|>"], pad_token_id=vocab["<|endoftext|>"])
    config = CLIPConfig(text_config=text, vision_config=dict(vision),
                        projection_dim=PICKSCORE_PROJECTION if shape == "real" else 16)
    model = materialise(lambda: CLIPModel(config), device, dtype, seed, f"{shape} CLIP")
    with torch.no_grad():  # CLIP's learned temperature: PickScore_v1's logit_scale.exp() is 100
        model.logit_scale.fill_(float(torch.tensor(100.0).log()))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    size = vision["image_size"]
    CLIPProcessor(image_processor=ImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
                  tokenizer=CLIPTokenizer(vocab=vocab, merges=[])).save_pretrained(out)
    return out


def write_pipeline(out: Path, shape: str, num_layers: int | None, device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> dict:
    """The Qwen-Image pipeline directory; returns what was written (parameter counts, sizes)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from tools import bench
    from tools.make_tiny_model import QWEN_IMAGE_SCHEDULER_CONFIG, build_tokenizer

    cfg = bench.shape_configs(shape)[0]
    if num_layers:
        cfg["num_layers"] = int(num_layers)
    tokenizer = build_tokenizer()
    transformer = bench.materialise(lambda: QwenImageTransformer2DModel(**cfg), device, dtype, seed,
                                    f"{shape} transformer")
    vae = bench.build_vae(shape, device, dtype, seed + 1)
    text_encoder = bench.build_text_encoder(shape, tokenizer, device, dtype, seed + 2)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    info = {"shape": shape, "random_weights": True, "num_layers": cfg["num_layers"], "seed": seed,
            "dtype": str(dtype).removeprefix("torch."),
            "params": {n: sum(p.numel() for p in m.parameters())
                       for n, m in (("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder))}}
    (out / "RANDOM_WEIGHTS.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def dir_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True, help="pipeline directory (created)")
    p.add_argument("--pickscore-output", type=Path, default=None, help="PickScore-shaped CLIP directory (created)")
    p.add_argument("--shape", choices=("real", "tiny"), default="real")
    p.add_argument("--num-layers", type=int, default=None, help="DiT blocks (default: the shape's own, 60 real)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    t0 = time.perf_counter()
    info = write_pipeline(args.output, args.shape, args.num_layers, device, dtype)
    info["pipeline_gb"], info["pipeline_s"] = round(dir_gb(args.output), 2), round(time.perf_counter() - t0, 1)
    if args.pickscore_output:
        t1 = time.perf_counter()
        write_pickscore(args.pickscore_output, args.shape, device, dtype)
        info["pickscore_gb"] = round(dir_gb(args.pickscore_output), 2)
        info["pickscore_s"] = round(time.perf_counter() - t1, 1)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
