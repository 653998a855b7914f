"""ShapeColorScorer, the demo's reward, on drawn images: the named colour on the named shape, and
what it refuses to pay for (another hue, a compromise colour, colour over the background, a
ragged outline, specks, an empty picture)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.rewards.base import ImageBatch
from trainer.rewards.color import (
    HUES,
    SHAPES,
    ShapeColorScorer,
    color_palette,
    draw_shape,
    hue_posterior,
    largest_component,
    object_mask,
    shape_color_scores,
    shape_iou,
    target_shape,
)

PALETTE = color_palette()


def test_a_clean_shape_of_the_named_colour_scores_one_and_other_hues_nothing():
    for shape in SHAPES:
        img = draw_shape(shape, PALETTE["red"], 32, 15.3, 16.8, 9.5)
        right = shape_color_scores(img, "red", shape)
        assert right["named_color"] == pytest.approx(1.0, abs=1e-3)
        assert right["color_match"] == 1.0 and right["shape_iou"] > 0.98
        for other in HUES[1:]:
            wrong = shape_color_scores(img, other, shape)
            assert wrong["named_color"] < 1e-3 and wrong["color_match"] == 0.0


def test_a_compromise_colour_earns_no_more_on_average_than_a_pure_one():
    # orange sits between red and yellow: it scores about half for each, ~0 for the rest, so
    # averaged over prompts naming the six hues it is worth what any pure hue is worth, 1/6
    orange = draw_shape("circle", PALETTE["orange"], 32, 16, 16, 10)
    scores = [shape_color_scores(orange, h, "circle")["named_color"] for h in HUES]
    assert scores[0] == pytest.approx(0.5, abs=0.02) and scores[3] == pytest.approx(0.5, abs=0.02)
    assert sum(scores) / 6 == pytest.approx(1 / 6, abs=0.01)
    pixels = torch.rand(200, 3, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(sum(hue_posterior(pixels, h) for h in HUES), torch.ones(200), atol=1e-5)


def test_colour_over_the_background_and_a_ragged_outline_are_paid_for():
    square = draw_shape("square", PALETTE["blue"], 32, 16, 16, 8)  # 26% of the picture
    assert shape_color_scores(square, "blue", "square")["named_color"] == pytest.approx(1.0, abs=1e-3)
    # the same blue over 80% of the picture: the size factor (0.4 / 0.8)^2
    wide = draw_shape("square", PALETTE["blue"], 32, 16, 16, 18)
    wide[:, 0] = 0.0  # keep a black border, so it is still read as an object on black
    got = shape_color_scores(wide, "blue", "square")
    area = float(object_mask(wide).float().mean())
    assert got["named_color"] == pytest.approx((0.4 / area) ** 2, rel=0.02) and got["color_match"] == 0.0
    # a blue plus sign asked to be a circle: the right colour (color_match says so) but IoU
    # under 0.5 with the circle, so no credit
    plus = torch.zeros(3, 32, 32)
    plus[2, 13:19, 3:29] = 1.0
    plus[2, 3:29, 13:19] = 1.0
    blob = shape_color_scores(plus, "blue", "circle")
    assert blob["color_match"] == 1.0 and blob["shape_iou"] < 0.5 and blob["named_color"] == 0.0
    # an outline between a blob and the shape earns part of the credit, linearly from IoU 0.5 to 0.7
    notched = draw_shape("square", PALETTE["blue"], 32, 16, 16, 10)
    notched[:, 8:14, 8:24] = 0.0  # a band off the top: a 16 x 10 rectangle
    got = shape_color_scores(notched, "blue", "square")
    assert 0.6 < got["shape_iou"] < 0.7
    assert got["named_color"] == pytest.approx((got["shape_iou"] - 0.5) / 0.2, abs=1e-3)
    # the factor checks the outline, not the kind: a circle asked to be a triangle keeps most of it
    circle = draw_shape("circle", PALETTE["blue"], 32, 16, 16, 10)
    assert shape_color_scores(circle, "blue", "triangle")["named_color"] > 0.9

def test_specks_and_empty_pictures_score_nothing():
    assert shape_color_scores(torch.zeros(3, 32, 32), "red", "circle") == \
        {"named_color": 0.0, "color_match": 0.0, "shape_iou": 0.0}
    speck = draw_shape("square", PALETTE["red"], 32, 16, 16, 2)
    assert shape_color_scores(speck, "red", "square")["named_color"] < 0.2
    # stray pixels beside the shape count against it (they are in the object, not in its main part)
    img = draw_shape("circle", PALETTE["green"], 32, 14, 16, 7)
    img[:, 2:30:4, 28:30] = torch.tensor(PALETTE["green"]).view(3, 1, 1)
    main, whole = largest_component(object_mask(img)), object_mask(img)
    assert int(main.sum()) < int(whole.sum())
    got = shape_color_scores(img, "green", "circle")["named_color"]
    assert got == pytest.approx(float(main.sum()) / float(whole.sum()), abs=1e-3) and got < 0.95


def test_largest_component_and_iou_on_known_masks():
    m = torch.zeros(32, 32, dtype=torch.bool)
    m[2:10, 2:10] = True  # 64 pixels
    m[20:30, 15:31] = True  # 160 pixels
    m[12, 12] = True
    assert int(largest_component(m).sum()) == 160 and bool(largest_component(m)[25, 20])
    assert not largest_component(torch.zeros(4, 4, dtype=torch.bool)).any()
    square = object_mask(draw_shape("square", (1, 1, 1), 32, 16, 16, 9))
    assert shape_iou(square, "square") == pytest.approx(1.0) and shape_iou(square, "triangle") < 0.7


def test_scorer_reads_the_prompt_and_fails_a_prompt_without_a_colour():
    imgs = [draw_shape("triangle", PALETTE["cyan"], 32, 16, 17, 10)] * 3
    out = ShapeColorScorer().score(ImageBatch.from_any(imgs), ["a cyan triangle", "a magenta triangle", "a triangle"],
                                   [{}, {}, {}])
    assert set(out) == set(ShapeColorScorer.components)
    assert out["named_color"][0] > 0.95 and out["named_color"][1] < 0.01
    assert out["color_match"].tolist()[:2] == [1.0, 0.0]
    assert all(math.isnan(float(v[2])) for v in out.values())
    assert target_shape("a Red CIRCLE") == "circle" and target_shape("a red ball") is None
    # no shape named: colour only, no shape factor
    ball = ShapeColorScorer().score(ImageBatch.from_any(imgs[:1]), ["a cyan ball"], [{}])
    assert float(ball["named_color"][0]) > 0.95 and float(ball["shape_iou"][0]) == 0.0
