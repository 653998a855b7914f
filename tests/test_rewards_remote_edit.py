"""Source images through the remote route: sent once per distinct source beside the edits, handed
back to the scorer under metadata["source_images"], counted against the pixel limits, never taken
from a peer's metadata; an older server that would ignore them is refused by the client."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_rewards_remote import serving
from trainer.rewards.base import SOURCE_IMAGES_KEY, ImageBatch
from trainer.rewards.color import draw_shape
from trainer.rewards.edit import ColorEditScorer
from trainer.rewards.remote import (RemoteScorer, RequestError, RequestLimits, RewardEndpointError, decode_request,
                                    encode_png_b64, encode_request)


def circle(rgb, size=16):
    img = draw_shape("circle", rgb, size, size / 2, size / 2, size * 0.3)
    return (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def edit_batch():
    blue, green = circle((0, 0, 1)), circle((0, 1, 0))
    edits = [circle((1, 0, 0)), blue, circle((1, 0, 0)), green]
    # two groups of two: each group shares one source array, as the rollout passes it
    meta = [{"sample_id": f"s{i}", SOURCE_IMAGES_KEY: [src]} for i, src in enumerate([blue, blue, green, green])]
    return ImageBatch(edits), ["make the circle red"] * 4, meta


def test_sources_travel_once_each_and_scores_match_local():
    images, prompts, meta = edit_batch()
    body = json.loads(encode_request(images, prompts, meta))
    assert len(body["source_images"]) == 2 and body["source_index"] == [[0], [0], [1], [1]]
    assert all(SOURCE_IMAGES_KEY not in m for m in body["metadata"])
    assert body["metadata"][2] == {"sample_id": "s2"}
    decoded_images, _, decoded_meta = decode_request(json.dumps(body).encode())
    assert np.array_equal(decoded_meta[3][SOURCE_IMAGES_KEY][0], meta[3][SOURCE_IMAGES_KEY][0])
    # a batch without sources is encoded exactly as before (no new keys)
    plain = json.loads(encode_request(images, prompts, [{"sample_id": "x"}] * 4))
    assert set(plain) == {"protocol", "prompts", "metadata", "images"}

    local = ColorEditScorer()(images, prompts, meta)
    with serving(ColorEditScorer()) as url:
        client = RemoteScorer(url, timeout_s=10, max_retries=0)
        assert client.info()["source_images"] is True
        remote = client(images, prompts, meta)
    for name in ColorEditScorer.components:
        torch.testing.assert_close(remote[name], local[name])
    assert remote["color_edit"][0] > 0.9 and remote["color_edit"][1] < 0.1


def test_server_refuses_bad_source_fields_and_counts_their_pixels():
    images, prompts, meta = edit_batch()
    body = json.loads(encode_request(images, prompts, meta))

    def refused(limits=RequestLimits(), **change):
        with pytest.raises(RequestError) as e:
            decode_request(json.dumps({**body, **change}).encode(), limits)
        return str(e.value), e.value.status

    assert "source_index" in refused(source_index=[[0]] * 3)[0]
    assert "not an index" in refused(source_index=[[0], [0], [1], [2]])[0]
    assert "not an index" in refused(source_index=[[0], [0], [True], [1]])[0]
    assert "at most" in refused(source_index=[[0] * 9, [0], [1], [1]])[0]
    assert "base64 PNG strings" in refused(source_images=[1, 2])[0]
    jpeg = io.BytesIO()
    Image.new("RGB", (4, 4)).save(jpeg, format="JPEG")
    assert "source image 1 is JPEG" in refused(source_images=[body["source_images"][0],
                                                              base64.b64encode(jpeg.getvalue()).decode()])[0]
    # 4 edits of 16x16 fit the limit, the first source does not: sources count too
    message, status = refused(RequestLimits(max_request_pixels=4 * 16 * 16 + 255))
    assert status == 413 and "source image 0" in message


def test_a_peer_cannot_name_a_source_file(tmp_path):
    secret = tmp_path / "secret.png"
    Image.fromarray(circle((1, 0, 0))).save(secret)
    images, prompts, _ = edit_batch()
    body = json.loads(encode_request(images, prompts, [{"sample_id": "x"}] * 4))
    body["metadata"] = [{SOURCE_IMAGES_KEY: [str(secret)]}] * 4
    _, _, meta = decode_request(json.dumps(body).encode())
    assert all(SOURCE_IMAGES_KEY not in m for m in meta)
    with serving(ColorEditScorer()) as url:
        from trainer.rewards.transport import exchange, HttpFailure

        with pytest.raises(HttpFailure) as e:
            exchange(url, json.dumps(body).encode(), 10)
        assert e.value.status == 500 and SOURCE_IMAGES_KEY in str(e.value)


def test_client_refuses_sources_for_an_older_server_and_undecoded_sources():
    images, prompts, meta = edit_batch()
    client = RemoteScorer("http://127.0.0.1:9/score", timeout_s=1, max_retries=0)
    client._info = {"components": ["color_edit"]}  # what a server without the addition answers
    with pytest.raises(RewardEndpointError, match="does not accept source images"):
        client(images, prompts, meta)
    client._info = {"components": ["color_edit"], "source_images": True}
    with pytest.raises(Exception, match="must be decoded"):
        encode_request(images, prompts, [{SOURCE_IMAGES_KEY: ["/some/path.png"]}] * 4)
    assert encode_png_b64(meta[0][SOURCE_IMAGES_KEY][0])  # arrays encode
