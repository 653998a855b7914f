"""Remote scoring against tools/reward_server.py on 127.0.0.1 (a thread, and once the real CLI in
a subprocess); a dead endpoint fails fast with an error naming it; tools/score.py on a folder."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from tools.reward_server import make_server
from trainer.rewards.base import ImageBatch
from trainer.rewards.color import ColorScorer, color_palette
from trainer.rewards.manager import RewardManager
from trainer.rewards.post_process import post_process
from trainer.rewards.remote import RemoteScorer, RewardEndpointError

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serving(scorer, limits=None):
    """`scorer` behind tools/reward_server.py on a free 127.0.0.1 port (a thread); yields the URL."""
    server = make_server(scorer, "127.0.0.1", 0, "test.scorer", limits=limits)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}/score"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def color_batch():
    pal = color_palette()
    imgs = torch.stack([torch.tensor(pal[c]).view(3, 1, 1).expand(3, 6, 6) * t for c, t in
                        (("red", 1.0), ("red", 0.6), ("blue", 0.9), ("blue", 0.3))])
    return imgs, ["a red kite", "a red kite", "a blue kite", "a kite"]  # the last names no colour


def test_remote_scores_match_local_and_nan_travels_as_null():
    imgs, prompts = color_batch()
    local = ColorScorer()(ImageBatch.from_any(imgs), prompts, [{}] * 4)["color"]
    with serving(ColorScorer()) as url:
        client = RemoteScorer(url, timeout_s=10, max_retries=0)
        assert client.components == ("color",) and client.info()["scorer"] == "test.scorer"
        remote = client(ImageBatch.from_any(imgs), prompts, [{"sample_id": str(i)} for i in range(4)])["color"]
        torch.testing.assert_close(remote, local, equal_nan=True)  # PNG transport is lossless
        assert math.isnan(remote[3])
        # the whole reward path through the remote runtime, in batches of 3
        manager = RewardManager("remote", endpoint=url, batch_size=3)
        res = post_process(imgs, prompts, group_size=2, manager=manager, required_components=["color"])
        assert res.failed_groups == [1] and res.valid.tolist() == [True, True, False, False]
        assert res.advantages[0] > 0 > res.advantages[1]


class FlakyScorer(ColorScorer):
    """Fails its first `fail` calls with an exception (the server answers 500)."""

    def __init__(self, fail):
        super().__init__()
        self.fail, self.calls = fail, 0

    def score(self, images, prompts, metadata):
        self.calls += 1
        if self.calls <= self.fail:
            raise RuntimeError("scorer out of memory")
        return super().score(images, prompts, metadata)


def test_server_errors_are_retried_then_reported():
    imgs, prompts = color_batch()
    batch = ImageBatch.from_any(imgs)
    flaky = FlakyScorer(fail=1)
    with serving(flaky) as url:
        out = RemoteScorer(url, timeout_s=10, max_retries=2, backoff_s=0.01)(batch, prompts, [{}] * 4)
        assert flaky.calls == 2 and torch.isfinite(out["color"][:3]).all()
    broken = FlakyScorer(fail=100)
    with serving(broken) as url:
        with pytest.raises(RewardEndpointError, match="out of memory") as err:
            RemoteScorer(url, timeout_s=10, max_retries=2, backoff_s=0.01)(batch, prompts, [{}] * 4)
        assert url in str(err.value) and "3 attempt" in str(err.value) and broken.calls == 3
        # a malformed request is a 400 and is not retried
        with pytest.raises(RewardEndpointError, match="rejected"):
            RemoteScorer(url, max_retries=5, backoff_s=10)._exchange(b'{"prompts": ["a"], "images": ["%%%"]}')
        # so is a Content-Length that is not a number: answered, not a dropped connection
        import http.client

        host, port = url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.putrequest("POST", "/score")
        conn.putheader("Content-Length", "ten")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and "not an integer" in json.loads(resp.read())["error"]
        conn.close()


class SlowScorer(ColorScorer):
    def score(self, images, prompts, metadata):
        time.sleep(1.0)
        return super().score(images, prompts, metadata)


def test_slow_endpoint_times_out_with_bounded_retries():
    imgs, prompts = color_batch()
    with serving(SlowScorer()) as url:
        t0 = time.monotonic()
        with pytest.raises(RewardEndpointError, match="2 attempt.*timed out") as err:
            client = RemoteScorer(url, timeout_s=0.2, max_retries=1, backoff_s=0.01)
            client(ImageBatch.from_any(imgs), prompts, [{}] * 4)
        assert url in str(err.value) and time.monotonic() - t0 < 1.5


def test_dead_endpoint_fails_fast_naming_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    url = f"http://127.0.0.1:{port}/score"
    imgs, prompts = color_batch()
    t0 = time.monotonic()
    with pytest.raises(RewardEndpointError) as err:
        RewardManager("remote", endpoint=url, remote_max_retries=2, remote_backoff_s=0.05,
                      remote_startup_wait_s=0).score(imgs, prompts)
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert url in msg and "--reward-endpoint" in msg and "3 attempt" in msg
    with pytest.raises(ValueError, match="--reward-endpoint"):
        RemoteScorer("127.0.0.1:8000")


def test_reward_server_cli_in_subprocess():
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "reward_server.py"), "--reward-scorer-path",
         "trainer.rewards.color.ColorScorer", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[-1]
        imgs, prompts = color_batch()
        out = RemoteScorer(url, timeout_s=20, max_retries=0)(ImageBatch.from_any(imgs), prompts, [{}] * 4)
        assert out["color"][0].item() == pytest.approx(1.0)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


# --- tools/score.py ------------------------------------------------------------------------------

def run_score(argv):
    from tools import score

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert score.main(argv) == 0
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def score_fails(argv, match):
    """The tool's bad-input path: exit 2 and one `flowgrpo-score: error:` line on stderr matching `match`."""
    from tools import score

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert score.main(argv) == 2
    line = err.getvalue().strip()
    assert line.startswith("flowgrpo-score: error: ") and "\n" not in line and re.search(match, line), line


