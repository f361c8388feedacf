"""Structured logs for every pdserve process: one line per event, `key=value` text or JSON, with the
request id on every request-scoped line.

    add_log_args(parser)                       # --log-level, --log-format {text,json}
    setup_logging(args.log_level, args.log_format)

    with request_scope(request_id):            # every line logged in this task (and the tasks it
        logger.info("generate node=%s", addr)  # creates) carries request_id=...

Text:  ts=2025-01-01T12:00:00.123Z level=INFO logger=router.service pid=42 request_id=r1 msg="generate node=..."
JSON:  {"ts": "...", "level": "INFO", "logger": "router.service", "pid": 42, "request_id": "r1", "msg": "..."}

The request id comes from `request_scope` (a context variable: asyncio tasks inherit it, other
threads do not) or from `extra={"request_id": rid}` on the call; a line outside any request has none.
A traceback stays on the same line (an escaped `exc=` field, or the JSON "exc" key).

Rule for callers: at INFO and above, log ids, sizes and node names, never prompt or generated
text (STYLE: prompts stay out of logs).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import TextIO

FORMATS = ("text", "json")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)


def current_request_id() -> str | None:
    return _request_id.get()


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Lines logged inside (in this task, and tasks created inside) carry `request_id`."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def bind_request_id(request_id: str) -> None:
    """Tag the rest of the current task (or thread) with `request_id`: for a task that serves one
    request from start to end, where a `with` block would not fit (an async generator's body)."""
    _request_id.set(request_id)


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, object]:
    fields: dict[str, object] = {"ts": _timestamp(record), "level": record.levelname, "logger": record.name,
                                 "pid": record.process}
    rid = getattr(record, "request_id", None) or _request_id.get()
    if rid:
        fields["request_id"] = rid
    fields["msg"] = record.getMessage()
    return fields


class TextFormatter(logging.Formatter):
    """key=value on one line; values with spaces, quotes or '=' are JSON-quoted."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            fields["exc"] = record.exc_text
        return " ".join(f"{k}={_quote(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, ensure_ascii=False)


def _quote(value: object) -> str:
    s = str(value)
    if s and not any(c in s for c in ' "=\n\r\t\\') and s.isprintable():
        return s
    return json.dumps(s, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one that writes `fmt` lines to `stream` (stderr).
    Raises ValueError naming a bad level or format. Returns the handler."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


def add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default: INFO)")
    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="one line per event: key=value text or JSON (default: text)")
