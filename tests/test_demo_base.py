"""The demo's base model: the synthetic set, the held-out split, the object-colour reward, and a
reduced-size build that is cached and loads through the real loading path."""

from __future__ import annotations

import json

import pytest
import torch

from tools.make_demo_base import (
    DEMO_COLORS,
    DEMO_SHAPES,
    MARKER,
    BaseSettings,
    build_demo_base,
    cached,
    demo_prompts,
    draw_shape,
    synthetic_set,
)
from trainer.rewards.color import ObjectColorScorer, color_palette, object_color_match, object_color_reward

PALETTE = color_palette()


def test_synthetic_set_is_deterministic_and_balanced():
    a, caps_a = synthetic_set(36, 16, seed=3)
    b, caps_b = synthetic_set(36, 16, seed=3)
    c, _ = synthetic_set(36, 16, seed=4)
    assert torch.equal(a, b) and caps_a == caps_b
    assert not torch.equal(a, c)
    assert a.shape == (36, 3, 16, 16) and float(a.min()) == 0.0 and float(a.max()) == 1.0
    # every shape is drawn equally often, and the caption names the shape drawn
    assert [cap.split()[-1] for cap in caps_a] == [DEMO_SHAPES[i % 3] for i in range(36)]
    # the caption's colour word is independent of the painted colour: it must not always match
    painted = [DEMO_COLORS[(i // 3) % 6] for i in range(36)]
    assert sum(cap.split()[1] == p for cap, p in zip(caps_a, painted)) < 18


def test_held_out_split_covers_every_colour_and_shape_and_shares_no_pair():
    train, held_out = demo_prompts()
    assert len(train) == 12 and len(held_out) == 6 and not set(train) & set(held_out)
    for words in (DEMO_COLORS, DEMO_SHAPES):
        for w in words:
            assert any(w in p.split() for p in train) and any(w in p.split() for p in held_out)


def test_object_color_reward_reads_the_object_not_the_background():
    red_circle = draw_shape("circle", PALETTE["red"], 32, 16, 16, 10)
    assert object_color_reward(red_circle, PALETTE["red"]) == pytest.approx(1.0)
    assert object_color_reward(red_circle, PALETTE["yellow"]) < 0.15
    # half red, half blue: half the score, whatever the background's share of the image
    half = red_circle.clone()
    half[:, :, 16:] = draw_shape("circle", PALETTE["blue"], 32, 16, 16, 10)[:, :, 16:]
    assert object_color_reward(half, PALETTE["red"]) == pytest.approx(0.5, abs=0.05)
    # a speck of the right colour does not score as a whole object; an empty image scores 0
    speck = draw_shape("square", PALETTE["red"], 32, 16, 16, 2)
    assert object_color_reward(speck, PALETTE["red"]) < 0.2
    assert object_color_reward(torch.zeros(3, 32, 32), PALETTE["red"]) == 0.0
    # the background is whatever the border holds, not necessarily black
    on_white = torch.ones(3, 32, 32)
    on_white[:, 8:24, 8:24] = torch.tensor(PALETTE["blue"]).view(3, 1, 1)
    assert object_color_reward(on_white, PALETTE["blue"]) == pytest.approx(1.0)


def test_object_color_scorer_names_the_prompt_colour():
    from trainer.rewards.base import ImageBatch

    imgs = [draw_shape("square", PALETTE["green"], 16, 8, 8, 5)] * 3
    out = ObjectColorScorer().score(ImageBatch.from_any(imgs), ["a green square", "a red square", "a square"],
                                    [{}, {}, {}])
    assert out["object_color"][0] == pytest.approx(1.0) and out["object_color"][1] < 0.15
    assert out["color_match"].tolist()[:2] == [1.0, 0.0]
    assert torch.isnan(out["object_color"][2]) and torch.isnan(out["color_match"][2])


def test_color_match_is_the_named_colour_covering_most_of_the_object():
    red_circle = draw_shape("circle", PALETTE["red"], 32, 16, 16, 10)
    assert object_color_match(red_circle, "red") == 1.0 and object_color_match(red_circle, "magenta") == 0.0
    # a washed-out pinkish red (as a small VAE decodes it) is still red, though as near purple
    pale = red_circle * torch.tensor([0.8, 0.0, 0.0]).view(3, 1, 1)
    pale[1:] += (red_circle[0:1] > 0) * torch.tensor([0.1, 0.3]).view(2, 1, 1)
    assert object_color_match(pale, "red") == 1.0 and object_color_match(pale, "magenta") == 0.0
    # a third red is not a red shape; nor is a red speck, nor an empty image
    third = draw_shape("circle", PALETTE["blue"], 32, 16, 16, 10)
    third[:, :, :13] = red_circle[:, :, :13]
    assert object_color_match(third, "red") == 0.0 and object_color_match(third, "blue") == 1.0
    assert object_color_match(draw_shape("square", PALETTE["red"], 32, 16, 16, 2), "red") == 0.0
    assert object_color_match(torch.zeros(3, 32, 32), "red") == 0.0


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
    with pytest.raises(FileExistsError, match="--rebuild"):
        build_demo_base(out, BaseSettings(**{**TINY.__dict__, "dit_steps": 4}))

    engine = NativeEngine(out, device="cpu", dtype="fp32")
    records = [{"prompt": "a red circle", "metadata": {"task": "t2i", "sample_id": "probe_0"}}]
    sampling = parse_sampling_config({"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 1.0,
                                      "eta": 1.0, "sde_type": "dance", "sde_indices": [0]})
    got = generate_rollout(engine, QwenImageAdapter(), records, rollout_id=0, sampling=sampling, group_size=2,
                           generation_seed=0, artifact_root=str(tmp_path / "art"), task="t2i", retention=0)
    images = [r["image"] for r in got.responses]
    assert len(images) == 2 and images[0].shape == (3, 16, 16) and all(torch.isfinite(i).all() for i in images)


def test_cli_refuses_a_foreign_directory(tmp_path, capsys):
    from tools.make_demo_base import main

    (tmp_path / "other").mkdir()
    assert main(["--output", str(tmp_path / "other"), "--image-size", "16"]) == 2
    assert f"has no {MARKER}" in capsys.readouterr().err
    assert main(["--output", str(tmp_path / "x"), "--image-size", "24"]) == 2
    assert "multiple of 16" in capsys.readouterr().err
