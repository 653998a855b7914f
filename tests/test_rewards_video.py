"""Video rewards (trainer/rewards/video.py) on tiny synthetic clips: an image scorer on sampled
frames with a declared reduction, the weightless temporal-consistency term (a moving square
scores high, noise low), OCR on frames through the real OCR scorer, and the VLM judge on a
frame grid (the request it would send, checked without a server)."""

from __future__ import annotations

import base64
import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from trainer.rewards.base import FunctionScorer, ImageBatch, RewardError
from trainer.rewards.color import ColorScorer
from trainer.rewards.video import (
    FramewiseScorer,
    TemporalConsistencyScorer,
    VideoBatch,
    VideoJudgeScorer,
    frame_grid,
    reduce_per_candidate,
    temporal_consistency,
)
from trainer.rewards.vlm_judge import VlmJudgeScorer


def moving_square(num_frames=9, h=32, w=48, size=8, step=2, color=(255, 255, 255)) -> np.ndarray:
    """uint8 [F, H, W, 3]: a square sliding right over black, `step` px per frame."""
    clip = np.zeros((num_frames, h, w, 3), dtype=np.uint8)
    for i in range(num_frames):
        x = (i * step) % (w - size)
        clip[i, 10:10 + size, x:x + size] = color
    return clip


def noise_clip(num_frames=9, h=32, w=48, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_frames, h, w, 3), dtype=np.uint8)


def ramp_clip(num_frames=9, h=8, w=8) -> np.ndarray:
    """Frame i is a flat grey of level round(255 * i / (F - 1)): frame brightness = i / (F - 1)."""
    levels = np.round(255 * np.arange(num_frames) / (num_frames - 1)).astype(np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (num_frames, h, w, 3)).copy()


# ------------------------------------------------------------------------- the video batch


