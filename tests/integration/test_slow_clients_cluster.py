"""Slow clients cannot pin a real cluster (issue 33 item 3, S8): a router process with
`--stream-write-timeout-s 2 --max-inflight-requests 2` in front of one colocated node (a tiny
model: fast tokens). Two raw TCP clients with a small receive buffer and MSS each start a long SSE stream
and never read; once their socket buffers are full the router's writes wait, and past the write
deadline the router drops them: the metric counts both cuts, the decode node aborts both requests
(every page free, nothing outstanding), the cut streams never got their `[DONE]`, and a normal
request is served (without the deadline both would hold the router's two slots, and every other
request would be refused 429, until the request timeout).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from support.cluster import assert_no_page_leak, running_cluster
from support.prometheus import fetch, parse, total
from support.tiny_models import make_tiny_checkpoint
from support.wait import wait_until

WRITE_TIMEOUT_S = 2.0
WAIT = 120.0          # every wait in this file is bounded by this many seconds
SMALL_RCVBUF = 4096
SMALL_MSS = 536       # the minimum IPv4 MSS
MAX_TOKENS = 1900     # the tiny model's context is 2048: far more SSE bytes than the buffers hold


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "tiny-llama")
    with running_cluster(tmp_path_factory, "slow-clients", colocated=1, port=0, http_port=0, model=str(model),
                         num_blocks=300, threads_per_node=1, startup_timeout_s=150, router_health_interval_s=0.5,
                         router_args=("--stream-write-timeout-s", str(WRITE_TIMEOUT_S),
                                      "--max-inflight-requests", "2")) as c:
        yield c


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=WAIT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _slow_client(host: str, port: int, prompt: str) -> socket.socket:
    """Connects with a small receive buffer and segment size (set before connecting), sends one SSE
    request, never reads. The small MSS keeps the router's send buffer small: on loopback (MTU 64 KiB)
    the kernel otherwise grows it to megabytes, more than the whole answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SMALL_MSS)
    sock.settimeout(WAIT)
    sock.connect((host, port))
    payload = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                          "stream": True}).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the router had sent before it dropped the connection (bounded by WAIT)."""
    chunks = []
    try:
        while data := sock.recv(1 << 16):
            chunks.append(data)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_sse_clients_that_never_read_are_cut_and_free_the_router_and_the_node(cluster):
    url = cluster.http_url
    host, port = url.removeprefix("http://").rsplit(":", 1)
    assert _post(url, {"prompt": "warm up", "max_tokens": 2})[0] == 200
    cuts = lambda: total(parse(fetch(f"{url}/metrics")[0]), "pdserve:router_stream_write_timeouts_total",  # noqa: E731
                         api="http")
    before = cuts()
    socks = [_slow_client(host, int(port), f"Slow reader {i} says") for i in range(2)]
    try:
        # While both streams hold the router's two slots a normal request is refused; once the
        # write deadline cut them, it is served.
        wait_until(lambda: cuts() == before + 2, WAIT, "both slow streams cut by the write deadline", interval=0.2)
        status, text = _post(url, {"prompt": "The capital of France is", "max_tokens": 2})
        assert status == 200, text
        assert_no_page_leak(cluster, within=WAIT)   # the node aborted both requests
        for sock in socks:
            got = _read_to_close(sock)
            assert got.startswith(b"HTTP/1.1 200") and b"data: " in got
            assert b"data: [DONE]" not in got, "a cut stream must not look finished"
    finally:
        for sock in socks:
            sock.close()
