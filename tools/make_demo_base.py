"""Train the demo's base model: a tiny Qwen-Image pipeline that draws the shape its prompt names.

    python tools/make_demo_base.py --output runs/demo/demo-base [--seed 0]

The demo needs a base model that already draws something, so that a person can see what RL
post-training changes. This tool makes one offline, in ~4.5 minutes on one CPU core of a 2-core
machine that other jobs load (load average ~4):

1. a synthetic image set: one shape (circle, square, triangle) of one of six saturated colours on
   a black background, at a jittered position and size, captioned "a coloured <shape>". The
   caption names the shape and never the colour, so the base learns to draw the shape the prompt
   names in any of the six colours, and has no idea what "red" means: asked for "a red circle" it
   draws a circle of a random colour. Making it paint the colour its prompts name
   (DEMO_TARGET_COLORS: red or green) is the RL task (trainer/rewards/color.py, ShapeColorScorer).
   Why "coloured" and not a random colour word: a DiT trained on captions whose colour word is
   noise learns to ignore that word (it gave the colour token a third of the attention of the
   others), and RL then has to undo that before it can teach anything; a fixed word holds the
   place in the sequence without teaching the model to look away from it.
2. the VAE (AutoencoderKLQwenImage, a narrower version of tools/make_tiny_model.py's) trained for
   reconstruction (MSE + a chroma term + a small L2 on the latents); its latents_mean /
   latents_std are then set to the data's per-channel statistics, so the DiT sees unit-variance
   latents as in the real model;
3. the DiT (QwenImageTransformer2DModel) trained with the flow-matching objective on the encoded
   set: x_s = (1 - s) x_0 + s e, target velocity e - x_0, s drawn through the same
   resolution-dependent shift the sampler uses, conditioned on the captions through the frozen
   random text encoder and exactly the engine's prompt encoding and DiT call.

The text side is tools/make_tiny_model.py's, with two changes that make a word reach the DiT as
that word (build_demo_tokenizer, build_demo_text_encoder): the tokenizer makes each demo word one
token, as a real vocabulary does, and the text encoder's attention outputs are zero, so each
token's embedding is its own word's rather than a random mix of the words before it. Without
the second, the colour word leaks into the embeddings of the shape word and the template tokens
after it, and RL learned colours per colour-shape pair that did not carry over to pairs it had
not trained on.

The result is a complete diffusers directory (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, scheduler/) that loads through the same code as the real model, plus
DEMO_BASE.json recording the settings and the final losses. A second call with the same settings
finds DEMO_BASE.json and returns at once (the cache); other settings, or a directory without it,
are refused rather than overwritten unless --rebuild is given. The directory is written under a
temporary name and renamed when complete, so an interrupted build is never taken for a cached one.
Deterministic in --seed for a given torch build and thread count (the tool sets one thread
unless --threads says otherwise).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.core.files import staged_dir  # noqa: E402
from trainer.rewards.color import HUES, SHAPES, color_palette, draw_shape  # noqa: E402

log = logging.getLogger("make_demo_base")

#: the colours the demo paints and asks for, and the shapes it draws (the scorer's own lists)
DEMO_COLORS = HUES
DEMO_SHAPES = SHAPES
#: the colours the RL prompts name (demo_prompts): two words to learn. All six (lr 3e-2, batch-std
#: advantages) and red with blue (lr 3e-2) ended with every prompt's shape painted red; red with
#: green at the recipe's 1e-2 learned both words (README, "The demo")
DEMO_TARGET_COLORS = ("red", "green")
#: the word every training caption has where a prompt names the colour (module docstring)
CAPTION_COLOR_WORD = "coloured"
MARKER = "DEMO_BASE.json"
#: the words build_demo_tokenizer makes single tokens: the prompts' colour and shape words and
#: the captions' placeholder (with the space before them), and the template's "assistant" turn
#: that follows every prompt
DEMO_WORDS = tuple(f" {w}" for w in DEMO_COLORS + DEMO_SHAPES + (CAPTION_COLOR_WORD,)) + ("assistant",)

#: narrower than tools/make_tiny_model.py's VAE (base_dim 24): training that one costs ~3 s a
#: step on 2 CPU cores, this one ~0.25 s, and flat-coloured shapes need no more
DEMO_VAE_OVERRIDES = dict(base_dim=8)
#: a DiT wide enough to draw three shapes at 32x32 (4 heads x 16 = 64 channels, 3 blocks),
#: still ~0.5M parameters so the 2-process FSDP update stays quick
DEMO_TRANSFORMER_OVERRIDES = dict(num_layers=3, num_attention_heads=4)


@dataclass(frozen=True)
class BaseSettings:
    """What the cache is keyed on: a cached base is reused only when all of these match."""
    seed: int = 0
    image_size: int = 32
    num_images: int = 1536
    #: the chroma plateau (every shape reconstructed grey) breaks between 300 and 500 steps
    #: here: 300 left red pink and yellow orange (hue share of the reconstructions 0.64), 500 did
    #: not (0.93)
    vae_warmup_steps: int = 500
    vae_warmup_lr: float = 3e-3
    vae_steps: int = 80
    vae_batch: int = 16
    vae_lr: float = 1e-3
    dit_steps: int = 800
    dit_batch: int = 64
    dit_lr: float = 2e-3
    version: int = 3  # bump when the recipe above changes meaning


# ----------------------------------------------------------------------------- the image set


def synthetic_set(num_images: int, size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """(images [N, 3, size, size] in [0, 1], captions "a coloured <shape>"): shapes and painted
    colours cycle evenly, position and size are drawn from a generator seeded by `seed`."""
    palette = color_palette()
    g = torch.Generator().manual_seed(seed)
    images, captions = [], []
    for i in range(num_images):
        shape = DEMO_SHAPES[i % len(DEMO_SHAPES)]
        painted = DEMO_COLORS[(i // len(DEMO_SHAPES)) % len(DEMO_COLORS)]
        u = torch.rand(3, generator=g).tolist()
        radius = size * (0.28 + 0.1 * u[0])
        cx, cy = size * (0.5 + 0.12 * (u[1] - 0.5)), size * (0.5 + 0.12 * (u[2] - 0.5))
        images.append(draw_shape(shape, palette[painted], size, cx, cy, radius))
        captions.append(f"a {CAPTION_COLOR_WORD} {shape}")
    return torch.stack(images), captions


def demo_prompts(colors: tuple[str, ...] = DEMO_TARGET_COLORS) -> tuple[list[str], list[str]]:
    """(train, eval) prompts "a <colour> <shape>" for the RL run, for each of `colors`: colour i
    is held out on shape i mod 3 and trained on the other two, so eval asks for pairs the policy
    was never trained on. With the demo's red and green: train "a red square", "a red triangle",
    "a green circle", "a green triangle"; eval "a red circle", "a green square"."""
    train, held_out = [], []
    for i, color in enumerate(colors):
        for j, shape in enumerate(DEMO_SHAPES):
            (held_out if j == i % len(DEMO_SHAPES) else train).append(f"a {color} {shape}")
    return train, held_out


# ----------------------------------------------------------------------------- the tokenizer


def _bpe(symbols: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-level BPE of one pre-tokenized word: merge the lowest-ranked adjacent pair until none
    is in `ranks` (the algorithm the tokenizers library runs)."""
    parts = list(symbols)
    while len(parts) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(zip(parts, parts[1:])) if pair in ranks]
        if not ranked:
            break
        _, i = min(ranked)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def build_demo_tokenizer(words: tuple[str, ...] = DEMO_WORDS):
    """tools/make_tiny_model.py's byte-level Qwen2 BPE tokenizer plus merges that make each of
    `words` one token, as a real vocabulary does for common words: "a red circle" becomes
    [a, Ġred, Ġcircle] rather than twelve bytes. A colour word is then one embedding, not three
    to five bytes mixed by the random text encoder, and the prompt is 8 text tokens after the
    template's prefix, not 25. Every other string still tokenizes byte by byte.

    Each word's merges are appended after all earlier ones (lowest priority), so a word made one
    token stays one token when later words add theirs."""
    from transformers import Qwen2Tokenizer

    from tools.make_tiny_model import QWEN_SPECIAL_TOKENS, byte_level_symbols

    symbols = byte_level_symbols()
    vocab = {sym: i for i, sym in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    for word in words:
        form = "".join(symbols[b] for b in word.encode())
        while len(parts := _bpe(form, {m: i for i, m in enumerate(merges)})) > 1:
            merges.append((parts[0], parts[1]))
            vocab.setdefault(parts[0] + parts[1], len(vocab))
    for tok in QWEN_SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token="<|endoftext|>", eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>", additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]))
    tokenizer.model_max_length = 32768
    return tokenizer


def build_demo_text_encoder(tokenizer):
    """tools/make_tiny_model.py's 2-layer Qwen2.5-VL text encoder with every attention output
    projection zero: each layer then adds to a token only what its MLP makes of that token, so
    the embedding of "circle" is the same after "red" as after "blue" (module docstring)."""
    from tools.make_tiny_model import build_text_encoder

    encoder = build_text_encoder(tokenizer)
    with torch.no_grad():
        for layer in encoder.model.language_model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return encoder


# ----------------------------------------------------------------------------- training


def _cosine_lr(opt: torch.optim.Optimizer, base_lr: float, step: int, total: int, warmup: int = 20) -> None:
    lr = base_lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
    for group in opt.param_groups:
        group["lr"] = lr


def _decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLQwenImage's one-frame decode without its final clamp to [-1, 1]: the clamp
    has no gradient outside the range, and a black background sits on its edge, so training
    through it can push every pixel below -1 and stall on an all-black image."""
    vae.clear_cache()
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=[0])
    vae.clear_cache()
    return out


def train_vae(vae, images: torch.Tensor, steps: int, lr: float, s: BaseSettings, chroma_weight: float = 3.0,
              l2_weight: float = 1e-4) -> float:
    """Reconstruction training of `vae` on images [N, 3, H, W] in [0, 1] for `steps` steps of
    s.vae_batch at peak learning rate `lr`; returns the mean MSE (on [-1, 1]) of the last 20.

    Two things make it converge within the budget. The error's chroma (the error minus its mean
    over RGB) is weighted `chroma_weight` extra: with plain MSE the tiny VAE sits for hundreds
    of steps on a plateau where it reconstructs every shape in grey (brightness only).

    And the decoder reads the posterior mean, not a sample: at initialisation the posterior's std is
    ~1, and decoding samples buries the colour in noise for hundreds of steps (the MSE stalls at
    the brightness alone), more than a few-minute budget affords. The DiT is trained on the means
    too, so nothing downstream needs the sampled latents; a small L2 term on the means (the KL's
    mean part) keeps their scale bounded."""
    g = torch.Generator().manual_seed(s.seed + 10)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()
    recent: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(images), (s.vae_batch,), generator=g)
        x = (images[idx] * 2 - 1).unsqueeze(2)  # [B, 3, 1, H, W]: one video frame
        post = vae.encode(x).latent_dist
        err = _decode_unclamped(vae, post.mean) - x
        mse = err.pow(2).mean()
        chroma = (err - err.mean(dim=1, keepdim=True)).pow(2).mean()
        l2 = post.mean.pow(2).mean()
        _cosine_lr(opt, lr, step, steps)
        opt.zero_grad(set_to_none=True)
        (mse + chroma_weight * chroma + l2_weight * l2).backward()
        opt.step()
        recent = (recent + [mse.item()])[-20:]
        if step % 50 == 0 or step == steps - 1:
            log.info("vae %dx%d step %d/%d: mse %.4f latent rms %.3f (%.0f s)", images.shape[-2], images.shape[-1],
                     step + 1, steps, mse.item(), l2.sqrt().item(),
                     time.perf_counter() - t0)
    vae.eval()
    return sum(recent) / len(recent)


@torch.no_grad()
def encode_set(vae, images: torch.Tensor, batch: int = 128) -> torch.Tensor:
    """Posterior means [N, z, h, w] of images [N, 3, H, W] in [0, 1] (not yet normalised)."""
    out = [vae.encode((images[i:i + batch] * 2 - 1).unsqueeze(2)).latent_dist.mean[:, :, 0]
           for i in range(0, len(images), batch)]
    return torch.cat(out)


def train_dit(transformer, latents: torch.Tensor, cond_index: torch.Tensor, embeds: torch.Tensor,
              mask: torch.Tensor, scheduler_config: dict, vae_scale_factor: int, s: BaseSettings) -> float:
    """Flow-matching training of `transformer` on normalised latents [N, z, h, w]; sample i is
    conditioned on caption cond_index[i] of the padded text conditioning embeds [C, T, D] /
    mask [C, T]. Returns the mean loss of the last 50 steps."""
    from trainer.models.qwen_image import dit_velocity, img_shapes_for, pack_latents
    from trainer.sampling import calculate_shift, image_seq_len

    cfg = scheduler_config
    mu = calculate_shift(image_seq_len(s.image_size, s.image_size, vae_scale_factor),
                         cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"])
    g = torch.Generator().manual_seed(s.seed + 20)
    opt = torch.optim.AdamW(transformer.parameters(), lr=s.dit_lr, weight_decay=0.0)
    img_shapes = img_shapes_for(s.dit_batch, s.image_size, s.image_size, vae_scale_factor)
    transformer.train()
    recent: list[float] = []
    t0 = time.perf_counter()
    for step in range(s.dit_steps):
        idx = torch.randint(len(latents), (s.dit_batch,), generator=g)
        x0 = pack_latents(latents[idx])
        noise = torch.randn(x0.shape, generator=g)
        # the sampler's own time shift, so training spends its steps where sampling does
        u = torch.rand(s.dit_batch, generator=g).clamp(1e-3, 1 - 1e-3)
        sigma = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        x_s = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
        c = cond_index[idx]
        v = dit_velocity(transformer, x_s, sigma * 1000.0, embeds[c], mask[c], img_shapes)
        loss = (v - (noise - x0)).pow(2).mean()
        _cosine_lr(opt, s.dit_lr, step, s.dit_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-50:]
        if step % 250 == 0 or step == s.dit_steps - 1:
            log.info("dit step %d/%d: loss %.4f (%.0f s)", step + 1, s.dit_steps, loss.item(), time.perf_counter() - t0)
    transformer.eval()
    return sum(recent) / len(recent)


# ----------------------------------------------------------------------------- the build


def cached(output: Path, s: BaseSettings) -> bool:
    """True when `output` holds a complete base built with settings `s`."""
    marker = output / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("settings") == asdict(s)
    except ValueError:
        return False


def build_demo_base(output, settings: BaseSettings = BaseSettings(), *, rebuild: bool = False) -> Path:
    """Train the base (module docstring) into `output` and return its path; a cached build with
    the same settings is returned as is. Refuses to replace anything else unless `rebuild`."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from tools.make_tiny_model import (
        QWEN_IMAGE_SCHEDULER_CONFIG,
        TINY_TRANSFORMER_CONFIG,
        TINY_VAE_CONFIG,
    )
    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import pad_text

    out, s = Path(output), settings
    if cached(out, s):
        log.info("base model cached in %s", out)
        return out
    if out.exists() and not rebuild:
        why = "was built with other settings" if (out / MARKER).is_file() else f"has no {MARKER}"
        raise FileExistsError(f"{out} exists and {why}; pass --rebuild to replace it, or choose another --output")
    if s.image_size % 16:
        raise ValueError(f"--image-size {s.image_size} must be a multiple of 16 (VAE factor 4 x patch 2, "
                         "and the VAE's first stage trains at half the size)")

    t0 = time.perf_counter()
    torch.manual_seed(s.seed)
    images, captions = synthetic_set(s.num_images, s.image_size, s.seed)

    vae = AutoencoderKLQwenImage(**{**TINY_VAE_CONFIG, **DEMO_VAE_OVERRIDES})
    # first at half the side, 4x cheaper a step, where the colours separate (the chroma plateau
    # breaks) within the budget; then briefly at full size, which a half-size VAE does not yet
    # reconstruct (its mid-block attention has seen only the smaller grid)
    if s.vae_warmup_steps:
        small, _ = synthetic_set(s.num_images, s.image_size // 2, s.seed + 3)
        train_vae(vae, small, s.vae_warmup_steps, s.vae_warmup_lr, s)
    vae_mse = train_vae(vae, images, s.vae_steps, s.vae_lr, s)
    z = encode_set(vae, images)
    mean, std = z.mean(dim=(0, 2, 3)), z.std(dim=(0, 2, 3))
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in mean],
                           latents_std=[round(float(v), 6) for v in std])
    cfg = vae.config
    latents = (z - torch.tensor(cfg.latents_mean).view(1, -1, 1, 1)) / torch.tensor(cfg.latents_std).view(1, -1, 1, 1)

    torch.manual_seed(s.seed + 1)
    transformer = QwenImageTransformer2DModel(**{**TINY_TRANSFORMER_CONFIG, **DEMO_TRANSFORMER_OVERRIDES})
    tokenizer = build_demo_tokenizer()
    torch.manual_seed(s.seed + 2)
    text_encoder = build_demo_text_encoder(tokenizer)
    # the engine lends its prompt encoding, so the base is trained on exactly the conditioning
    # the rollouts will feed it; it freezes the modules it holds, the DiT is unfrozen below
    engine = NativeEngine.from_modules(transformer, vae, text_encoder, tokenizer, QWEN_IMAGE_SCHEDULER_CONFIG,
                                       device="cpu", dtype=torch.float32)
    unique = sorted(set(captions))
    conds = [engine.encode_prompt(c) for c in unique]
    embeds, mask = pad_text([c["prompt_embeds"] for c in conds], [c.get("prompt_embeds_mask") for c in conds])
    cond_index = torch.tensor([unique.index(c) for c in captions])
    transformer.requires_grad_(True)
    dit_loss = train_dit(transformer, latents, cond_index, embeds, mask, QWEN_IMAGE_SCHEDULER_CONFIG,
                         engine.vae_scale_factor, s)
    transformer.requires_grad_(False)

    with staged_dir(out) as tmp:
        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=vae,
                                 text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
        pipe.save_pretrained(tmp, safe_serialization=True)
        seconds = time.perf_counter() - t0
        (tmp / MARKER).write_text(json.dumps({
            "settings": asdict(s), "vae_mse": round(vae_mse, 5), "dit_loss": round(dit_loss, 5),
            "build_seconds": round(seconds, 1), "colors": list(DEMO_COLORS), "shapes": list(DEMO_SHAPES),
        }, indent=2) + "\n")
    log.info("base model written to %s in %.0f s (vae mse %.4f, dit loss %.4f)", out, seconds, vae_mse, dit_loss)
    return out


