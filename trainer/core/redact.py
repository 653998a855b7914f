"""Secrets out of URLs before they are recorded or printed.

A URL flag such as --reward-endpoint may carry a credential after ${VAR} expansion
(``https://user:pass@host/score?token=...``). The recipe record, TensorBoard's config text and
log lines are read by everyone who can read the run, so every place that records or prints a
URL passes it through `redact_url` (or a whole config through `redact_urls`) first. Tokens have
their own route: an environment variable sent as an ``Authorization`` header (docs/security.md).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: what replaces a userinfo, a query string or a fragment
REDACTED = "REDACTED"

# a scheme followed by "//": only such strings are treated as URLs
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def redact_url(url: str) -> str:
    """`url` with its userinfo, query and fragment replaced by REDACTED; the scheme, host, port
    and path kept (they say where, not who). A string that is not a URL is returned unchanged."""
    if not isinstance(url, str) or not _URL_RE.match(url):
        return url
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # a malformed port or bracket: say nothing about it beyond the scheme
        return url.split("://", 1)[0] + "://" + REDACTED
    netloc = host if ":" not in host else f"[{host}]"
    if port is not None:
        netloc += f":{port}"
    if "@" in parts.netloc:
        netloc = f"{REDACTED}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, REDACTED if parts.query else "",
                       REDACTED if parts.fragment else ""))


def redact_urls(value: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, tuples, strings) with every URL string redacted."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: redact_urls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_urls(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact_urls(v) for v in value)
    return value
