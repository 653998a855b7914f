"""Serve any reward scorer over HTTP, for --reward-runtime remote.

    FLOWGRPO_REWARD_TOKEN=... python tools/reward_server.py --reward-scorer-path pickscore \
        --reward-model-path /models/PickScore_v1 --host 10.0.0.5 --port 8000 --device cuda:0

then train with --reward-runtime remote --reward-endpoint http://10.0.0.5:8000/score and the same
FLOWGRPO_REWARD_TOKEN in the trainer's environment. The protocol is documented in
trainer/rewards/remote.py (and docs/rewards.md); deployment advice and every limit in
docs/security.md. Standard library http.server only; requests are scored one at a time (scorers
need not be thread-safe), while GETs (health / info) are answered concurrently. --port 0 picks a
free port; the first line on stdout is always "listening on http://HOST:PORT/score".

What a peer can make this server hold is bounded. Until its request line and headers are in
(within --header-timeout-s) and carry the token, a connection is one of at most
--max-pending-connections held by one thread, never a handler slot, so idle or unauthenticated
peers cannot crowd out the trainer. Then: --max-connections handler threads (more requests are
answered 503), each with its request body (--max-request-mb) which must arrive within
--request-timeout-s, and --max-decodes requests decoded or scored at once, each at most
--max-request-pixels, --max-request-images or --max-request-frames and --max-json-nodes (counted
before the body is parsed; every PNG's size is read from its header before anything is decoded;
other image formats are refused).
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import io
import ipaddress
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, run_tool, tool_parser  # noqa: E402
from trainer.rewards.base import SHIPPED_SCORERS, build_scorer, check_scores  # noqa: E402
from trainer.rewards.remote import (PROTOCOL_VERSION, RequestError, RequestLimits, decode_request,  # noqa: E402
                                    encode_response)
from trainer.rewards.transport import TOKEN_ENV  # noqa: E402

log = logging.getLogger("reward_server")

#: after refusing a request early (401, 413), how long / how much of its body is read and dropped,
#: so that the client finishes sending and reads the answer instead of a connection reset
DRAIN_SECONDS = 5.0
DRAIN_MAX_BYTES = 1 << 30
#: a request line and headers longer than this are answered 431 (http.server's own limits are a
#: 64 KiB line and 100 headers; an honest request's head is a few hundred bytes)
MAX_HEADER_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The server's resource bounds (the flags of the same names; docs/security.md)."""

    #: largest request body, in MiB; a batch of 32 PNGs at 512x512 is ~15 MB
    max_request_mb: float = 64.0
    #: pixels of one image, and of all the images of one request
    max_image_pixels: int = RequestLimits.max_image_pixels
    max_request_pixels: int = RequestLimits.max_request_pixels
    #: requests decoded or scored at once: their decoded pixels are what is in memory
    max_decodes: int = 2
    #: requests read, decoded or scored at once (one handler thread each), counted once their
    #: headers carry the token; more are answered 503
    max_connections: int = 32
    #: seconds in which a request (line, headers, body) must arrive; an idle or trickling
    #: connection is dropped then
    request_timeout_s: float = 30.0
    #: seconds in which a new connection's request line and headers must arrive
    header_timeout_s: float = 10.0
    #: connections whose headers have not arrived yet, held by one thread; beyond it the
    #: longest-waiting is dropped
    max_pending_connections: int = 256
    #: images (edit source images included) and video frames of one request; JSON values of its body
    max_request_images: int = RequestLimits.max_request_images
    max_request_frames: int = RequestLimits.max_request_frames
    max_json_nodes: int = RequestLimits.max_json_nodes

    def check(self) -> None:
        """ValueError naming the flag of a bound that is not positive."""
        for name in ("max_request_mb", "max_image_pixels", "max_request_pixels", "max_decodes", "max_connections",
                     "request_timeout_s", "header_timeout_s", "max_pending_connections", "max_request_images",
                     "max_request_frames", "max_json_nodes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


class _Reaper:
    """Shuts down connections whose request has not arrived by its deadline: one thread for all
    of them. A per-read socket timeout alone lets a client that trickles a byte at a time hold
    its handler thread forever."""

    def __init__(self) -> None:
        self._deadlines: dict[socket.socket, float] = {}
        self._cv = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._cv:
            self._deadlines[sock] = time.monotonic() + seconds
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="reward-server-reaper", daemon=True)
                self._thread.start()
            self._cv.notify()

    def disarm(self, sock: socket.socket) -> None:
        with self._cv:
            self._deadlines.pop(sock, None)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                now = time.monotonic()
                for sock in [s for s, t in self._deadlines.items() if t <= now]:
                    del self._deadlines[sock]
                    try:  # the handler's blocked read returns: it closes the connection
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                nearest = min(self._deadlines.values(), default=None)
                self._cv.wait(None if nearest is None else max(nearest - now, 0.01))