def main(argv=None) -> int:
    from trainer.cli import run_tool, tool_parser

    d = BaseSettings()
    p = tool_parser("make_demo_base", __doc__)
    p.add_argument("--output", required=True, help="directory of the base model (created; reused when cached)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the data, weights and training")
    p.add_argument("--image-size", type=int, default=d.image_size, help="image side in pixels, a multiple of 16")
    p.add_argument("--num-images", type=int, default=d.num_images, help="synthetic images, >= 1")
    p.add_argument("--vae-warmup-steps", type=int, default=d.vae_warmup_steps,
                   help="VAE training steps at half the image size, >= 0")
    p.add_argument("--vae-steps", type=int, default=d.vae_steps, help="VAE training steps at the full size, >= 1")
    p.add_argument("--dit-steps", type=int, default=d.dit_steps, help="DiT training steps, >= 1")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads, >= 1. One by default: on 2 cores shared with other jobs a VAE step "
                        "took 0.29 s on one thread and 1.97 s on two, which wait for each other at every op")
    p.add_argument("--rebuild", action="store_true", help="replace an existing --output built with other settings")
    args = p.parse_args(argv)
    for flag in ("num_images", "vae_steps", "dit_steps", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.vae_warmup_steps < 0:
        p.error(f"--vae-warmup-steps must be >= 0, got {args.vae_warmup_steps}")
    logging.basicConfig(level=logging.INFO, format="[demo-base] %(message)s")
    torch.set_num_threads(args.threads)
    s = BaseSettings(seed=args.seed, image_size=args.image_size, num_images=args.num_images,
                     vae_warmup_steps=args.vae_warmup_steps, vae_steps=args.vae_steps, dit_steps=args.dit_steps)
    return run_tool("make_demo_base", lambda: build_demo_base(args.output, s, rebuild=args.rebuild) and 0,
                    (FileExistsError, ValueError))


if __name__ == "__main__":
    raise SystemExit(main())
