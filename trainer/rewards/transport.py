"""One HTTP exchange with a reward peer (the reward server, a VLM judge), bounded in time and size.

A network peer is untrusted input (docs/security.md), so an exchange:

- has ONE deadline for everything (connect, send, status line, headers, body): a watchdog shuts the
  socket down when it passes, so a peer trickling a byte a second cannot hold a rank past it (a
  socket timeout alone bounds each read, not their sum);
- reads at most `max_response_bytes` of body (MAX_RESPONSE_BYTES: a batch's scores are a few KB);
- follows no redirect: a 3xx is an error naming the endpoint (following one turned a POST into a
  GET whose answer would have been trained on);
- sends ``Authorization: Bearer <token>`` when a token is given (read from the environment by the
  callers, so it reaches no log or record); without one, a URL's ``user:password@`` is sent as
  HTTP Basic authentication (and redacted wherever the URL is shown).

`loads_bounded` parses a JSON answer turning RecursionError (deep nesting) and the
int-too-long ValueError into one ValueError that says what was wrong, and, given a node limit,
refuses a body with more JSON values than that before parsing it (`json_nodes`): a body of `{},`
repeated is 3 bytes a value on the wire and about 60 parsed.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from trainer.core.redact import redact_url

#: environment variable holding the reward server's bearer token (server and client alike)
TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
#: environment variable holding the VLM judge's API key (vLLM / SGLang `--api-key`)
JUDGE_TOKEN_ENV = "FLOWGRPO_JUDGE_TOKEN"
#: largest answer body read from a peer; a batch of 32 scores is < 4 KB, a judge's answer < 64 KB
MAX_RESPONSE_BYTES = 16 * 1024 * 1024

_CHUNK = 64 * 1024


class HttpFailure(Exception):
    """An exchange that produced no usable answer.

    kind: "timeout" | "connection" (both retryable), "http" (a 4xx / 5xx status; retryable when
    429 or 5xx), "redirect" (a 3xx), "malformed" (an answer too large or not HTTP).
    """

    def __init__(self, kind: str, detail: str, status: int | None = None):
        super().__init__(detail)
        self.kind, self.status = kind, status

    @property
    def retryable(self) -> bool:
        """Worth another attempt: a 4xx, a redirect or a malformed answer repeats itself."""
        if self.kind == "http":
            return self.status == 429 or (self.status or 0) >= 500
        return self.kind in ("timeout", "connection")


def exchange(
    url: str,
    data: bytes | None,
    timeout_s: float,
    *,
    token: str | None = None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> bytes:
    """GET (data None) or POST `data` as JSON to `url`; the body of a 2xx answer, or HttpFailure.

    The whole exchange ends within `timeout_s` seconds (plus the time to notice it)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpFailure("connection", f"{redact_url(url)} is not an http(s):// URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    port = parts.port
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, port, timeout=timeout_s, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout_s)
    expired = threading.Event()

    def _expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:  # wakes a blocked recv / send in the requesting thread; the plain socket's
                # shutdown, so that an SSL socket's state is left to the thread that owns it
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout_s, _expire)
    watchdog.daemon = True
    headers = {"Content-Type": "application/json", "Accept": "application/json", "Connection": "close"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    elif parts.username is not None:  # a URL's user:password@ means HTTP Basic authentication
        creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(creds).decode("ascii")
    start = time.monotonic()
    watchdog.start()
    try:
        return _exchange(conn, "GET" if data is None else "POST", path, data, headers, max_response_bytes, expired)
    except HttpFailure:
        raise
    except (TimeoutError, socket.timeout) as e:
        raise HttpFailure("timeout", f"timed out: no complete answer within {timeout_s:g}s ({e})") from None
    except (OSError, http.client.IncompleteRead, http.client.RemoteDisconnected) as e:
        if expired.is_set():
            raise HttpFailure("timeout", f"timed out: no complete answer within {timeout_s:g}s "
                                         f"({time.monotonic() - start:.1f}s elapsed)") from None
        raise HttpFailure("connection", f"{type(e).__name__}: {e}") from None
    except http.client.HTTPException as e:  # a status line or header that is not HTTP
        if expired.is_set():
            raise HttpFailure("timeout", f"timed out: no complete answer within {timeout_s:g}s") from None
        raise HttpFailure("malformed", f"the answer is not HTTP ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        watchdog.cancel()
        conn.close()


def _exchange(conn: http.client.HTTPConnection, method: str, path: str, data: bytes | None, headers: dict,
              max_bytes: int, expired: threading.Event) -> bytes:
    try:
        conn.request(method, path, body=data, headers=headers)
    except (BrokenPipeError, ConnectionResetError) as sent_error:
        # A server that refuses a request early (401, 413) answers before reading the body, and
        # the rest of the body then breaks the pipe: its answer may still be readable.
        try:
            resp = conn.getresponse()
        except Exception:  # noqa: BLE001 - nothing to read: report the send error
            raise sent_error from None
    else:
        if expired.is_set():  # the deadline passed while connecting: the socket was not there to shut
            raise TimeoutError("deadline passed")
        resp = conn.getresponse()
    if expired.is_set():
        raise TimeoutError("deadline passed")
    status = resp.status
    if 300 <= status < 400:
        location = redact_url(resp.getheader("Location") or "")
        raise HttpFailure("redirect", f"HTTP {status} redirect to {location or '(no Location)'}; redirects "
                                      "are not followed: give the final URL", status)
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise HttpFailure("malformed", f"answer of {int(length)} bytes exceeds the {max_bytes}-byte limit", status)
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = resp.read(min(_CHUNK, max_bytes + 1 - total))
        if expired.is_set():
            raise TimeoutError("deadline passed")
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise HttpFailure("malformed", f"answer exceeds the {max_bytes}-byte limit", status)
    body = b"".join(chunks)
    if not 200 <= status < 300:
        raise HttpFailure("http", f"HTTP {status}: {error_detail(body, resp.reason)}", status)
    return body


def error_detail(body: bytes, reason: str = "") -> str:
    """The "error" of a JSON error body, else its first 200 characters, else the reason phrase."""
    try:
        obj = loads_bounded(body, "error body")
        if isinstance(obj, dict) and "error" in obj:
            return str(obj["error"])[:500]
    except ValueError:
        pass
    text = body[:200].decode("utf-8", "replace").strip()
    return text or reason


class TooManyNodes(ValueError):
    """A JSON body with more values than its reader allows (refused before parsing)."""


def json_nodes(body: bytes) -> int:
    """An upper bound on the values a JSON text holds, without parsing it: its `{`, `[` and `,`
    plus one. Every value but the first of a container follows a comma, the first follows its
    container's bracket; characters inside strings are counted too (a bound, not a tally),
    which an honest request's prompts barely move. A few passes at memory speed."""
    return body.count(b"{") + body.count(b"[") + body.count(b",") + 1


def loads_bounded(body: bytes, what: str, max_nodes: int | None = None, flag: str = "") -> Any:
    """json.loads(body) or ValueError naming `what`: bad JSON, bad UTF-8, nesting deeper than the
    interpreter's recursion limit, or an integer longer than Python's digit limit (4300); with
    `max_nodes`, TooManyNodes (naming `flag`, the limit's setting) when json_nodes(body) exceeds it,
    before anything is parsed, so what parsing holds stays proportional to the limit."""
    if max_nodes is not None and (n := json_nodes(body)) > max_nodes:
        raise TooManyNodes(f"{what} holds up to {n} JSON values, more than {flag or 'the limit'}={max_nodes}")
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError(f"{what} nests too deeply to parse") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8: {e.reason} at byte {e.start}") from None
    except ValueError as e:  # JSONDecodeError, or "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"{what} is not valid JSON: {str(e)[:200]}") from None