def test_score_tool_matches_artifact_names_and_order(tmp_path):
    pal = color_palette()
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": f"a {c} ball", "metadata": {"i": i}}) + "\n"
                                   for i, c in enumerate(("red", "green", "blue"))))
    art = tmp_path / "rollout_3"
    art.mkdir()
    # group 2 (blue) sample 1 is blue; group 0 (red) sample 0 is green
    def save(color, path):
        Image.new("RGB", (8, 8), tuple(int(255 * v) for v in pal[color])).save(path)

    save("blue", art / "group_00000002_sample_0001.png")
    save("green", art / "group_00000000_sample_0000.png")
    rows = run_score(["--reward-scorer-path", "color", "--images", str(art),
                      "--prompt-data", str(prompt_file)])
    assert [(r["image"], r["group"], r["slot"], r["prompt"]) for r in rows] == [
        ("group_00000000_sample_0000.png", 0, 0, "a red ball"),
        ("group_00000002_sample_0001.png", 2, 1, "a blue ball"),
    ]
    assert rows[0]["scores"]["color"] == pytest.approx(math.exp(-4))  # green image, red prompt
    assert rows[1]["scores"]["color"] == pytest.approx(1.0)

    plain = tmp_path / "plain"
    plain.mkdir()
    for name, c in (("b.png", "red"), ("a.png", "green"), ("c.png", "white")):
        save(c, plain / name)
    rows = run_score(["--reward-scorer-path", "trainer.rewards.color.ColorScorer", "--images", str(plain),
                      "--prompt-data", str(prompt_file), "--batch-size", "2"])
    assert [r["image"] for r in rows] == ["a.png", "b.png", "c.png"]  # sorted, paired with lines in order
    assert rows[1]["scores"]["color"] == pytest.approx(math.exp(-4))  # red vs "green": exp(-2 / 0.5)
    (plain / "d.png").write_bytes((plain / "a.png").read_bytes())
    score_fails(["--reward-scorer-path", "trainer.rewards.color.ColorScorer", "--images", str(plain),
                 "--prompt-data", str(prompt_file)], "4 images .* 3 prompts")


def test_score_tool_takes_a_groups_prompt_from_its_sidecar(tmp_path):
    """A training rollout's group index is its place in a shuffled batch, not a prompt-file line:
    the sidecar beside the images names the prompt; a group without one falls back to the line."""
    from tests.test_artifacts import SAMPLING, fake_group
    from trainer import artifacts

    pal = color_palette()
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": f"a {c} ball"}) + "\n" for c in ("red", "green")))
    art = tmp_path / "rollout_7"
    art.mkdir()
    for g in (0, 1):
        Image.new("RGB", (8, 8), tuple(int(255 * v) for v in pal["blue"])).save(art / f"group_{g:08d}_sample_0000.png")
    group = fake_group(0)
    group.prompts[:] = ["a blue ball"] * len(group)
    group.metadata[:] = [{"origin": "sidecar"}] * len(group)
    artifacts.write_group_sidecar(art / "group_00000000.safetensors", group, task="t2i", rollout_id=7,
                                  sampling=SAMPLING)
    rows = run_score(["--reward-scorer-path", "color", "--images", str(art), "--prompt-data", str(prompt_file)])
    assert [(r["group"], r["prompt"]) for r in rows] == [(0, "a blue ball"), (1, "a green ball")]
    assert rows[0]["scores"]["color"] == pytest.approx(1.0)  # blue image, the blue prompt it was sampled for
    score_fails(["--reward-scorer-path", "color", "--images", str(art)], "group_00000001.safetensors.*--prompt-data")
    (art / "group_00000001.safetensors").write_bytes(b"")
    score_fails(["--reward-scorer-path", "color", "--images", str(art), "--prompt-data", str(prompt_file)],
                "group_00000001.safetensors is corrupt")
