"""Network peers are untrusted: the reward server against hostile requests (decompression bombs,
other image formats, malformed JSON, idle and trickling connections, missing tokens, oversized
bodies), the clients against hostile servers (trickled answers, redirects, oversized or malformed
answers), and URLs with credentials kept out of records and logs. Everything on 127.0.0.1."""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import io
import json
import socket
import struct
import threading
import time
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from tools.reward_server import ServerLimits, is_loopback, make_server
from trainer.rewards.base import ImageBatch
from trainer.rewards.color import ColorScorer, color_palette
from trainer.rewards.manager import RewardManager
from trainer.rewards.remote import RemoteScorer, RewardEndpointError
from trainer.rewards.transport import TOKEN_ENV, HttpFailure, exchange
from trainer.rewards.vlm_judge import VlmJudgeScorer

SECRET = "hunter2-secret"


@contextlib.contextmanager
def serving(scorer=None, **kwargs):
    server = make_server(scorer or ColorScorer(), "127.0.0.1", 0, "test.color", **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield "http://%s:%d/score" % server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def batch(n=2):
    pal = color_palette()
    imgs = torch.stack([torch.tensor(pal["red"]).view(3, 1, 1).expand(3, 6, 6)] * n)
    return ImageBatch.from_any(imgs), ["a red kite"] * n, [{}] * n


def post(url, body: bytes, headers=None, timeout=10):
    """(status, decoded JSON answer) of one raw POST; raises if the server dropped the connection."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def request_of(pngs: list[bytes], **extra) -> bytes:
    n = len(pngs)
    body = {"protocol": 1, "prompts": ["a red kite"] * n, "metadata": [{}] * n,
            "images": [base64.b64encode(p).decode() for p in pngs], **extra}
    return json.dumps(body).encode()


def black_png(width: int, height: int) -> bytes:
    """A valid greyscale PNG of black pixels, built row by row so that making it never holds the
    pixels: a few hundred KB for tens of megapixels (a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    comp = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte 0, then one byte per pixel
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, format=fmt)
    return buf.getvalue()


def vm_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def assert_still_serves(url):
    out = RemoteScorer(url, timeout_s=10, max_retries=0)(*batch())
    assert out["color"].tolist() == pytest.approx([1.0, 1.0])


# --- the server -----------------------------------------------------------------------------------

def test_decompression_bombs_are_refused_from_the_header_with_memory_bounded():
    bomb = black_png(8000, 8000)  # 64 Mpx: Pillow alone would decode it (192 MB as RGB)
    assert len(bomb) < 300_000
    per_image_ok = black_png(4000, 4000)  # 16 Mpx each: fits one image, five exceed a request
    with serving() as url:
        peak = vm_kb("VmHWM")
        status, answer = post(url, request_of([bomb]))
        assert status == 413 and "8000x8000" in answer["error"] and "--max-image-pixels" in answer["error"]
        status, answer = post(url, request_of([per_image_ok] * 5))
        assert status == 413 and "--max-request-pixels" in answer["error"]
        assert vm_kb("VmHWM") - peak < 100_000  # KB: nothing was decoded
        assert_still_serves(url)


@pytest.mark.parametrize("fmt", ["TIFF", "BMP", "GIF"])
def test_only_png_is_decoded(fmt):
    with serving() as url:
        status, answer = post(url, request_of([encoded(fmt)]))
        assert status == 400 and f"is {fmt}, not PNG" in answer["error"], answer
        assert_still_serves(url)


@pytest.mark.parametrize("body, needle", [
    (b"[" * 50_000 + b"]" * 50_000, "nests too deeply"),
    (b'{"prompts": [], "images": [], "metadata": 5}', '"metadata" must be a list'),
    (b'{"prompts": ["a"], "images": ["AAAA"], "metadata": [5]}', "metadata 0 must be an object"),
    (b'{"prompts": [1], "images": ["AAAA"]}', "prompt 0 must be a string"),
    (b'{"prompts": ["a"], "images": [7]}', "image 0 must be a base64 string"),
    (b'{"prompts": ["a"], "images": ["AAAA"], "protocol": 1' + b"1" * 5000 + b"}", "not valid JSON"),
    (b'"just a string"', "must be a JSON object"),
    (b'{"prompts": "\xff"}', "not UTF-8"),
])
def test_malformed_requests_get_a_400_answer(body, needle):
    with serving() as url:
        status, answer = post(url, body)  # an answer, not a dropped connection
        assert status == 400 and needle in answer["error"], answer
        assert_still_serves(url)


def test_idle_and_trickling_connections_are_bounded_and_dropped():
    before = threading.active_count()
    limits = ServerLimits(max_connections=4, header_timeout_s=0.5, max_pending_connections=8, request_timeout_s=1.0)
    with serving(limits=limits) as url:
        host, port = url.split("//")[1].split("/")[0].split(":")
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(10)]
        try:
            time.sleep(0.2)
            # serve_forever + the gate: an idle connection holds no handler thread
            assert threading.active_count() <= before + 2
            answers = []
            t0 = time.monotonic()
            for s in socks:
                s.settimeout(3)
                answers.append(s.recv(200))  # dropped: the 2 beyond the 8 pending at once, the rest at 0.5 s
            assert answers == [b""] * 10 and time.monotonic() - t0 < 1.5
        finally:
            for s in socks:
                s.close()
        # a client trickling its headers a byte at a time is dropped at the header deadline too
        s = socket.create_connection((host, int(port)), timeout=5)
        t0 = time.monotonic()
        try:
            for ch in b"POST /score HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                s.sendall(bytes([ch]))
                time.sleep(0.05)
        except OSError:
            pass
        assert time.monotonic() - t0 < 2.0
        s.close()
        # ... and one trickling its body, once admitted, at --request-timeout-s
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"POST /score HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{")
            t0 = time.monotonic()
            s.settimeout(limits.request_timeout_s + 5)
            assert s.recv(200) == b"" and time.monotonic() - t0 < limits.request_timeout_s + 2
        deadline = time.monotonic() + 3
        while threading.active_count() > before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before + 3  # every handler thread ended (the deadline watcher stays)
        assert_still_serves(url)