class _Prefixed(io.RawIOBase):
    """A connection's bytes that the gate already read (request line, headers, perhaps the start
    of the body), then the socket itself: what the handler reads its request from."""

    def __init__(self, prefix: bytes, sock: socket.socket):
        self._prefix = memoryview(prefix)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._prefix:
            n = min(len(buffer), len(self._prefix))
            buffer[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            return n
        return self._sock.recv_into(buffer)


@dataclasses.dataclass
class _Waiting:
    """A connection the gate holds: its bytes so far, and what it waits for until `deadline`
    (its headers while `drain` is None, else the `drain` body bytes still to discard)."""

    sock: socket.socket
    address: Any
    deadline: float
    buf: bytearray
    drain: int | None = None


def _header_end(buf: bytearray, start: int = 0) -> int:
    """Index just past the blank line that ends the headers, searched from `start` (where the
    newest bytes begin, less the separator's length, so that a peer sending a byte at a time costs
    linear time, not quadratic), or -1 while it has not arrived."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep, start)) >= 0]
    return min(ends, default=-1)


def _header(head: bytes, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case) in a request head, stripped."""
    for line in head.split(b"\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


class _Gate:
    """Holds every new connection until its request line and headers are in: one thread and one
    selector for all of them, so an idle or unauthenticated peer costs a file descriptor and at
    most MAX_HEADER_BYTES, never one of the --max-connections handler threads.

    Headers that carry the token (any, when the server has none) get a handler slot, or a 503
    when every slot is taken; headers without it are answered 401 here. Headers that do not
    arrive within --header-timeout-s drop the connection, and beyond --max-pending-connections
    the longest-waiting connection is dropped: an honest client sends its headers with the
    connection, so it is never the one waiting longest."""

    def __init__(self, server: "_BoundedServer", header_timeout_s: float, max_pending: int):
        self.server = server
        self.header_timeout_s = header_timeout_s
        self.max_pending = max_pending
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._incoming: list[tuple[socket.socket, Any]] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._waiting: dict[socket.socket, _Waiting] = {}  # insertion order: longest-waiting first
        self._thread = threading.Thread(target=self._run, name="reward-server-gate", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, address: Any) -> None:
        with self._lock:
            self._incoming.append((sock, address))
        self._wake()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake()
        self._thread.join(5)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # the buffer is full: the gate is awake already
            pass

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    incoming, self._incoming, stopped = self._incoming, [], self._stopped
                for sock in [s for s, _ in incoming] if stopped else ():
                    sock.close()
                if stopped:
                    break
                for sock, address in incoming:
                    self._hold(sock, address)
                now = time.monotonic()
                for w in [w for w in self._waiting.values() if w.deadline <= now]:
                    self._drop(w)
                nearest = min((w.deadline for w in self._waiting.values()), default=None)
                for key, _ in self._selector.select(None if nearest is None else max(nearest - now, 0.01)):
                    if key.fileobj is self._wake_r:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                    elif key.fileobj in self._waiting:
                        self._readable(key.data)
        finally:
            for w in list(self._waiting.values()):
                self._drop(w)
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _hold(self, sock: socket.socket, address: Any) -> None:
        if len(self._waiting) >= self.max_pending:
            self._drop(next(iter(self._waiting.values())))
        w = _Waiting(sock, address, time.monotonic() + self.header_timeout_s, bytearray())
        try:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, w)
        except (OSError, ValueError):
            sock.close()
            return
        self._waiting[sock] = w

    def _drop(self, w: _Waiting) -> None:
        self._waiting.pop(w.sock, None)
        try:
            self._selector.unregister(w.sock)
        except (KeyError, ValueError):
            pass
        w.sock.close()

    def _readable(self, w: _Waiting) -> None:
        try:
            chunk = w.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            return self._drop(w)
        if not chunk:
            return self._drop(w)
        if w.drain is not None:
            w.drain -= len(chunk)
            if w.drain <= 0:
                self._drop(w)
            return
        w.buf += chunk
        end = _header_end(w.buf, max(0, len(w.buf) - len(chunk) - 3))
        if end < 0:
            if len(w.buf) > MAX_HEADER_BYTES:
                self._refuse(w, 431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes", 0, 0)
            return
        head = bytes(w.buf[:end])
        raw_length = _header(head, b"content-length") or b"0"
        length = int(raw_length) if raw_length.isdigit() else 0
        if not self.server.authorized(_header(head, b"authorization")):
            return self._refuse(w, 401, self.server.unauthorized_message, length, len(w.buf) - end)
        if not self.server.take_slot():
            return self._refuse(w, 503, "the reward server is at --max-connections; retry later", length,
                                len(w.buf) - end)
        self._waiting.pop(w.sock)
        self._selector.unregister(w.sock)
        w.sock.setblocking(True)
        try:
            self.server.handle_admitted(w.sock, w.address, bytes(w.buf))
        except Exception:  # noqa: BLE001 - no thread for it (the host's limit): that connection only
            log.error("could not start a handler:\n%s", traceback.format_exc())

    def _refuse(self, w: _Waiting, status: int, message: str, length: int, already: int) -> None:
        """Answer at once, then read and drop the rest of the body (bounded, as _refuse in the
        handler does) so that the client reads this answer rather than a reset connection."""
        body = json.dumps({"error": message}).encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
                f"Connection: close\r\nContent-Length: {len(body)}\r\n"
                + ("Retry-After: 1\r\n" if status == 503 else "") + "\r\n").encode()
        try:
            w.sock.send(head + body)
        except OSError:
            return self._drop(w)
        w.drain = min(length, DRAIN_MAX_BYTES) - already
        w.deadline = time.monotonic() + DRAIN_SECONDS
        if w.drain <= 0:
            self._drop(w)


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer whose connections wait in the _Gate until their headers are in and
    authorized, and then run in at most `max_connections` handler threads (one request each)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: socketserver's 5 makes a burst of ranks wait for SYN retries

    def __init__(self, address: tuple[str, int], handler: type, limits: ServerLimits, expected: bytes | None,
                 unauthorized_message: str):
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._expected = expected
        self.unauthorized_message = unauthorized_message
        self._prefixes: dict[socket.socket, bytes] = {}
        self.reaper = _Reaper()
        super().__init__(address, handler)
        self.gate = _Gate(self, limits.header_timeout_s, limits.max_pending_connections)

    def server_close(self) -> None:
        super().server_close()
        self.gate.stop()
        self.reaper.stop()

    def authorized(self, given: bytes | str | None) -> bool:
        """Whether an Authorization header value carries the token (always, without one)."""
        if self._expected is None:
            return True
        if isinstance(given, str):
            given = given.encode("utf-8", "replace")
        return hmac.compare_digest(given or b"", self._expected)

    def take_slot(self) -> bool:
        return self._slots.acquire(blocking=False)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        self.gate.add(request, client_address)

    def handle_admitted(self, request: socket.socket, client_address: Any, prefix: bytes) -> None:
        """A handler thread for a connection the gate admitted (its slot taken), which reads
        the request from `prefix` (what the gate read) and then the socket."""
        self._prefixes[request] = prefix
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._prefixes.pop(request, None)
            self._slots.release()
            self.shutdown_request(request)
            raise

    def take_prefix(self, request: socket.socket) -> bytes:
        return self._prefixes.pop(request, b"")

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ("" and 0.0.0.0 are not)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def make_server(
    scorer: Any, host: str = "127.0.0.1", port: int = 0, scorer_path: str = "", max_request_mb: float | None = None,
    *, limits: ServerLimits | None = None, token: str | None = None,
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for `scorer`; call serve_forever() / shutdown().

    `limits` bounds what peers can make it hold (`max_request_mb` overrides its body limit);
    with `token`, every request must carry ``Authorization: Bearer <token>`` (else 401)."""
    limits = limits or ServerLimits()
    if max_request_mb is not None:
        limits = ServerLimits(**{**limits.__dict__, "max_request_mb": float(max_request_mb)})
    limits.check()
    request_limits = RequestLimits(limits.max_image_pixels, limits.max_request_pixels, limits.max_request_images,
                                   limits.max_request_frames, limits.max_json_nodes)
    tracks = tuple(getattr(scorer, "required_tracks", ("image",)))
    if tracks not in (("image",), ("video",)):
        raise ValueError(f"the scorer's required_tracks {tracks} is neither ('image',) nor ('video',)")
    lock = threading.Lock()
    decodes = threading.BoundedSemaphore(limits.max_decodes)
    max_bytes = int(limits.max_request_mb * 1024 * 1024)
    info = json.dumps({
        "protocol": PROTOCOL_VERSION,
        "scorer": scorer_path or type(scorer).__module__ + "." + type(scorer).__qualname__,
        "components": list(scorer.components),
        "required_tracks": list(tracks),
        # decode_request hands edit sources to the scorer, with "images" only (trainer/rewards/remote.py)
        "source_images": tracks == ("image",),
        "limits": {"max_request_bytes": max_bytes, "max_image_pixels": limits.max_image_pixels,
                   "max_request_pixels": limits.max_request_pixels, "max_request_images": limits.max_request_images,
                   "max_request_frames": limits.max_request_frames, "max_json_nodes": limits.max_json_nodes},
    }).encode()
    expected = f"Bearer {token}".encode() if token else None
    unauthorized = (f"missing or wrong bearer token: this server requires the token in {TOKEN_ENV}; set the "
                    "same variable in the client's environment")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = limits.request_timeout_s  # per socket operation (StreamRequestHandler.setup)

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the socket's own reader would miss what the gate already read
            self.rfile = io.BufferedReader(_Prefixed(self.server.take_prefix(self.connection), self.connection))

        def handle(self) -> None:
            # one request per connection: a kept-alive connection would hold its slot while idle
            self.close_connection = True
            self.handle_one_request()

        def handle_one_request(self) -> None:
            # the whole request (line, headers, body) must arrive within --request-timeout-s
            self.server.reaper.arm(self.connection, limits.request_timeout_s)
            try:
                super().handle_one_request()
            finally:
                self.server.reaper.disarm(self.connection)

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"error": message}).encode())

        def _refuse(self, code: int, message: str, unread: int) -> None:
            """Answer before reading the body, then read and drop it (bounded), so the client
            gets this answer rather than a reset connection."""
            self.server.reaper.disarm(self.connection)
            self._send(code, json.dumps({"error": message}).encode())
            end = time.monotonic() + DRAIN_SECONDS
            left = min(max(unread, 0), DRAIN_MAX_BYTES)
            try:
                while left > 0 and time.monotonic() < end:
                    self.connection.settimeout(max(0.05, end - time.monotonic()))
                    chunk = self.rfile.read1(min(left, 1 << 16))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                pass

        def _authorized(self) -> bool:  # the gate checked the raw header; this is http.server's parse of it
            return self.server.authorized(self.headers.get("Authorization"))

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            self.server.reaper.disarm(self.connection)
            if not self._authorized():
                return self._refuse(401, unauthorized, 0)
            self._send(200, info)

        def do_POST(self) -> None:  # noqa: N802
            try:
                self._post()
            except Exception as e:  # noqa: BLE001 - a request must get an answer, never a dropped connection
                log.error("request failed:\n%s", traceback.format_exc())
                try:
                    self._error(500, f"{type(e).__name__}: {e}")
                except OSError:
                    pass

        def _post(self) -> None:
            raw_length = self.headers.get("Content-Length")
            try:
                length = int(raw_length or 0)
            except ValueError:  # unanswered, the client would see a dropped connection and retry it
                return self._refuse(400, f"Content-Length {raw_length[:50]!r} is not an integer", 0)
            if not self._authorized():
                return self._refuse(401, unauthorized, length)
            if length <= 0:
                return self._refuse(411, "a POST needs a JSON body with Content-Length", 0)
            if length > max_bytes:
                return self._refuse(413, f"request too large: {length} bytes exceeds --max-request-mb="
                                         f"{limits.max_request_mb:g} ({max_bytes} bytes); send fewer images per "
                                         "request or raise the server's --max-request-mb", length)
            body = self.rfile.read(length)
            self.server.reaper.disarm(self.connection)  # the request is in: scoring takes what it takes
            if len(body) < length:
                self.close_connection = True
                return
            # decoded pixels are what grows memory: only --max-decodes requests hold them at once
            with decodes:
                try:
                    images, prompts, metadata = decode_request(body, request_limits, tracks[0])
                except RequestError as e:
                    return self._error(e.status, str(e))
                del body
                try:
                    with lock:
                        scores = scorer.score(images, prompts, metadata)
                    answer = encode_response(check_scores(scores, len(images), f"scorer {scorer_path}"))
                except Exception as e:  # noqa: BLE001 - the scorer's failure is the client's 500
                    log.error("scoring failed:\n%s", traceback.format_exc())
                    return self._error(500, f"{type(e).__name__}: {e}")
            self._send(200, answer)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

    return _BoundedServer((host, port), Handler, limits, expected, unauthorized)


def check_bind(host: str, token: str | None, allow_unauthenticated: bool) -> None:
    """ToolError when `host` is reachable from other machines and nothing authenticates requests."""
    if token or allow_unauthenticated or is_loopback(host):
        return
    raise ToolError(
        f"--host {host or '(all interfaces)'} is reachable from other machines and {TOKEN_ENV} is not set, so "
        f"anyone who can reach the port could use this scorer and its device. Set {TOKEN_ENV} to a secret in the "
        "environment of this server and of the trainer, or pass --allow-unauthenticated on a network only you "
        "use (docs/security.md)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ServerLimits()
    p = tool_parser("reward_server", __doc__.split("\n\n")[0])
    p.add_argument(
        "--reward-scorer-path", required=True,
        help="dotpath of a scorer class or function, or a shipped short name "
             f"({', '.join(sorted(SHIPPED_SCORERS))}); a dotpath names code that is imported and run",
    )
    p.add_argument("--reward-model-path", default=None, type=existing_dir,
                   help="local model directory for scorers that need weights")
    p.add_argument("--host", default="127.0.0.1",
                   help=f"interface to bind; anything but loopback needs {TOKEN_ENV} set or --allow-unauthenticated")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    p.add_argument(
        "--device", default="cpu", help='the device the scorer is built on and scores on: "cpu" or a torch device '
                                        "such as cuda:0"
    )
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help=f"serve a non-loopback --host without {TOKEN_ENV} (a network only you use)")
    p.add_argument("--max-request-mb", type=float, default=d.max_request_mb,
                   help="largest request body in MiB (> 0); larger requests are answered 413")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="largest image, width x height (> 0), read from the PNG header before decoding")
    p.add_argument("--max-request-pixels", type=int, default=d.max_request_pixels,
                   help="pixels of all images of one request together (> 0)")
    p.add_argument("--max-decodes", type=int, default=d.max_decodes,
                   help="requests decoded or scored at once (> 0); each holds up to --max-request-pixels x 3 bytes")
    p.add_argument("--max-request-images", type=int, default=d.max_request_images,
                   help="images of one request, edit source images included (> 0); clients split larger batches")
    p.add_argument("--max-request-frames", type=int, default=d.max_request_frames,
                   help="video frames of one request, all videos together (> 0); clients split larger batches")
    p.add_argument("--max-json-nodes", type=int, default=d.max_json_nodes,
                   help="JSON values of one request body (> 0), counted before it is parsed")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="requests handled at once, one thread each (> 0), counted once their headers carry the "
                        "token; more are answered 503 and retried by the client; at least the number of training "
                        "ranks that score here")
    p.add_argument("--max-pending-connections", type=int, default=d.max_pending_connections,
                   help="connections whose request line and headers have not arrived yet (> 0), all held by one "
                        "thread; beyond it the longest-waiting is dropped")
    p.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                   help="seconds in which a new connection's request line and headers must arrive (> 0)")
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                   help="seconds in which a whole request must arrive (> 0); slower or idle connections are dropped")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool("reward_server", lambda: _serve(args))


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
    try:
        limits.check()
    except ValueError as e:
        raise ToolError(str(e)) from None
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token, args.allow_unauthenticated)
    if not is_loopback(args.host) and not token:
        log.warning("serving %s without a token (--allow-unauthenticated): anyone who can reach the port can "
                    "use this scorer", args.host or "all interfaces")
    try:
        scorer = build_scorer(args.reward_scorer_path, args.reward_model_path, args.device)
    except (ValueError, TypeError) as e:  # an unknown scorer name or class: the message names the flag
        raise ToolError(str(e)) from None
    server = make_server(scorer, args.host, args.port, args.reward_scorer_path, limits=limits, token=token)
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}/score", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
