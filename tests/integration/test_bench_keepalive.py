"""The OpenAI backend of the load-test harness against a real local HTTP server that drops keep-alive
connections: a request whose pooled connection the server closed before reading it is sent again
on a fresh connection and succeeds (each request answered once); a request the server may have
had (read on a fresh connection, or answered in part) is never sent twice.

The server (asyncio streams on a loopback socket, HTTP/1.1, chunked SSE) has three ways to drop:
- "idle": a connection that has carried a request is closed, unread, when the next one arrives on
  it (its idle timer fired as the request was on the way: what llama-server does between
  back-to-back requests). Without the retry every second request fails.
- "fresh": every request is read whole, then its connection is closed without an answer.
- "head": a request on a reused connection gets the response head, then the connection closes.
Every wait is bounded by the requests' timeout (SendOptions.timeout_s, 10 s).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.tools.bench.backends import OpenAIBackend, SendOptions
from pdserve.tools.bench.datasets import BenchRequest

SEND = SendOptions(temperature=0.0, ignore_eos=True, timeout_s=10.0)
TOKENS = 3


class DroppingServer:
    """A /v1/completions server on 127.0.0.1; `mode` says how it drops connections (module doc)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.received = 0   # requests read whole (the server had them)
        self.answered = 0   # requests answered whole
        self.dropped = 0    # connections closed with a request unread on them
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> DroppingServer:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                if served and self.mode == "idle":
                    if await reader.read(1):   # the next request arrived: drop it unread (a reset)
                        self.dropped += 1
                    writer.transport.abort()
                    return
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = json.loads(await reader.readexactly(length))
                self.received += 1
                if self.mode == "fresh" or (self.mode == "head" and served):
                    if self.mode == "head":
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                     b"Transfer-Encoding: chunked\r\n\r\n")
                        await writer.drain()
                    writer.transport.abort()
                    return
                await self._answer(writer, body)
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()   # the client went away

    async def _answer(self, writer: asyncio.StreamWriter, body: dict) -> None:
        assert body["stream"] is True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        events = [{"choices": [{"text": f"t{i}", "finish_reason": None}]} for i in range(TOKENS - 1)]
        events.append({"choices": [{"text": "end", "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": TOKENS}})
        for data in [json.dumps(e) for e in events] + ["[DONE]"]:
            chunk = f"data: {data}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.answered += 1


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest(index=i, prompt=(1, 2), max_tokens=TOKENS, prompt_len=2) for i in range(n)]


async def _send_all(mode: str, n: int, concurrency: int):
    async with DroppingServer(mode) as server, OpenAIBackend(server.url) as backend:
        requests = _requests(n)
        traces = []
        for start in range(0, n, concurrency):   # back to back, `concurrency` at a time
            batch = requests[start:start + concurrency]
            traces += await asyncio.gather(*(backend.send(r, SEND, f"r{r.index}") for r in batch))
        return server, backend, traces


@pytest.mark.parametrize("concurrency", [1, 3])
def test_requests_on_connections_dropped_idle_are_sent_again_and_all_succeed(concurrency):
    n = 8 if concurrency == 1 else 9
    server, backend, traces = asyncio.run(_send_all("idle", n, concurrency))
    assert [t.error for t in traces] == [None] * n
    assert [t.finish_reason for t in traces] == ["length"] * n
    assert [sum(t.chunk_tokens) for t in traces] == [TOKENS] * n
    # The server dropped a connection under some of them (every second one at concurrency 1), and
    # each was sent again once: the server answered every request exactly once.
    assert server.dropped == backend.retried > 0
    if concurrency == 1:
        assert server.dropped == n // 2
    assert server.answered == server.received == n


def test_a_request_the_server_read_on_a_fresh_connection_is_not_sent_again():
    server, backend, traces = asyncio.run(_send_all("fresh", 3, 1))
    assert all(t.error is not None and "ServerDisconnected" in t.error for t in traces), traces
    assert backend.retried == 0
    assert server.received == 3 and server.answered == 0


def test_a_request_whose_response_began_is_not_sent_again():
    server, backend, traces = asyncio.run(_send_all("head", 4, 1))
    # Each connection answers its first request; the second request on it gets a head and a close.
    assert [t.error is None for t in traces] == [True, False, True, False]
    assert backend.retried == 0
    assert server.received == 4 and server.answered == 2
