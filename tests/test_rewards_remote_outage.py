"""The remote reward client through outages and limits, on 127.0.0.1: an endpoint that stops
answering (503, refused, HTML, a score short) fails the groups it could not score, counted and
logged naming it, and the run goes on until --reward-max-failed-rollouts; the start-up contact
rides out an endpoint that is not up yet; a batch is split to the server's advertised limits."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_rewards_remote_edit import edit_batch
from tests.test_security_network import serving
from tests.test_security_reward_server import TOKEN, cli_server
from tests.workers.launch import free_port
from tests.workers.recipes import tiny_recipe
from tools.reward_server import ServerLimits, make_server
from trainer.rewards.base import SOURCE_IMAGES_KEY, ImageBatch
from trainer.rewards.color import ColorScorer
from trainer.rewards.edit import ColorEditScorer
from trainer.rewards.manager import RewardManager
from trainer.rewards.remote import EndpointUnavailable, RemoteScorer, RewardEndpointError
from trainer.rewards.transport import TOKEN_ENV
from trainer.rewards.video import TemporalConsistencyScorer, VideoBatch

REPO = Path(__file__).resolve().parents[1]
INFO = {"protocol": 1, "components": ["color"], "required_tracks": ["image"]}


@contextlib.contextmanager
def scripted(post_answers, get_answers=()):
    """An HTTP server answering the n-th POST with post_answers(n) -> (status, content type, body)
    (the n-th GET with get_answers[n] while there are, then INFO); yields (url, POSTs seen)."""
    posts: list[int] = []
    gets = list(get_answers)

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status, ctype, body):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - the http.server API
            self._answer(*(gets.pop(0) if gets else (200, "application/json", json.dumps(INFO).encode())))

        def do_POST(self):  # noqa: N802 - the http.server API
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
            posts.append(n)
            status, ctype, body = post_answers(len(posts) - 1, n)
            self._answer(status, ctype, body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", posts
    finally:
        server.shutdown()
        server.server_close()


def images(n: int):
    return torch.rand(n, 3, 6, 6), [f"a red kite {i // 4}" for i in range(n)]


UNAVAILABLE = (503, "application/json", b'{"error": "at --max-connections"}')
HTML = (200, "text/html", b"<!doctype html><html><body>Sign in to continue</body></html>")
BAD_GATEWAY = (502, "text/html", b"<html><h1>502 Bad Gateway</h1></html>")


@pytest.mark.parametrize("answer, needle", [(UNAVAILABLE, "HTTP 503: at --max-connections"),
                                            (BAD_GATEWAY, "HTTP 502: <html><h1>502 Bad Gateway")])
def test_an_outage_fails_the_groups_not_the_run(answer, needle, caplog):
    with scripted(lambda i, n: answer) as (url, posts):
        manager = RewardManager("remote", endpoint=url, batch_size=4, remote_max_retries=2, remote_backoff_s=0.01)
        assert manager.components == ("color",)
        with caplog.at_level("WARNING"):
            out = manager.score(*images(12))
        assert torch.isnan(out.components["color"]).all() and out.num_samples == 12
        assert out.failure_metrics() == {"reward/failed_candidates_unavailable": 12.0}
        assert posts == [4, 4, 4]  # one batch, its 3 attempts; the other two batches are not tried
        assert f"reward endpoint {url} (--reward-endpoint) failed 3 attempt(s)" in caplog.text
        assert needle in caplog.text and "--reward-max-failed-rollouts" in caplog.text
    # the server gone for good: refused, and the same
    manager.scorer.backoff_s = 0.01
    out = manager.score(*images(4))
    assert torch.isnan(out.components["color"]).all()
    assert out.failure_metrics() == {"reward/failed_candidates_unavailable": 4.0}


@pytest.mark.parametrize("answer, needle", [
    (lambda n: HTML, "returned a body that is not JSON"),
    (lambda n: (200, "application/json", json.dumps({"color": [0.5] * (n - 1)}).encode()), "returned 3 values"),
])
def test_html_or_a_score_short_fails_the_groups_naming_the_endpoint(answer, needle, caplog):
    with scripted(lambda i, n: answer(n)) as (url, posts):
        manager = RewardManager("remote", endpoint=url, batch_size=4, remote_max_retries=3, remote_backoff_s=5)
        with caplog.at_level("WARNING"):
            t0 = time.monotonic()
            out = manager.score(*images(8))
        assert time.monotonic() - t0 < 4  # not retried
        assert torch.isnan(out.components["color"]).all() and posts == [4, 4]
        assert out.failure_metrics() == {"reward/failed_candidates_malformed": 8.0}
        assert f"reward endpoint {url}" in caplog.text and needle in caplog.text


def test_the_first_contact_waits_for_an_endpoint_that_is_not_up_yet(caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    holder = {}

    def start_late():
        time.sleep(1.5)
        holder["server"] = server = make_server(ColorScorer(), "127.0.0.1", port, "color")
        server.serve_forever(poll_interval=0.05)

    threading.Thread(target=start_late, daemon=True).start()
    try:
        with caplog.at_level("WARNING"):
            scorer = RemoteScorer(url, max_retries=1, backoff_s=0.2, startup_wait_s=10)
            assert scorer.components == ("color",)  # refused for 1.5 s, then answered
        assert f"reward endpoint {url} (--reward-endpoint) does not answer yet" in caplog.text
    finally:
        while "server" not in holder:
            time.sleep(0.05)
        holder["server"].shutdown()
        holder["server"].server_close()
    # nothing ever answers: a bounded wait, then an error naming the endpoint and its flag
    dead = f"http://127.0.0.1:{free_port()}/score"
    t0 = time.monotonic()
    with pytest.raises(EndpointUnavailable, match=rf"reward endpoint {dead} \(--reward-endpoint\) failed .* "
                                                  "Connection refused"):
        RemoteScorer(dead, max_retries=1, backoff_s=0.1, startup_wait_s=1).info()
    assert 1 <= time.monotonic() - t0 < 3  # the wait is startup_wait_s


class Recording(TemporalConsistencyScorer):
    def __init__(self):
        super().__init__()
        self.requests: list[list[int]] = []

    def score(self, videos, prompts, metadata):
        self.requests.append([int(v.shape[0]) for v in videos.uint8])
        return super().score(videos, prompts, metadata)


def clips(frames=(5, 5, 5, 3), size=(16, 24)):
    rng = np.random.default_rng(0)
    return VideoBatch([rng.integers(0, 256, (f, *size, 3), dtype=np.uint8) for f in frames])


def test_a_video_batch_is_split_to_the_advertised_pixels_and_frames():
    vb = clips()
    local = TemporalConsistencyScorer().score(vb, list("abcd"), [{}] * 4)["temporal_consistency"]
    per_video = 5 * 16 * 24
    for limits, expected in ((ServerLimits(max_request_pixels=per_video + 1), [[5], [5], [5], [3]]),
                             (ServerLimits(max_request_frames=10), [[5, 5], [5, 3]]),
                             (ServerLimits(max_request_pixels=2 * per_video), [[5, 5], [5, 3]])):
        recording = Recording()
        with serving(recording, limits=limits) as url:
            got = RewardManager("remote", endpoint=url, remote_max_retries=0).score(vb, list("abcd"))
        assert recording.requests == expected
        assert torch.equal(got.components["temporal_consistency"], local) and got.failures == {}
    # one video that fits in no request is an error naming the flag, before anything is sent
    recording = Recording()
    with serving(recording, limits=ServerLimits(max_request_frames=4)) as url:
        with pytest.raises(RewardEndpointError, match=r"candidate 0 alone needs 5 frames, more than the server's "
                                                      r"--max-request-frames=4"):
            RemoteScorer(url, max_retries=0).score(vb, list("abcd"), [{}] * 4)
    with serving(recording, limits=ServerLimits(max_image_pixels=16 * 24 - 1)) as url:
        with pytest.raises(RewardEndpointError, match=r"candidate 0 alone has an image or frame of 384 pixels, more "
                                                      r"than the server's --max-image-pixels=383"):
            RemoteScorer(url, max_retries=0).score(vb, list("abcd"), [{}] * 4)
    assert recording.requests == []


class RecordingColor(ColorScorer):
    def __init__(self):
        super().__init__()
        self.requests: list[int] = []

    def score(self, images, prompts, metadata):
        self.requests.append(len(images))
        return super().score(images, prompts, metadata)


def test_an_image_batch_is_split_to_the_advertised_images_and_bytes(monkeypatch):
    """Through the real tool: --max-request-images, advertised in its GET, splits a batch of 32
    into requests that fit, and the scores are those of one request; --max-request-mb too."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    imgs, prompts = images(32)
    local = ColorScorer().score(ImageBatch.from_any(imgs), prompts, [{}] * 32)["color"]
    with cli_server("--reward-scorer-path", "color", "--max-request-images", "7") as (url, _):
        assert RemoteScorer(url, max_retries=0).limits()["max_request_images"] == 7
        got = RewardManager("remote", endpoint=url, remote_max_retries=0).score(imgs, prompts)
    assert torch.equal(got.components["color"], local) and got.failures == {}
    recording = RecordingColor()
    with serving(recording, limits=ServerLimits(max_request_mb=0.002)) as url:
        got = RewardManager("remote", endpoint=url, remote_max_retries=0).score(imgs, prompts)
    assert torch.equal(got.components["color"], local) and sum(recording.requests) == 32
    assert len(recording.requests) > 2


