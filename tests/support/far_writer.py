"""The target's side of a writer process in the fault network's far namespace
(tests/support/netfault.py): tests/fabric/close_peer.py started under `ip netns exec`, handed the
target region's descriptor, warmed up; and the drain the target runs after ending connections.
Used by tests/fabric/test_connection_close.py and test_key_rotation_sockets.py. Test thread only;
each answer is bounded by support.line_proc.ask, the warm-up by `within_s`, the drain by its
`within_s`."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import time

from fabric import PeerDescriptor, RemoteDescriptor, TransferEngine
from support.line_proc import ask, stop

CLOSE_PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fabric", "close_peer.py")


def start_writer(net, target: RemoteDescriptor) -> tuple[subprocess.Popen, PeerDescriptor]:
    """close_peer.py in `net`'s far namespace, writing to `target`: the process (the caller stops it,
    support.line_proc.stop) and its fabric peer. Stopped here if the handshake fails."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", net.far_ns, sys.executable, CLOSE_PEER, net.far_addr],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        writer = pickle.loads(base64.b64decode(
            ask(proc, {"descriptor": base64.b64encode(pickle.dumps(target)).decode()})["peer"]))
    except BaseException:
        stop(proc)
        raise
    return proc, writer


def warm_up(proc: subprocess.Popen, pool, warm: int, pattern: int, within_s: float = 10.0) -> None:
    """The writer's `warm` bytes at the pool's offset 0 (grows its socket's send buffer), and they
    landed here within `within_s` (completed there means handed to its socket)."""
    assert ask(proc, {"warm": warm}) == {"warm": True}
    deadline = time.monotonic() + within_s
    while bytes(pool[:warm]).count(pattern) < warm and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bytes(pool[:warm]).count(pattern) == warm


def drain(engine: TransferEngine, within_s: float = 2.0) -> None:
    """Wait (at most `within_s`) until the engine's progress thread has run once more."""
    mark = engine.progress_mark()
    deadline = time.monotonic() + within_s
    while not engine.progressed(mark) and time.monotonic() < deadline:
        time.sleep(0.002)
