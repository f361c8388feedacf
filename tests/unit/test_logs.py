"""Structured logs (pdserve/serving/logs.py): one line per event in key=value text or JSON, the request id on every
line of a request's task (and only there), tracebacks kept on the line, bad settings named."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from pdserve.serving.logs import bind_request_id, current_request_id, request_scope, setup_logging


@pytest.fixture
def capture():
    """setup_logging into a buffer; the root logger's handlers and level are restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()

    def start(fmt: str, level: str = "INFO") -> io.StringIO:
        setup_logging(level, fmt, stream=buf)
        return buf

    yield start
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


def test_text_lines_carry_fields_and_request_ids(capture):
    buf = capture("text")
    log = logging.getLogger("pdserve.test")
    log.info("plain event n=%d", 3)
    with request_scope("req-1"):
        log.warning("inside the request: a \"quoted\" word")
    log.info("explicit", extra={"request_id": "req-2"})
    log.debug("not shown at INFO")
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("failed")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4, lines
    first, second, third, fourth = lines
    assert first.startswith("ts=") and " level=INFO logger=pdserve.test pid=" in first
    assert first.endswith('msg="plain event n=3"') and "request_id=" not in first
    assert "level=WARNING" in second and "request_id=req-1 " in second
    assert second.endswith(r'msg="inside the request: a \"quoted\" word"')
    assert "request_id=req-2 " in third and "msg=explicit" in third
    assert "level=ERROR" in fourth and 'exc="Traceback' in fourth and "RuntimeError: boom\\nsecond line" in fourth


def test_json_lines_parse_and_tasks_keep_their_own_ids(capture):
    buf = capture("json", "DEBUG")
    log = logging.getLogger("pdserve.test")

    async def serve(rid: str, delay: float) -> None:
        bind_request_id(rid)  # one task, one request
        await asyncio.sleep(delay)
        log.debug("step one")
        await asyncio.sleep(delay)
        log.info("step two")

    async def main() -> None:
        await asyncio.gather(serve("a", 0.02), serve("b", 0.01))
        assert current_request_id() is None  # the tasks' ids never leak into their creator

    asyncio.run(main())
    log.info("after")
    records = [r for r in map(json.loads, buf.getvalue().splitlines()) if r["logger"] == "pdserve.test"]
    assert [(r["request_id"], r["msg"]) for r in records[:4]] == [("b", "step one"), ("a", "step one"),
                                                                   ("b", "step two"), ("a", "step two")]
    assert records[0]["level"] == "DEBUG" and records[0]["logger"] == "pdserve.test"
    assert set(records[0]) == {"ts", "level", "logger", "pid", "request_id", "msg"}
    assert records[-1]["msg"] == "after" and "request_id" not in records[-1]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="log format must be one of"):
        setup_logging("INFO", "xml")
    with pytest.raises(ValueError, match="log level must be"):
        setup_logging("LOUD", "text")
