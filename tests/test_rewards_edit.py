"""Edit rewards on synthetic images: the colour-edit formula, the CLIP preservation term on a
tiny random CLIP, the VLM judge shown source then edit, and how the source reaches a scorer."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.rewards.base import ImageBatch, RewardError
from trainer.rewards.color import draw_shape
from trainer.rewards.edit import (SOURCE_IMAGES_KEY, ClipPreservationScorer, ColorEditScorer, EditJudgeScorer,
                                  edit_target_color, source_batch)

BLUE, RED = (0.0, 0.0, 1.0), (1.0, 0.0, 0.0)


def circle(rgb, size=32, background=(1.0, 1.0, 1.0)):
    """uint8 [H, W, 3]: a circle of `rgb` on `background` (draw_shape draws on black)."""
    shape = draw_shape("circle", rgb, size, size / 2, size / 2, size * 0.3)
    inside = shape.abs().sum(0, keepdim=True) > 0
    if rgb == (0.0, 0.0, 0.0):
        inside = draw_shape("circle", (1, 1, 1), size, size / 2, size / 2, size * 0.3)[:1] > 0
    img = torch.where(inside, shape, torch.tensor(background).view(3, 1, 1))
    return (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def score_color_edit(edits, source, prompt="make the circle red", **md):
    scorer = ColorEditScorer()
    meta = [{SOURCE_IMAGES_KEY: [source], **md} for _ in edits]
    return scorer.score(ImageBatch(list(edits)), [prompt] * len(edits), meta)


def test_color_edit_rewards_the_named_colour_inside_and_the_rest_unchanged():
    source = circle(BLUE)
    perfect = circle(RED)
    unchanged = source
    all_red = np.zeros_like(source)
    all_red[..., 0] = 255
    half = perfect.copy()
    half[:, 16:] = source[:, 16:]  # right half of the circle still blue
    noisy_bg = perfect.copy()
    rng = np.random.default_rng(0)
    outside = (source == 255).all(axis=2)
    noisy_bg[outside] = (noisy_bg[outside] - rng.integers(0, 60, size=(int(outside.sum()), 3))).clip(0, 255)
    s = score_color_edit([perfect, unchanged, all_red, half, noisy_bg], source)
    ce, c, p = s["color_edit"], s["edit_color"], s["edit_preserve"]
    assert ce[0] > 0.99 and c[0] > 0.99 and p[0] == 1.0
    assert ce[1] < 0.01 and p[1] == 1.0          # nothing edited: colour term ~0
    assert ce[2] < 0.01 and c[2] > 0.99          # everything painted: preservation ~0
    assert 0.4 < ce[3] < 0.6                     # half the object recoloured
    assert 0.0 < ce[4] < ce[0] and p[4] < 1.0    # background disturbed: paid for
    assert torch.allclose(ce, c * p)
    assert ((ce >= 0) & (ce <= 1)).all()


def test_target_colour_is_the_last_palette_word_or_metadata():
    assert edit_target_color("make the blue circle red") == "red"
    assert edit_target_color("turn it GREEN") == "green"
    assert edit_target_color("make it nicer") is None
    assert edit_target_color("make it red", {"color": "blue"}) == "blue"
    with pytest.raises(ValueError, match="palette"):
        edit_target_color("x", {"color": "teal"})
    source = circle(BLUE)
    s = score_color_edit([circle(RED)], source, prompt="make the blue circle red")
    assert s["color_edit"][0] > 0.99
    assert math.isnan(float(score_color_edit([circle(RED)], source, prompt="make it nicer")["color_edit"][0]))
    # a source with no object (one flat colour) has nothing to recolour
    flat = np.full((32, 32, 3), 255, np.uint8)
    assert math.isnan(float(score_color_edit([circle(RED)], flat)["color_edit"][0]))


def test_source_forms_paths_tensors_and_resizing(tmp_path):
    source = circle(BLUE, size=64)
    Image.fromarray(source).save(tmp_path / "src.png")
    as_tensor = torch.from_numpy(source).permute(2, 0, 1).float() / 255
    edit = circle(RED, size=32)
    results = [score_color_edit([edit], form)["color_edit"][0] for form in
               (source, str(tmp_path / "src.png"), as_tensor, Image.fromarray(source))]
    assert results[0] > 0.85 and all(r == results[0] for r in results)  # edges blur in the resize
    # a group's shared source is converted once, and the batch holds it at each edit's size
    batch = source_batch(ImageBatch([edit, circle(RED, size=16)]), [{SOURCE_IMAGES_KEY: [source]}] * 2)
    assert [a.shape for a in batch.uint8] == [(32, 32, 3), (16, 16, 3)]
    with pytest.raises(RewardError, match=SOURCE_IMAGES_KEY):
        ColorEditScorer().score(ImageBatch([edit]), ["make it red"], [{}])
    with pytest.raises(RewardError, match="candidate 0"):
        source_batch(ImageBatch([edit]), [{SOURCE_IMAGES_KEY: [object()]}])


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    from tests.tiny_rewards import write_tiny_clip_dir

    return write_tiny_clip_dir(tmp_path_factory.mktemp("clip"))


def test_clip_preservation_is_image_image_cosine(tiny_clip_dir):
    from trainer.rewards.base import build_scorer

    scorer = build_scorer("trainer.rewards.edit.ClipPreservationScorer", tiny_clip_dir, "cpu")
    assert isinstance(scorer, ClipPreservationScorer)
    source = circle(BLUE)
    rng = np.random.default_rng(1)
    edits = [source.copy(), circle(RED), rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)]
    s = scorer.score(ImageBatch(edits), ["make it red"] * 3, [{SOURCE_IMAGES_KEY: [source]}] * 3)["clip_preserve"]
    assert s.shape == (3,) and abs(float(s[0]) - 1.0) < 1e-5
    assert float(s[1]) < 1.0 - 1e-4 and float(s[2]) < 1.0 - 1e-4 and (s.abs() <= 1 + 1e-6).all()
    # same images, source and edit swapped: the cosine is symmetric
    back = scorer.score(ImageBatch([source]), ["x"], [{SOURCE_IMAGES_KEY: [edits[1]]}])["clip_preserve"]
    assert abs(float(back[0]) - float(s[1])) < 1e-5
    with pytest.raises((ValueError, FileNotFoundError), match="--reward-model-path"):
        ClipPreservationScorer(model_path=None)


def test_edit_judge_sends_source_then_edit_with_the_edit_template():
    from tests.test_rewards_judge import stub_judge

    source, edit = circle(BLUE), circle(RED)
    with stub_judge({"make the circle red": "8", "make it vanish": "no idea"}) as (url, state):
        judge = EditJudgeScorer(reward_judge_endpoint=url, reward_judge_max_retries=0, backoff_s=0.0)
        out = judge.score(ImageBatch([edit, edit]), ["make the circle red", "make it vanish"],
                          [{SOURCE_IMAGES_KEY: [source]}] * 2)["edit_judge"]
    assert float(out[0]) == pytest.approx(0.8) and math.isnan(float(out[1]))
    assert judge.pop_failures() == {"malformed": 1}
    body = next(r for r in state["requests"] if "circle" in str(r))
    content = body["messages"][0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
    decoded = [np.asarray(Image.open(io.BytesIO(base64.b64decode(c["image_url"]["url"].split(",", 1)[1]))))
               for c in content[:2]]
    assert np.array_equal(decoded[0], source) and np.array_equal(decoded[1], edit)
    assert "first image is the original" in content[2]["text"] and "make the circle red" in content[2]["text"]
    # an explicit template is kept
    kept = EditJudgeScorer(reward_judge_endpoint=url, reward_judge_prompt_template="Edit: {prompt}. Score?")
    assert kept.template == "Edit: {prompt}. Score?"


def test_groups_through_the_manager_share_their_source_and_normalise():
    """Two groups of three candidates (each group one source), scored in batches of 4 by the
    reward manager and normalised per group: the best edit of each group gets the top advantage."""
    from trainer.rewards.manager import RewardManager
    from trainer.rewards.post_process import post_process

    blue, green = circle(BLUE), circle((0.0, 1.0, 0.0))
    edits = [circle(RED), blue, circle((1.0, 0.0, 1.0)), green, circle(RED), np.zeros_like(green)]
    meta = [{SOURCE_IMAGES_KEY: [src]} for src in (blue, blue, blue, green, green, green)]
    manager = RewardManager("cpu", scorer_path="trainer.rewards.edit.ColorEditScorer", batch_size=4)
    res = post_process(ImageBatch(edits), ["make the circle red"] * 6, group_size=3, manager=manager,
                       metadata=meta, required_components=["color_edit"])
    adv = res.advantages.view(2, 3)
    assert res.failed_groups == [] and int(adv[0].argmax()) == 0 and int(adv[1].argmax()) == 1
