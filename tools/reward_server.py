"""Serve any reward scorer over HTTP, for --reward-runtime remote.

    python tools/reward_server.py --reward-scorer-path trainer.rewards.pickscore.PickScoreScorer \
        --reward-model-path /models/PickScore_v1 --host 0.0.0.0 --port 8000 --device cuda:0

then train with --reward-runtime remote --reward-endpoint http://<host>:8000/score.
The protocol is documented in trainer/rewards/remote.py (and docs/rewards.md). Standard library
http.server only; requests are scored one at a time (scorers need not be thread-safe), while
GETs (health / info) are answered concurrently. --port 0 picks a free port; the first line on
stdout is always "listening on http://HOST:PORT/score".
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pathlib import Path

if __package__ in (None, ""):  # run as a script: this checkout's trainer, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import ToolError, existing_dir, run_tool, tool_parser  # noqa: E402
from trainer.rewards.base import SHIPPED_SCORERS, build_scorer, check_scores  # noqa: E402
from trainer.rewards.remote import PROTOCOL_VERSION, decode_request, encode_response  # noqa: E402

log = logging.getLogger("reward_server")


def make_server(
    scorer: Any, host: str = "127.0.0.1", port: int = 0, scorer_path: str = "", max_request_mb: float = 512.0
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) for `scorer`; call serve_forever() / shutdown()."""
    lock = threading.Lock()
    info = json.dumps({
        "protocol": PROTOCOL_VERSION,
        "scorer": scorer_path or type(scorer).__module__ + "." + type(scorer).__qualname__,
        "components": list(scorer.components),
        "required_tracks": list(getattr(scorer, "required_tracks", ("image",))),
    }).encode()
    max_bytes = int(max_request_mb * 1024 * 1024)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, message: str) -> None:
            self._send(code, json.dumps({"error": message}).encode())

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            self._send(200, info)

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:  # unanswered, the client would see a dropped connection and retry it
                return self._error(400, f"Content-Length {self.headers.get('Content-Length')!r} is not an integer")
            if length <= 0:
                return self._error(411, "a POST needs a JSON body with Content-Length")
            if length > max_bytes:
                return self._error(413, f"request of {length} bytes exceeds --max-request-mb={max_request_mb}")
            try:
                images, prompts, metadata = decode_request(self.rfile.read(length))
            except ValueError as e:
                return self._error(400, str(e))
            try:
                with lock:
                    scores = scorer.score(images, prompts, metadata)
                body = encode_response(check_scores(scores, len(images), f"scorer {scorer_path}"))
            except Exception as e:
                log.error("scoring failed:\n%s", traceback.format_exc())
                return self._error(500, f"{type(e).__name__}: {e}")
            self._send(200, body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tool_parser("reward_server", __doc__.split("\n\n")[0])
    p.add_argument(
        "--reward-scorer-path", required=True,
        help="dotpath of a scorer class or function, or a shipped short name "
             f"({', '.join(sorted(SHIPPED_SCORERS))})",
    )
    p.add_argument("--reward-model-path", default=None, type=existing_dir,
                   help="local model directory for scorers that need weights")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    p.add_argument(
        "--device", default="cpu", help='the device the scorer is built on and scores on: "cpu" or a torch device '
                                        "such as cuda:0"
    )
    p.add_argument("--max-request-mb", type=float, default=512.0, help="largest accepted request body")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_tool("reward_server", lambda: _serve(args))


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        scorer = build_scorer(args.reward_scorer_path, args.reward_model_path, args.device)
    except (ValueError, TypeError) as e:  # an unknown scorer name or class: the message names the flag
        raise ToolError(str(e)) from None
    server = make_server(scorer, args.host, args.port, args.reward_scorer_path, args.max_request_mb)
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