def test_too_large_body_is_a_413_the_client_reads():
    with serving(max_request_mb=0.01) as url:  # 10 KiB
        big = b"x" * 1_000_000
        with pytest.raises(HttpFailure) as err:  # the raw exchange: the 413 arrives, not a reset
            exchange(url, big, 10)
        assert err.value.status == 413 and "request too large" in str(err.value)
        scorer = RemoteScorer(url, timeout_s=10, max_retries=3, backoff_s=5)
        t0 = time.monotonic()
        with pytest.raises(RewardEndpointError, match="too large") as err:
            scorer._exchange(big)
        assert "running" not in str(err.value) and time.monotonic() - t0 < 5  # not retried
        # an image that no request within the limit the server advertises can carry is refused
        # before it is sent, naming the flag
        imgs = ImageBatch.from_any(torch.rand(4, 3, 64, 64))
        with pytest.raises(RewardEndpointError, match="candidate 0 alone .* bytes, more than the server's "
                                                      "--max-request-mb"):
            scorer(imgs, ["a red kite"] * 4, [{}] * 4)


def test_bearer_token_is_required_when_set(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with serving(token=SECRET) as url:
        status, answer = post(url, request_of([encoded("PNG")]))
        assert status == 401 and TOKEN_ENV in answer["error"]
        status, _ = post(url, request_of([encoded("PNG")]), {"Authorization": "Bearer wrong"})
        assert status == 401
        with pytest.raises(RewardEndpointError, match=f"HTTP 401.*{TOKEN_ENV}.*not set"):
            RemoteScorer(url, timeout_s=5, max_retries=2, backoff_s=5).info()
        monkeypatch.setenv(TOKEN_ENV, SECRET)
        assert_still_serves(url)


def test_a_non_loopback_bind_needs_a_token(monkeypatch, capsys):
    from tools import reward_server

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("")
    assert reward_server.main(["--reward-scorer-path", "color", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0" in err and TOKEN_ENV in err and "--allow-unauthenticated" in err


# --- the clients against hostile servers ---------------------------------------------------------

@contextlib.contextmanager
def raw_server(respond):
    """A TCP server calling respond(conn) for each connection, after reading the request."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def loop():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), 0)
                    while len(rest) < length:
                        rest += conn.recv(65536)
                    respond(conn, head.split(b" ")[0])
                except OSError:
                    pass

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield "http://127.0.0.1:%d/score" % srv.getsockname()[1]
    finally:
        stop.set()
        t.join(5)
        srv.close()


INFO = json.dumps({"protocol": 1, "components": ["color"]}).encode()


def answer(conn, body: bytes, status: str = "200 OK", extra: bytes = b""):
    """Write one HTTP answer to a socket (or a handler's wfile)."""
    (conn.sendall if hasattr(conn, "sendall") else conn.write)(b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def test_a_trickling_server_cannot_hold_the_client_past_its_deadline():
    def trickle(conn, method):
        for ch in b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"1" * 100:
            conn.sendall(bytes([ch]))
            time.sleep(0.05)  # each read returns within any per-read timeout

    with raw_server(trickle) as url:
        t0 = time.monotonic()
        with pytest.raises(RewardEndpointError, match="timed out"):
            RemoteScorer(url, timeout_s=0.5, max_retries=0)._exchange(b"{}")
        assert time.monotonic() - t0 < 1.5  # the deadline, not 50 bytes x 0.05 s x ...


def test_a_redirect_is_an_error_and_not_followed():
    seen = []

    def redirect(conn, method):
        seen.append(method)
        answer(conn, b"", "302 Found", b"Location: http://127.0.0.1:1/elsewhere?token=" + SECRET.encode() + b"\r\n")

    with raw_server(redirect) as url:
        with pytest.raises(RewardEndpointError, match="HTTP 302 redirect") as err:
            RemoteScorer(url, timeout_s=5, max_retries=3, backoff_s=5)._exchange(b"{}")
        msg = str(err.value)
        assert url in msg and SECRET not in msg and seen == [b"POST"]  # no GET, no retry


@pytest.mark.parametrize("body, needle", [
    (b'{"color": [1' + b"0" * 5000 + b", 0.5]}", "not valid JSON"),
    (b'{"color": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nests too deeply"),
    (b'{"color": [' + b"0," * 110_000 + b"0]}", "more than MAX_ANSWER_NODES=100000"),
    (b'{"color": [0.5, 0.5], "bonus": [1, 1]}', "'bonus'"),
    (b'{"color": [0.5]}', "returned 1 values"),
    (b'{"color": [0.5, 0.5]' + b" " * 400_000 + b"}", "exceeds the 300000-byte limit"),
])
def test_malformed_answers_are_counted_failures_naming_the_endpoint(body, needle, caplog):
    def respond(conn, method):
        answer(conn, INFO if method == b"GET" else body)

    with raw_server(respond) as url:
        manager = RewardManager("remote", endpoint=url, remote_max_retries=2, remote_backoff_s=5)
        manager.scorer.max_response_bytes = 300_000
        with caplog.at_level("WARNING", logger="trainer.rewards.remote"):
            t0 = time.monotonic()
            out = manager.score(*batch())
        assert torch.isnan(out.components["color"]).all()
        assert out.failure_metrics() == {"reward/failed_candidates_malformed": 2.0}
        assert time.monotonic() - t0 < 3  # not retried
        assert url in caplog.text and needle in caplog.text, caplog.text


def test_huge_and_non_numeric_scores_fail_only_their_images():
    def respond(conn, method):
        answer(conn, INFO if method == b"GET" else b'{"color": [1' + b"0" * 400 + b", 0.25]}")

    with raw_server(respond) as url:
        out = RemoteScorer(url, timeout_s=5, max_retries=0)(*batch())["color"]
        assert torch.isnan(out[0]) and out[1] == 0.25


def test_judge_answers_are_bounded_and_redirects_not_followed():
    answers = [
        (b"200 OK", b"", json.dumps({"choices": [{"message": {"content": "7"}}]}).encode()),
        (b"302 Found", b"Location: http://127.0.0.1:1/x\r\n", b""),
        (b"200 OK", b"", b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        (b"200 OK", b"", b'{"choices": [{"message": {"content": "' + b"7" * 2_000_000 + b'"}}]}'),
        (b"200 OK", b"", b'{"choices": [{"message": {"content": 7}}]}'),
    ]
    seen = []

    def respond(conn, method):
        seen.append(method)
        status, extra, body = answers.pop(0)
        answer(conn, body, status.decode(), extra)

    with raw_server(respond) as url:
        judge = VlmJudgeScorer(reward_judge_endpoint=url, reward_judge_max_concurrency=1,
                               reward_judge_max_retries=2, reward_judge_timeout_s=5)
        judge.backoff_s = 5
        imgs = ImageBatch([np.zeros((4, 4, 3), np.uint8)] * 5)
        t0 = time.monotonic()
        out = judge(imgs, ["a cat"] * 5, [{}] * 5)["vlm_judge"]
        assert time.monotonic() - t0 < 4  # nothing retried
    assert out[0] == pytest.approx(0.7) and torch.isnan(out[1:]).all()
    assert judge.pop_failures() == {"http": 1, "malformed": 3} and seen == [b"POST"] * 5


# --- secrets -------------------------------------------------------------------------------------

def test_urls_lose_their_credentials_in_records_and_logs(tmp_path, capsys, monkeypatch):
    from trainer.config import load_config
    from trainer.core.redact import redact_url
    from trainer.loop import RunError, Trainer, build_reward_manager
    from trainer.metrics import MetricsLogger
    from trainer.sampling import SamplingConfig
    from trainer.train import main as train_main

    url = f"http://user:{SECRET}@127.0.0.1:9/score?token={SECRET}"
    assert redact_url(url) == "http://REDACTED@127.0.0.1:9/score?REDACTED"
    flags = ["--reward-runtime", "remote", "--reward-endpoint", url, "--artifact-root", str(tmp_path / "art"),
             "--reward-judge-endpoint", f"https://judge.local/v1/chat?key={SECRET}"]
    cfg = load_config(flags)
    # the recipe record
    fake = SimpleNamespace(rank=0, cfg=cfg, recipe_name="r", sampling=SamplingConfig(), num_groups=1, world=1)
    record = Trainer.write_recipe_record(fake)
    text = record.read_text()
    assert SECRET not in text and "http://REDACTED@127.0.0.1:9/score?REDACTED" in text
    # TensorBoard's run text
    MetricsLogger(tmp_path / "tb", run_name="r").log_run(0, "r", cfg.to_dict())
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").rglob("events*"))
    assert b"127.0.0.1:9/score" in events and SECRET.encode() not in events
    # --preflight-only's printed config
    train_main(["--preflight-only", *flags])
    assert SECRET not in capsys.readouterr().out
    # the start-up error for an endpoint that refuses the request
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with serving(token="other") as live:
        port = live.split(":")[2].split("/")[0]
        cfg = load_config(["--reward-runtime", "remote", "--reward-endpoint",
                           f"http://user:{SECRET}@127.0.0.1:{port}/score?token={SECRET}"])
        with pytest.raises(RunError) as err:
            build_reward_manager(cfg.reward, "cpu")
    assert "HTTP 401" in str(err.value) and SECRET not in str(err.value) and f"127.0.0.1:{port}" in str(err.value)



def test_url_userinfo_is_sent_as_basic_auth_and_a_token_wins(monkeypatch):
    headers = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            headers.append(self.headers.get("Authorization"))
            answer(self.wfile, INFO)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        url = f"http://user:p%40ss@127.0.0.1:{server.server_address[1]}/score"
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        RemoteScorer(url, timeout_s=5, max_retries=0).info()
        monkeypatch.setenv(TOKEN_ENV, SECRET)
        RemoteScorer(url, timeout_s=5, max_retries=0).info()
    finally:
        server.shutdown()
        server.server_close()
    assert headers == ["Basic " + base64.b64encode(b"user:p@ss").decode(), f"Bearer {SECRET}"]