def test_video_batch_converts_the_pipeline_layout_once():
    t = torch.rand(2, 5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    vb = VideoBatch.from_any(t)
    assert len(vb) == 2 and vb.uint8[0].shape == (5, 8, 8, 3) and vb.uint8[0].dtype == np.uint8
    # the same quantisation as the image path (ImageBatch) and the video writer
    assert np.array_equal(vb.uint8[1][3], ImageBatch.from_any(t[1, 3]).uint8[0])
    assert VideoBatch.from_any(vb) is vb
    frames, owner, index = vb.frames(lambda n: [0, n - 1])
    assert len(frames) == 4 and owner == [0, 0, 1, 1] and index == [0, 4, 0, 4]


def test_a_video_scorer_refuses_images_clearly():
    images = ImageBatch.from_any(torch.rand(2, 3, 8, 8))
    with pytest.raises(RewardError, match="video scorer"):
        TemporalConsistencyScorer().score(images, ["p", "p"], [{}, {}])
    with pytest.raises(ValueError, match="F >= 1"):
        VideoBatch([np.zeros((8, 8, 3), np.uint8)])


# ------------------------------------------------------------------------- temporal consistency


def test_moving_square_is_consistent_noise_is_not():
    smooth = temporal_consistency(moving_square())
    rough = temporal_consistency(noise_clip())
    assert smooth > 0.9, smooth
    assert rough < 0.05, rough
    assert temporal_consistency(np.repeat(moving_square()[:1], 5, axis=0)) == 1.0  # still: the maximum
    assert math.isnan(temporal_consistency(moving_square()[:1]))                   # one frame: nothing to compare
    # faster motion is less consistent than slower motion of the same square
    assert temporal_consistency(moving_square(step=6)) < temporal_consistency(moving_square(step=1))


def test_temporal_consistency_scorer_on_a_batch():
    out = TemporalConsistencyScorer().score(VideoBatch([moving_square(), noise_clip()]), ["a", "b"], [{}, {}])
    s = out["temporal_consistency"]
    assert s.dtype == torch.float32 and s.shape == (2,) and s[0] > 0.9 > 0.05 > s[1]
    with pytest.raises(ValueError, match="no weights"):
        TemporalConsistencyScorer(model_path="/models/x")


# ------------------------------------------------------------------------- any image scorer on frames


def brightness(images, prompts, metadata):
    return [float(a.mean()) / 255 for a in images.uint8]


def test_reductions_and_frame_rules_on_a_brightness_ramp():
    vb = VideoBatch([ramp_clip(9), ramp_clip(5)])
    mean_every4 = FramewiseScorer(scorer=FunctionScorer(brightness, "brightness"), every=4)
    assert mean_every4.components == ("video_brightness",)
    got = mean_every4.score(vb, ["p", "q"], [{}, {}])["video_brightness"]
    # 9 frames: 0, 4, 8 -> levels 0, .5, 1 -> mean .5; 5 frames: 0, 4 -> levels 0, 1 -> mean .5
    assert got.tolist() == pytest.approx([0.5, 0.5], abs=2e-3)
    min_count3 = FramewiseScorer(scorer=FunctionScorer(brightness, "brightness"), reduction="min", count=3)
    assert min_count3.components == ("video_brightness_min",)
    assert min_count3.score(vb, ["p", "q"], [{}, {}])["video_brightness_min"].tolist() == [0.0, 0.0]
    late = VideoBatch([ramp_clip(9)[4:]])  # 5 frames from level .5 up
    assert min_count3.score(late, ["p"], [{}])["video_brightness_min"].item() == pytest.approx(0.5, abs=2e-3)


def test_inner_scorer_gets_every_sampled_frame_in_one_call_with_its_prompt_and_frame_index():
    calls = []

    def record(images, prompts, metadata):
        calls.append((len(images), list(prompts), [m["frame_index"] for m in metadata], [m["id"] for m in metadata]))
        return [0.0] * len(images)

    s = FramewiseScorer(scorer=FunctionScorer(record, "r"), count=2)
    s.score(VideoBatch([ramp_clip(9), ramp_clip(5)]), ["p", "q"], [{"id": 0}, {"id": 1}])
    assert calls == [(4, ["p", "p", "q", "q"], [0, 8, 0, 4], [0, 0, 1, 1])]


def test_one_unscorable_frame_fails_its_candidate_under_both_reductions():
    def picky(images, prompts, metadata):
        return [None if m["frame_index"] == 4 else 1.0 for m in metadata]

    vb = VideoBatch([ramp_clip(9), ramp_clip(3)])
    for reduction in ("mean", "min"):
        s = FramewiseScorer(scorer=FunctionScorer(picky, "p"), reduction=reduction, every=4)
        out = next(iter(s.score(vb, ["a", "b"], [{}, {}]).values()))
        assert math.isnan(out[0].item()) and out[1].item() == 1.0
    assert math.isnan(reduce_per_candidate(torch.tensor([1.0]), [0], 2, "mean")[1].item())  # no frames


def test_a_shipped_image_scorer_by_short_name_on_frames():
    red = moving_square(color=(230, 20, 20)) + np.array([20, 0, 0], np.uint8)
    blue = moving_square(color=(20, 20, 230))
    s = FramewiseScorer(scorer="color", count=4)
    assert isinstance(s.inner, ColorScorer) and s.components == ("video_color",)
    out = s.score(VideoBatch([red, blue]), ["a red ball"] * 2, [{}, {}])["video_color"]
    assert out[0] > out[1]


def test_bad_wrapper_settings_are_refused():
    with pytest.raises(ValueError, match="reduction"):
        FramewiseScorer(scorer=FunctionScorer(brightness, "b"), reduction="median")
    with pytest.raises(ValueError, match="every"):
        FramewiseScorer(scorer=FunctionScorer(brightness, "b"), every=0)
    with pytest.raises(ValueError, match="exactly one"):
        FramewiseScorer(scorer=FunctionScorer(brightness, "b"), every=4, count=8)
    default = FramewiseScorer(scorer=FunctionScorer(brightness, "b"))
    assert default.describe() == "b on 8 evenly spaced frames, mean per video"
    with pytest.raises(ValueError, match="image scorer"):
        FramewiseScorer(scorer=TemporalConsistencyScorer())


# ------------------------------------------------------------------------- OCR on frames


def text_clip(text: str, num_frames=9) -> np.ndarray:
    img = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(img).text((12, 24), text, fill="black", font=ImageFont.load_default(size=40))
    return np.repeat(np.asarray(img)[None], num_frames, axis=0).copy()


def test_ocr_on_every_4th_frame_reads_the_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra is not installed")
    from trainer.rewards.video import VideoOcrScorer

    s = VideoOcrScorer()
    assert s.components == ("video_ocr",) and s.describe() == "ocr on every 4th frame, mean per video"
    vb = VideoBatch([text_clip("Hello World", 5), noise_clip(1, 96, 320)])  # frames 0, 4 and 0: three OCR calls
    out = s.score(vb, ['a poster that says "Hello World"'] * 2, [{}, {}])["video_ocr"]
    assert out[0] > 0.9 and out[1] < 0.2


# ------------------------------------------------------------------------- the judge on a frame grid


def test_frame_grid_lays_out_evenly_spaced_frames_in_reading_order():
    clip = ramp_clip(9, h=4, w=6)
    grid = frame_grid(clip, count=4, columns=2)
    assert grid.shape == (8, 12, 3)
    # frames 0, 3, 5, 8 (evenly spaced, first and last) left to right, top to bottom
    cells = [int(grid[r, c, 0]) for r, c in ((0, 0), (0, 6), (4, 0), (4, 6))]
    assert cells == [int(clip[f, 0, 0, 0]) for f in (0, 3, 5, 8)]
    odd = frame_grid(clip, count=3, columns=2, gap=1)
    assert odd.shape == (9, 13, 3) and (odd[5:, 7:] == 255).all()  # the empty fourth cell is white
    assert frame_grid(clip[:1], count=4, columns=2).shape == (4, 6, 3)  # one frame: one cell


def test_the_judge_sees_one_grid_per_video_with_the_video_template():
    s = VideoJudgeScorer(reward_judge_max_retries=0)
    sent = []

    def fake_ask(body: bytes) -> str:
        sent.append(json.loads(body))
        return "7"

    s.judge._ask = fake_ask
    out = s.score(VideoBatch([moving_square(), noise_clip()]), ["a white square", "noise"], [{}, {}])
    assert out["video_vlm_judge"].tolist() == pytest.approx([0.7, 0.7])
    assert len(sent) == 2
    texts = sorted(m["content"][1]["text"] for m in (b["messages"][0] for b in sent))
    assert "grid of frames" in texts[0] and '"a white square"' in texts[0] + texts[1]
    url = sent[0]["messages"][0]["content"][0]["image_url"]["url"]
    png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert png.size == (2 * 48, 2 * 32)  # 4 frames of 48 x 32, two per row
    # a template of the user's own is kept
    own = VideoJudgeScorer(reward_judge_prompt_template="Score {prompt}")
    assert own.judge.template == "Score {prompt}"
    assert VideoJudgeScorer.config_fields == VlmJudgeScorer.config_fields


def test_the_manager_routes_videos_to_video_scorers_in_batches():
    """A video scorer gets VideoBatch slices (batch_size 2 over 3 videos, scores in order); an
    image scorer given videos is refused naming the framewise fix."""
    from trainer.rewards.base import RewardError
    from trainer.rewards.manager import RewardManager

    g = torch.Generator().manual_seed(0)
    videos = [torch.rand(5, 3, 8, 8, generator=g) for _ in range(3)]
    videos[1] = videos[1][:1].expand(5, 3, 8, 8)  # a still clip: consistency 1
    manager = RewardManager("cpu", "temporal_consistency", batch_size=2)
    out = manager.score(videos, ["a", "b", "c"])
    assert out.num_samples == 3 and out.components["temporal_consistency"][1] == 1.0
    assert float(out.components["temporal_consistency"][0]) < 0.2
    framewise = RewardManager("cpu", "framewise", scorer_options={"reward_frame_scorer": "color",
                                                                  "reward_frame_count": 2})
    assert framewise.components == ("video_color",) and framewise.score(videos, ["a red ball"] * 3).num_samples == 3
    with pytest.raises(RewardError, match="--reward-scorer-path framewise --reward-frame-scorer"):
        RewardManager("cpu", "color").score(videos, ["a", "b", "c"])
