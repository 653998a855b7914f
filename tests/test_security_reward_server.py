"""The reward server's slots and counts held against peers, through the real tool on 127.0.0.1:
idle or unauthenticated connections cannot crowd out the trainer, and a request's images,
frames and JSON values are bounded before they cost time or memory."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.test_security_network import serving
from tools.reward_server import ServerLimits
from trainer.rewards.base import ImageBatch
from trainer.rewards.remote import RemoteScorer
from trainer.rewards.transport import TOKEN_ENV
from trainer.rewards.video import TemporalConsistencyScorer

REPO = Path(__file__).resolve().parents[1]
TOKEN = "reward-server-test-token"


@contextlib.contextmanager
def cli_server(*flags: str):
    """tools/reward_server.py in a subprocess with the token set; yields (url, pid)."""
    env = {**os.environ, TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "reward_server.py"), "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        yield line.split()[-1], proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def post(url: str, body: bytes, token: str | None = TOKEN, timeout: float = 30) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        conn.request("POST", "/score", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def png_b64(w: int = 1, h: int = 1) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def peak_rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise KeyError("VmHWM")


def red_batch(n: int = 2):
    return ImageBatch.from_any(torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1).expand(n, 3, 6, 6)), \
        ["a red kite"] * n, [{}] * n


def test_idle_and_unauthenticated_connections_hold_no_slot(monkeypatch):
    """More idle connections than --max-connections, and unauthenticated requests that never
    send their body, do not delay an authenticated request: they wait at the gate, not in a slot."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with cli_server("--reward-scorer-path", "color", "--max-connections", "32") as (url, _):
        host, port = url.split("//")[1].split("/")[0].split(":")
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(48)]
        # unauthenticated heads announcing a body they never send: answered 401 at once, slot-free
        stalled = []
        for _ in range(8):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            stalled.append(s)
        try:
            for s in stalled:
                assert s.recv(100).startswith(b"HTTP/1.1 401")
            t0 = time.monotonic()
            scorer = RemoteScorer(url, timeout_s=10, max_retries=0)
            out = scorer(*red_batch())
            assert out["color"].tolist() == pytest.approx([1.0, 1.0]) and time.monotonic() - t0 < 3
            # the whole batch of a run's ranks at once, all while the idle sockets stay open
            with ThreadPool(16) as pool:
                results = pool.map(lambda _: RemoteScorer(url, timeout_s=10, max_retries=0)(*red_batch()), range(16))
            assert all(r["color"].tolist() == pytest.approx([1.0, 1.0]) for r in results)
            assert time.monotonic() - t0 < 8
        finally:
            for s in idle + stalled:
                s.close()


def test_counts_are_bounded_before_time_or_memory_is_spent(monkeypatch):
    """100k 1x1 PNGs (9.6 MiB), 300 of them, and 63 MiB of `{}` are each refused (413, naming
    the flag) within seconds, and the server's peak memory stays within the body's own size."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    one = png_b64()
    many = json.dumps({"prompts": [f"p{i}" for i in range(100_000)], "images": [one] * 100_000}).encode()
    assert 8 << 20 < len(many) < 12 << 20
    empties = b"[" + b"{}," * (21 << 20) + b"{}]"
    with cli_server("--reward-scorer-path", "color") as (url, pid):
        before = peak_rss_kb(pid)
        for body, flag in ((many, "--max-json-nodes=100000"), (empties, "--max-json-nodes=100000"),
                           (json.dumps({"prompts": ["a"] * 300, "images": [one] * 300}).encode(),
                            "--max-request-images=256")):
            t0 = time.monotonic()
            status, answer = post(url, body)
            assert status == 413 and flag in answer["error"], answer
            assert time.monotonic() - t0 < 5
        # the body itself (63 MiB, read once) and little else: not the 1.6 GB a parse would take
        assert peak_rss_kb(pid) - before < 2 * len(empties) // 1024
        info = RemoteScorer(url, max_retries=0).info()["limits"]
        assert (info["max_request_images"], info["max_request_frames"], info["max_json_nodes"]) == (256, 4096, 100_000)
        ok = json.dumps({"prompts": ["a red kite"] * 256, "images": [one] * 256}).encode()
        assert post(url, ok)[0] == 200  # at the limit


def test_frames_are_bounded_per_request():
    frame = png_b64()
    limits = ServerLimits(max_request_frames=64)
    with serving(TemporalConsistencyScorer(), limits=limits) as url:
        for frames, flag in ((200_000, "--max-json-nodes"), (65, "--max-request-frames=64")):
            body = json.dumps({"prompts": ["a"], "videos": [[frame] * frames]}).encode()
            tracemalloc.start()
            t0 = time.monotonic()
            try:
                status, answer = post(url, body, token=None)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert status == 413 and flag in answer["error"], answer
            assert time.monotonic() - t0 < 5 and peak < len(body) + (16 << 20)
        body = json.dumps({"prompts": ["a", "b"], "videos": [[frame] * 32] * 2}).encode()
        assert post(url, body, token=None)[0] == 200


def test_clip_text_dedup_is_linear_in_distinct_prompts():
    from trainer.rewards.clip import ClipEmbedder

    class Tokenizer:
        def __call__(self, texts, **_):
            return {"input_ids": torch.zeros(len(texts), 2, dtype=torch.long),
                    "attention_mask": torch.ones(len(texts), 2, dtype=torch.long)}

    class Model:
        def get_text_features(self, input_ids, attention_mask):
            return torch.ones(len(input_ids), 4)

    sim = ClipEmbedder.__new__(ClipEmbedder)
    sim.tokenizer, sim.model, sim.device, sim._max_len = Tokenizer(), Model(), "cpu", 77
    prompts = [f"prompt {i}" for i in range(50_000)] * 2
    t0 = time.monotonic()
    feats, rows = sim.text(prompts)
    assert time.monotonic() - t0 < 5  # list.index took minutes here
    assert feats.shape == (50_000, 4) and rows[:3].tolist() == [0, 1, 2] and rows[50_000].item() == 0
