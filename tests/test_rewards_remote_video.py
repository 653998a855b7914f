"""The remote route for video reward models: a request carries "videos" (frames as PNGs per
candidate) to a server whose scorer requires the video track; scores match the in-process scorer,
every frame counts against the pixel limits before decoding, a track mismatch is refused
naming both sides, and edit source images go with "images" only."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_rewards_remote import serving
from tools.reward_server import ServerLimits
from trainer.rewards.base import ImageBatch, RewardError
from trainer.rewards.color import ColorScorer
from trainer.rewards.remote import (
    RemoteScorer,
    RequestError,
    RequestLimits,
    RewardEndpointError,
    decode_request,
    encode_request,
)
from trainer.rewards.video import TemporalConsistencyScorer, VideoBatch


def clips() -> VideoBatch:
    rng = np.random.default_rng(0)
    smooth = np.zeros((5, 16, 24, 3), np.uint8)
    for i in range(5):
        smooth[i, 4:10, 2 * i:2 * i + 6] = 255
    return VideoBatch([smooth, rng.integers(0, 256, (3, 16, 24, 3), dtype=np.uint8)])


def png_b64(w, h) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_remote_video_scores_match_local():
    local = TemporalConsistencyScorer().score(clips(), ["a", "b"], [{}, {}])
    with serving(TemporalConsistencyScorer()) as url:
        remote = RemoteScorer(url, max_retries=0)
        assert remote.info()["required_tracks"] == ["video"]
        got = remote.score(clips(), ["a", "b"], [{}, {}])
    assert torch.equal(got["temporal_consistency"], local["temporal_consistency"])  # lossless frames


def test_the_frames_round_trip_losslessly_through_the_codec():
    vb = clips()
    back, prompts, md = decode_request(encode_request(vb, ["a", "b"], [{"k": 1}, {}]), track="video")
    assert isinstance(back, VideoBatch) and prompts == ["a", "b"] and md == [{"k": 1}, {}]
    assert all(np.array_equal(x, y) for x, y in zip(back.uint8, vb.uint8))


def test_a_track_mismatch_is_refused_naming_both_sides():
    with serving(TemporalConsistencyScorer()) as url:
        with pytest.raises(RewardEndpointError, match='reads videos, but the request carries "images"'):
            RemoteScorer(url, max_retries=0).score(ImageBatch.from_any(torch.rand(1, 3, 8, 8)), ["a"], [{}])
    with serving(ColorScorer()) as url:
        with pytest.raises(RewardEndpointError, match='reads images, but the request carries "videos"'):
            RemoteScorer(url, max_retries=0).score(clips(), ["a", "b"], [{}, {}])


def test_every_frame_counts_against_the_pixel_limits_before_decoding():
    frames = [png_b64(10, 10)] * 5
    body = json.dumps({"prompts": ["a"], "videos": [frames]}).encode()
    decode_request(body, RequestLimits(max_image_pixels=100, max_request_pixels=500), track="video")
    with pytest.raises(RequestError, match="max-request-pixels") as e:
        decode_request(body, RequestLimits(max_image_pixels=100, max_request_pixels=499), track="video")
    assert e.value.status == 413
    bomb = json.dumps({"prompts": ["a"], "videos": [[png_b64(10, 10), png_b64(200, 200)]]}).encode()
    with pytest.raises(RequestError, match="video 0 frame 1 is 200x200"):
        decode_request(bomb, RequestLimits(max_image_pixels=100 * 100), track="video")
    with serving(TemporalConsistencyScorer(), limits=ServerLimits(max_request_pixels=4 * 16 * 24)) as url:
        with pytest.raises(RewardEndpointError, match="max-request-pixels"):
            RemoteScorer(url, max_retries=0).score(clips(), ["a", "b"], [{}, {}])  # 8 frames of 16 x 24


@pytest.mark.parametrize("videos, match", [
    ([[]], "non-empty list"),
    (["abc"], "non-empty list"),
    ([["not base64!"]], "not base64"),
    ([[base64.b64encode(b"GIF89a....").decode()]], "GIF, not PNG"),
    ([[png_b64(8, 8), png_b64(8, 9)]], "first frame is 8x8"),
])
def test_malformed_videos_are_refused_clearly(videos, match):
    body = json.dumps({"prompts": ["a"] * len(videos), "videos": videos}).encode()
    with pytest.raises(RequestError, match=match):
        decode_request(body, track="video")


def test_source_images_go_with_images_only():
    """Edit sources travel with "images"; with "videos" the server refuses them (400) naming the
    field, the client refuses to build such a request, a video server does not advertise them, and
    a source key a peer puts inside a video request's metadata is dropped."""
    frames = [png_b64(8, 8)] * 2
    for extra in ({"source_images": [png_b64(8, 8)], "source_index": [[0]]}, {"source_index": [[0]]}):
        body = json.dumps({"prompts": ["a"], "videos": [frames], **extra}).encode()
        with pytest.raises(RequestError, match=f'"{next(iter(extra))}" goes with "images" only') as e:
            decode_request(body, track="video")
        assert e.value.status == 400
    body = json.dumps({"prompts": ["a"], "videos": [frames],
                       "metadata": [{"source_images": ["/etc/passwd"], "k": 1}]}).encode()
    assert decode_request(body, track="video")[2] == [{"k": 1}]
    source = np.zeros((16, 24, 3), np.uint8)
    with pytest.raises(RewardError, match='a video batch cannot send source images'):
        encode_request(clips(), ["a", "b"], [{"source_images": [source]}, {}])
    with serving(TemporalConsistencyScorer()) as url:
        remote = RemoteScorer(url, max_retries=0)
        assert remote.info()["source_images"] is False
        with pytest.raises(RewardError, match='a video batch cannot send source images'):
            remote.score(clips(), ["a", "b"], [{"source_images": [source]}, {"source_images": [source]}])
    with serving(ColorScorer()) as url:
        assert RemoteScorer(url, max_retries=0).info()["source_images"] is True


def test_the_reward_manager_sends_a_rollouts_videos_to_a_remote_video_scorer():
    """--reward-runtime remote on the t2v task: the manager asks the server's required track (its
    GET answer) and sends the rollout's [F, 3, H, W] videos as "videos", in batches."""
    from trainer.rewards.manager import RewardManager, scorer_tracks

    videos = [torch.from_numpy(v).permute(0, 3, 1, 2).float() / 255 for v in clips().uint8]
    local = TemporalConsistencyScorer().score(clips(), ["a", "b"], [{}, {}])
    with serving(TemporalConsistencyScorer()) as url:
        manager = RewardManager("remote", endpoint=url, batch_size=1, remote_max_retries=0)
        assert scorer_tracks(manager.scorer) == ("video",)
        out = manager.score(videos, ["a", "b"])
    assert torch.equal(out.components["temporal_consistency"], local["temporal_consistency"])
