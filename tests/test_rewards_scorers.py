"""Scorers on constructed images: conversion, JPEG, colour, OCR (rapidocr, offline), PickScore
(a tiny random CLIP saved to disk and loaded back through the scorer's own loading code)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from trainer.dotpath import import_dotpath
from trainer.rewards.base import SHIPPED_SCORERS, ImageBatch, build_scorer
from trainer.rewards.color import COLOR_SIGMA, ColorScorer, color_palette, color_prompts, target_color
from trainer.rewards.jpeg import JpegCompressibilityScorer, JpegIncompressibilityScorer, jpeg_size_kb
from trainer.rewards.ocr import edit_distance, ocr_reward, ocr_target


def solid(rgb, h=32, w=32) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1).expand(3, h, w).clone()


# --- ImageBatch: the one conversion -------------------------------------------------------------

def test_image_batch_quantises_like_png_writer():
    x = torch.tensor([0.0, 0.5, 1.0, 1.2, -0.1, 0.2]).view(1, 3, 1, 2)
    b = ImageBatch.from_any(x)
    assert b.uint8[0].shape == (1, 2, 3) and b.uint8[0].dtype == np.uint8
    # round(clamp(x) * 255), channel-last
    assert b.uint8[0][0, 0].tolist() == [0, 255, 0]
    assert b.uint8[0][0, 1].tolist() == [128, 255, 51]  # 127.5 rounds to 128; 1.2 clamps
    # float view is exactly uint8 / 255, so a PNG round trip scores identically
    assert torch.equal(b.float_tensors[0], torch.from_numpy(b.uint8[0]).permute(2, 0, 1).float() / 255)


def test_image_batch_accepts_engine_and_file_forms_and_caches_views():
    t = torch.rand(3, 3, 8, 8)
    from_batch = ImageBatch.from_any(t)
    from_list = ImageBatch.from_any(list(t))
    from_bf16 = ImageBatch.from_any(t.bfloat16())
    from_pil = ImageBatch.from_any(from_batch.pil)
    assert len(from_batch) == 3
    for other in (from_list, from_pil):
        assert all(np.array_equal(a, b) for a, b in zip(from_batch.uint8, other.uint8))
    # bf16 quantises through fp32: at most one level off from the fp32 path
    diffs = [int(np.abs(a.astype(int) - b.astype(int)).max()) for a, b in zip(from_batch.uint8, from_bf16.uint8)]
    assert max(diffs) <= 1
    assert from_batch.pil is from_batch.pil and from_batch.float_tensors is from_batch.float_tensors
    sub = from_batch.slice(1, 3)
    assert len(sub) == 2 and sub.pil[0] is from_batch.pil[1]
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        ImageBatch.from_any(torch.rand(2, 4, 8, 8))


def test_shipped_dotpaths_import_and_declare_components():
    from trainer.config import VIDEO_SCORERS

    for component, path in SHIPPED_SCORERS.items():
        cls = import_dotpath(path, "--reward-scorer-path")
        if path in VIDEO_SCORERS:  # the t2v task's: their components depend on the wrapped scorer
            assert cls.required_tracks == ("video",), path
            continue
        assert component in cls.components and cls.required_tracks == ("image",)
    with pytest.raises(ValueError, match="--reward-scorer-path.*has no attribute 'NoSuchScorer'"):
        build_scorer("trainer.rewards.color.NoSuchScorer")


# --- JPEG ------------------------------------------------------------------------------------------

def test_jpeg_rewards_rank_flat_above_noise():
    gen = torch.Generator().manual_seed(0)
    flat, noise = solid((0.3, 0.6, 0.9), 64, 64), torch.rand(3, 64, 64, generator=gen)
    batch = ImageBatch.from_any(torch.stack([flat, noise]))
    comp = JpegCompressibilityScorer()(batch, ["x", "x"], [{}, {}])["jpeg_compressibility"]
    incomp = JpegIncompressibilityScorer()(batch, ["x", "x"], [{}, {}])["jpeg_incompressibility"]
    sizes = [jpeg_size_kb(im) for im in batch.pil]
    assert comp.tolist() == pytest.approx([-s for s in sizes])
    assert incomp.tolist() == pytest.approx(sizes)
    assert comp[0] > comp[1] and incomp[1] > incomp[0]
    assert sizes[1] > 5 * sizes[0]


# --- colour ----------------------------------------------------------------------------------------

def test_color_reward_depends_on_the_prompt():
    pal = color_palette()
    red = solid(pal["red"])
    half = torch.cat([solid(pal["red"], 16, 32), solid(pal["blue"], 16, 32)], dim=1)
    batch = ImageBatch.from_any(torch.stack([red, red, half, red]))
    out = ColorScorer()(batch, ["a red ball", "a Blue ball", "a red kite", "a ball"], [{}, {}, {}, {}])["color"]
    k = math.exp(-2.0 / (2 * COLOR_SIGMA**2))  # red vs blue: squared distance 2
    assert out[0].item() == pytest.approx(1.0)
    assert out[1].item() == pytest.approx(k, rel=1e-5)
    assert out[2].item() == pytest.approx((1 + k) / 2, rel=1e-5)
    assert math.isnan(out[3].item())  # no colour named: NaN, never a made-up 0
    md = ColorScorer()(ImageBatch.from_any(red), ["a blue ball"], [{"color": "red"}])["color"]
    assert md.item() == pytest.approx(1.0)


def test_color_reward_is_smooth_towards_the_target():
    grey, red = solid((0.5, 0.5, 0.5)), solid((1.0, 0.0, 0.0))
    ts = torch.linspace(0, 1, 11)
    batch = ImageBatch.from_any(torch.stack([(1 - t) * grey + t * red for t in ts]))
    r = ColorScorer()(batch, ["a red cube"] * 11, [{}] * 11)["color"]
    steps = r[1:] - r[:-1]
    assert (steps > 0).all()  # moving towards red always pays
    assert r[0] > 0.15  # signal even from a grey image
    assert steps.max() < 0.2  # no cliff


def test_color_prompts_cover_palette_and_parse_back():
    names = list(color_palette())
    prompts = color_prompts(2 * len(names))
    assert [target_color(p) for p in prompts] == names + names
    assert len(set(prompts)) == len(prompts)
    assert target_color("a yellow car on a red road") == "yellow"
    assert target_color("a reddish thing") is None


# --- OCR -------------------------------------------------------------------------------------------

def test_ocr_reward_formula():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert ocr_target('a sign that says "Open Late"') == "Open Late"
    assert ocr_target("a sign that says “Open”") == "Open"
    assert ocr_target("no quotes") is None and ocr_target("x", {"ocr_text": "hi"}) == "hi"
    assert ocr_reward("xx OPEN late yy", "Open Late") == 1.0  # substring, case and spaces ignored
    assert ocr_reward("openlake", "Open Late") == pytest.approx(1 - 1 / 8)
    assert ocr_reward("", "Open Late") == 0.0
    assert ocr_reward("something entirely different", "abc") == 0.0  # distance capped at len


def render_text(text: str) -> Image.Image:
    img = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(img).text((12, 24), text, fill="black", font=ImageFont.load_default(size=40))
    return img


def test_ocr_scorer_reads_rendered_text():
    from trainer.rewards.ocr import OcrScorer

    noise = (np.random.default_rng(0).random((96, 320, 3)) * 255).astype(np.uint8)
    batch = ImageBatch.from_any([render_text("Hello World"), noise, render_text("Helo Wrd")])
    prompt = 'a poster that says "Hello World"'
    scorer = OcrScorer()
    out = scorer(batch, [prompt] * 3, [{}] * 3)["ocr"]
    assert out[0] > 0.9
    assert out[1] < 0.2
    assert 0.2 < out[2] < 0.9
    assert math.isnan(scorer(ImageBatch.from_any(noise), ["no quoted text"], [{}])["ocr"].item())


# --- PickScore -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random CLIP (2 layers, width 32) plus a byte-level CLIP tokenizer and image processor,
    saved with save_pretrained: the on-disk layout of a PickScore_v1 directory."""
    from tests.tiny_rewards import write_tiny_clip_dir

    return write_tiny_clip_dir(tmp_path_factory.mktemp("pickscore"))