def test_edit_sources_go_with_the_part_of_the_batch_that_uses_them():
    images, prompts, meta = edit_batch()  # two groups of two edits, one source each
    local = ColorEditScorer()(images, prompts, meta)
    recording = []

    class Recording(ColorEditScorer):
        def score(self, images, prompts, metadata):
            recording.append([len(m[SOURCE_IMAGES_KEY]) for m in metadata])
            return super().score(images, prompts, metadata)

    with serving(Recording(), limits=ServerLimits(max_request_images=3)) as url:  # 2 edits + their source
        remote = RemoteScorer(url, max_retries=0)(images, prompts, meta)
    assert recording == [[1, 1], [1, 1]]
    for name in ColorEditScorer.components:
        torch.testing.assert_close(remote[name], local[name])


# --- through `python -m trainer.train` ----------------------------------------------------------

def test_a_run_rides_out_a_slow_start_and_counts_an_outage_and_html_as_failed_rollouts(tmp_path, tiny_model_dir):
    """The endpoint answers the first GETs 503 (not up yet), then every POST of rollout 0 503
    (an outage through the retries) and rollout 1's with an HTML page: the run starts, both
    rollouts fail their groups, counted and logged naming the endpoint, and
    --reward-max-failed-rollouts 2 stops it, with no traceback."""
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a red ball {i}",
                                           "metadata": {"task": "t2i", "sample_id": f"p{i}"}}) + "\n"
                               for i in range(4)))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(tiny_recipe(tiny_model_dir, prompts, extra='reward-runtime = "remote"\nnum-rollout = 2'))

    def post(i, n):
        return UNAVAILABLE if i < 4 else HTML  # 4 = the first attempt and the client's 3 retries

    with scripted(post, get_answers=[UNAVAILABLE] * 2) as (url, posts):
        out = tmp_path / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "trainer.train", "--config", str(recipe), "--reward-endpoint", url,
             "--reward-max-failed-rollouts", "2", "--artifact-root", str(out / "art"), "--save", str(out / "ckpt"),
             "--tensorboard-dir", str(out / "tb")],
            cwd=REPO, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in log, log[-4000:]
    assert posts == [8] * 5  # rollout 0: 4 attempts; rollout 1: one HTML answer
    assert f"reward endpoint {url} (--reward-endpoint) does not answer yet" in log
    assert f"reward endpoint {url} (--reward-endpoint) failed 4 attempt(s)" in log and "HTTP 503" in log
    assert f"reward endpoint {url} returned a body that is not JSON" in log
    assert "2 consecutive rollouts" in log and "--reward-max-failed-rollouts" in log, log[-4000:]


def test_score_tool_exits_1_when_the_endpoint_scored_nothing(tmp_path, capsys):
    """tools/score.py against an endpoint that answers every batch with an HTML page: each image
    scores NaN with a warning naming the endpoint, and the tool ends with exit 1 saying that
    nothing scored, not 0 as if it had scored the folder."""
    from PIL import Image

    from tools import score

    images = tmp_path / "rollout_0"
    images.mkdir()
    for i in range(3):
        Image.new("RGB", (8, 8), (200, 10, 10)).save(images / f"group_00000000_sample_{i:04d}.png")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red ball"}) + "\n")
    with scripted(lambda n, k: (200, "text/html", b"<html>maintenance</html>")) as (url, posts):
        rc = score.main(["--reward-runtime", "remote", "--reward-endpoint", url, "--images", str(images),
                         "--prompt-data", str(prompts)])
    err = capsys.readouterr().err
    assert rc == 1 and posts, err
    assert "none of the 3 images got a finite score from" in err and url.split("/score")[0] in err, err
