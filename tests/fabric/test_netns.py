"""Across hosts for real: two network namespaces joined by a veth pair.

Only addresses created here (10.251.x.1/2 on the veth pair, inside the two
namespaces) carry traffic. The namespaces are deleted whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = os.getpid() % 10000
    subnet = 10 + os.getpid() % 240
    a, b = f"pdf-{tag}-a", f"pdf-{tag}-b"
    va, vb = f"pdfa{tag}", f"pdfb{tag}"
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", a)
            made.append(a)
            _ip("netns", "add", b)
            made.append(b)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"this machine forbids network namespaces: {exc.stderr.decode().strip()}")
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        addr_a, addr_b = f"10.251.{subnet}.1", f"10.251.{subnet}.2"
        _ip("-n", a, "addr", "add", f"{addr_a}/24", "dev", va)
        _ip("-n", b, "addr", "add", f"{addr_b}/24", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield (a, addr_a), (b, addr_b)
    finally:
        for ns in made:  # deleting a namespace also removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _start(ns: str, role: str, node: str, seed: int, provider: str) -> subprocess.Popen:
    # ucx: UCX_TLS=tcp, so that the bytes cross the veth pair (the namespaces share a kernel and
    # /dev/shm: UCX would otherwise pick shared memory between them)
    env = dict(os.environ, UCX_TLS="tcp") if provider == "ucx" else None
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "netns_peer.py"), role, node, str(seed),
         provider],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line(proc: subprocess.Popen, timeout: float) -> dict:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        stderr = proc.stderr.read() if proc.poll() is not None else ""
        raise TimeoutError(f"no output within {timeout}s; stderr: {stderr}")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"peer exited ({proc.wait(5)}): {proc.stderr.read()[-2000:]}")
    return json.loads(line)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "ucx"])
def test_transfer_between_network_namespaces(namespaces, provider: str) -> None:
    (ns_a, addr_a), (ns_b, addr_b) = namespaces
    seed = 20251
    receiver = _start(ns_a, "receive", addr_a, seed, provider)
    sender = None
    try:
        desc = _line(receiver, 30)
        assert "descriptor" in desc, desc
        sender = _start(ns_b, "send", addr_b, seed, provider)
        sender.stdin.write(json.dumps(desc) + "\n")
        sender.stdin.flush()
        sent = _line(sender, 60)
        got = _line(receiver, 60)
        assert "error" not in sent and "error" not in got, (sent, got)
        assert sent["errors"] == []
        assert sent["writes"] == got["writes"] > 100
        bad = [i for i, (x, y) in enumerate(zip(sent["digests"], got["digests"], strict=True)) if x != y]
        assert not bad, f"{len(bad)} writes differ"
        receiver.stdin.write("\n")
        receiver.stdin.flush()
        assert receiver.wait(20) == 0
        assert sender.wait(20) == 0
    finally:
        for proc in (receiver, sender):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(5)