def test_pickscore_loads_tiny_clip_and_depends_on_prompt(tiny_clip_dir):
    scorer = build_scorer(SHIPPED_SCORERS["pickscore"], tiny_clip_dir, "cpu")
    gen = torch.Generator().manual_seed(1)
    imgs = torch.rand(3, 3, 48, 40, generator=gen)
    batch = ImageBatch.from_any(imgs)
    prompts = ["a red panda in a teacup", "an astronaut riding a horse", "a red panda in a teacup"]
    s = scorer(batch, prompts, [{}] * 3)["pickscore"]
    assert s.shape == (3,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    scale = float(scorer.model.logit_scale.exp())
    assert (s.abs() <= scale / 26 + 1e-6).all()  # logit_scale * cos / 26 with |cos| <= 1
    # each image scored alone with its own prompt gives the same value (prompt dedup is exact)
    alone = torch.cat([scorer(batch.slice(i, i + 1), [prompts[i]], [{}])["pickscore"] for i in range(3)])
    torch.testing.assert_close(alone, s, rtol=1e-5, atol=1e-6)
    # the same image under another prompt scores differently
    other = scorer(batch.slice(0, 1), [prompts[1]], [{}])["pickscore"]
    assert abs(float(other[0]) - float(s[0])) > 1e-4


def test_pickscore_errors_name_the_flag(tmp_path):
    from trainer.rewards.pickscore import PickScoreScorer

    with pytest.raises(ValueError, match="--reward-model-path"):
        PickScoreScorer(model_path=None)
    with pytest.raises(FileNotFoundError, match="--reward-model-path"):
        PickScoreScorer(model_path=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="processor"):
        PickScoreScorer(model_path=str(tmp_path))
