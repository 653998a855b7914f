"""The demo's base model: the synthetic set, the held-out split, the word-level tokenizer, the
non-mixing text encoder, and a reduced-size build that is cached and loads through the real
loading path. (The shape-colour reward it is post-trained on: tests/test_shape_color.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from tools.make_demo_base import (
    CAPTION_COLOR_WORD,
    DEMO_COLORS,
    DEMO_SHAPES,
    DEMO_TARGET_COLORS,
    DEMO_WORDS,
    MARKER,
    BaseSettings,
    build_demo_base,
    build_demo_text_encoder,
    build_demo_tokenizer,
    cached,
    demo_prompts,
    synthetic_set,
)
from trainer.rewards.color import color_palette

PALETTE = color_palette()


def test_synthetic_set_is_deterministic_balanced_and_never_names_the_colour():
    a, caps_a = synthetic_set(36, 16, seed=3)
    b, caps_b = synthetic_set(36, 16, seed=3)
    c, _ = synthetic_set(36, 16, seed=4)
    assert torch.equal(a, b) and caps_a == caps_b
    assert not torch.equal(a, c)
    assert a.shape == (36, 3, 16, 16) and float(a.min()) == 0.0 and float(a.max()) == 1.0
    # the caption names the shape drawn, and the colour slot always holds the same placeholder
    assert caps_a == [f"a {CAPTION_COLOR_WORD} {DEMO_SHAPES[i % 3]}" for i in range(36)]
    # every one of the six colours is painted, each on every shape
    painted = {(i % 3, tuple(a[i].amax(dim=(1, 2)).tolist())) for i in range(36)}
    assert {rgb for _, rgb in painted} == {PALETTE[name] for name in DEMO_COLORS}
    assert len(painted) == 18


def test_held_out_split_trains_each_colour_on_two_shapes_and_holds_out_the_third():
    train, held_out = demo_prompts()
    assert DEMO_TARGET_COLORS == ("red", "green")
    assert train == ["a red square", "a red triangle", "a green circle", "a green triangle"]
    assert held_out == ["a red circle", "a green square"]
    # any colour list: each colour on every shape exactly once, two trained and one held out
    train, held_out = demo_prompts(DEMO_COLORS)
    assert len(train) == 12 and len(held_out) == 6 and not set(train) & set(held_out)
    for color in DEMO_COLORS:
        assert sum(p.split()[1] == color for p in train) == 2 and sum(p.split()[1] == color for p in held_out) == 1


def test_tokenizer_makes_each_demo_word_one_token_and_round_trips(tmp_path):
    from transformers import Qwen2Tokenizer

    from trainer.models.qwen_image import prompt_template_start_idx

    tok = build_demo_tokenizer()
    for word in DEMO_WORDS:
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    ids = tok("a magenta triangle", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["a", "Ġmagenta", "Ġtriangle"]
    # anything else still goes byte by byte, and the template prefix can still be dropped by position
    assert len(tok(" redgreen", add_special_tokens=False)["input_ids"]) > 1
    tok.save_pretrained(tmp_path)
    again = Qwen2Tokenizer.from_pretrained(tmp_path)
    assert again("a red circle")["input_ids"] == tok("a red circle")["input_ids"]
    template = "<|im_start|>system\nDescribe the image.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_template_start_idx(again, template) > 0


def test_text_encoder_keeps_each_word_to_its_own_token():
    from tools.make_tiny_model import QWEN_IMAGE_SCHEDULER_CONFIG, TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    from trainer.engine.native import NativeEngine

    tok = build_demo_tokenizer()
    torch.manual_seed(0)
    engine = NativeEngine.from_modules(QwenImageTransformer2DModel(**TINY_TRANSFORMER_CONFIG),
                                       AutoencoderKLQwenImage(**TINY_VAE_CONFIG), build_demo_text_encoder(tok), tok,
                                       QWEN_IMAGE_SCHEDULER_CONFIG, device="cpu", dtype=torch.float32)
    red = engine.encode_prompt("a red circle")["prompt_embeds"]
    blue = engine.encode_prompt("a blue circle")["prompt_embeds"]
    assert red.shape == blue.shape == (8, 16)  # a, colour, shape + the template's 5 closing tokens
    # only the colour token differs: "circle" and the template after it do not hear the colour
    assert not torch.allclose(red[1], blue[1])
    assert torch.equal(red[0], blue[0]) and torch.equal(red[2:], blue[2:])


TINY = BaseSettings(image_size=16, num_images=24, vae_warmup_steps=1, vae_steps=2, vae_batch=4, dit_steps=3,
                    dit_batch=4)


def test_reduced_build_is_cached_and_loads_through_the_engine(tmp_path):
    from trainer.engine.native import NativeEngine
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.rollout import generate_rollout
    from trainer.sampling import parse_sampling_config

    out = build_demo_base(tmp_path / "base", TINY)
    marker = json.loads((out / MARKER).read_text())
    assert cached(out, TINY) and marker["settings"]["image_size"] == 16
    assert not (tmp_path / "base.tmp").exists()
    # the VAE's latent statistics were measured on the data, not left at the defaults
    vae_cfg = json.loads((out / "vae" / "config.json").read_text())
    assert vae_cfg["latents_std"] != [1.0] * 4 and vae_cfg["base_dim"] == 8

    weights = out / "transformer" / "diffusion_pytorch_model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_demo_base(out, TINY) == out and weights.stat().st_mtime_ns == stamp  # the cache: no retraining
    assert not cached(out, BaseSettings(**{**TINY.__dict__, "dit_steps": 4}))
    with pytest.raises(FileExistsError, match="--rebuild"):
        build_demo_base(out, BaseSettings(**{**TINY.__dict__, "dit_steps": 4}))

    # the real loading path: tokenizer, zeroed text attention and the DiT all come back from disk
    engine = NativeEngine(out, device="cpu", dtype="fp32")
    assert len(engine.tokenizer("a red circle", add_special_tokens=False)["input_ids"]) == 3
    o_proj = engine.text_encoder.model.language_model.layers[0].self_attn.o_proj.weight
    assert float(o_proj.abs().sum()) == 0.0
    records = [{"prompt": "a red circle", "metadata": {"task": "t2i", "sample_id": "probe_0"}}]
    sampling = parse_sampling_config({"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 1.0,
                                      "eta": 1.0, "sde_type": "dance", "sde_indices": [0]})
    got = generate_rollout(engine, QwenImageAdapter(), records, rollout_id=0, sampling=sampling, group_size=2,
                           generation_seed=0, artifact_root=str(tmp_path / "art"), task="t2i", retention=0)
    images = list(got.trajectory.images)
    assert len(images) == 2 and images[0].shape == (3, 16, 16) and all(torch.isfinite(i).all() for i in images)


def test_cli_refuses_a_foreign_directory_and_bad_sizes(tmp_path, capsys):
    from tools.make_demo_base import main

    (tmp_path / "other").mkdir()
    assert main(["--output", str(tmp_path / "other"), "--image-size", "16"]) == 2
    assert f"has no {MARKER}" in capsys.readouterr().err
    assert main(["--output", str(tmp_path / "x"), "--image-size", "24"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--output", str(tmp_path / "y"), "--threads", "0"])
    assert e.value.code == 2 and "--threads must be >= 1" in capsys.readouterr().err
