"""The decode node's key rotation at the fabric level (decode_node.service, --rotate-key-after;
decode_node.fabric_sockets): once the old registration is closed and every socket of our fabric
connections shut down and closed by the provider, not one more byte written under the old key
lands, even of a write that was arriving while we rotated.

Real endpoints across a veth wire (tests/support/netfault.py's fault network): the writer
(close_peer.py) in the far namespace, the target here, the wire squeezed (tc tbf) so that a 12 MiB
burst of 1 MiB writes under the old key is still streaming in when we rotate: some of it has
landed (asserted), so a write whose key the target checked is mid-copy. Two variants:
- key-only: the old MR is closed (fi_close) but the connection is left alone: bytes of the
  burst go on landing (the hazard that makes the rotation close every connection; asserted, so
  the test shows what the close removes);
- rotate: fi_close, then `shut_down` on our fabric sockets, wait until the provider closed them,
  drain: afterwards the burst's range never changes again, through the squeeze and after it is
  lifted, the writer sees its burst fail, and this process (its rxm) is still alive (the
  fi_av_remove path, TransferEngine.close_connection, crashes rxm 1.17 in this state).
Every wait is bounded; timings are printed, never asserted.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from support import netfault as nf
from support.far_writer import drain, start_writer, warm_up
from support.line_proc import ask, stop as stop_proc
from support.net_fixture import fault_net_fixture  # noqa: F401  (the fixture "net")

from fabric import FabricConfig, TransferEngine
from fabric.sockets import endpoint_of, fabric_sockets, open_inodes, shut_down
from pdserve.engine.cache.hostmem import alloc_buffer

REASON = nf.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network-fault harness unavailable: {REASON}")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import close_peer as cp  # noqa: E402

WARM = 1 << 20
BURST = 12 << 20        # ~2.5 s through a 40 mbit squeeze
STARTED = 256 << 10     # this much of the burst landed: it is streaming in
AFTER_WAIT_S = 2.0      # looked at this long after the rotation, squeezed, and again after the squeeze


def _landed(pool) -> int:
    return bytes(pool[cp.WARM_MAX : cp.WARM_MAX + BURST]).count(cp.PATTERN)


def _rotate(engine: TransferEngine, old, writer_peer) -> int:
    """What DecodeNode._rotate_keys does to the fabric: close the old key, end every connection
    (waiting until the provider closed the sockets), drain. Returns the sockets ended."""
    engine.deregister(old)
    own = {endpoint_of(r.peer.address) for r in engine.rails}
    inodes = shut_down(fabric_sockets(own, {endpoint_of(writer_peer.address)}))
    deadline = time.monotonic() + 5.0
    while open_inodes(inodes):
        assert time.monotonic() < deadline, "the provider kept a shut-down fabric socket open for 5 s"
        time.sleep(0.01)
    drain(engine)
    return len(inodes)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("rotate", [False, True], ids=["key-only:bytes-go-on-landing", "rotate:none-lands"])
def test_a_write_streaming_in_under_the_old_key_stops_landing_once_rotated(net, rotate: bool) -> None:
    with TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node=net.near_addr, peer_timeout_s=60.0)) as engine:
        assert engine.closes_connections
        pool = alloc_buffer(cp.POOL)
        old = engine.register(pool.view)
        new = engine.register(address=old.address, length=old.length)   # the rotation's new registration
        assert new.key != old.key
        proc, writer = start_writer(net, old.descriptor)
        try:
            warm_up(proc, pool, WARM, cp.PATTERN)
            with nf.squeeze(net, rate="40mbit") as hits:
                assert ask(proc, {"burst": BURST})["posted"] == BURST // cp.PIECE
                deadline = time.monotonic() + 10.0
                while _landed(pool) < STARTED and time.monotonic() < deadline:
                    time.sleep(0.005)
                t0 = time.monotonic()
                ended = _rotate(engine, old, writer) if rotate else (engine.deregister(old) or 0)
                rotate_s = time.monotonic() - t0
                before = _landed(pool)
                snapshot = bytes(pool[cp.WARM_MAX : cp.WARM_MAX + BURST])
                assert STARTED <= before < BURST, f"{before} of {BURST} burst bytes landed: not mid-stream"
                time.sleep(AFTER_WAIT_S)
                squeezed = _landed(pool)
            time.sleep(AFTER_WAIT_S)
            after = _landed(pool)
            settled = ask(proc, {"wait": 10})
            print(f"\nrotate={rotate}: burst bytes landed at the rotation {before}, {AFTER_WAIT_S:g} s later "
                  f"{squeezed}, after the squeeze {after} of {BURST}; rotation {rotate_s * 1e3:.0f} ms, {ended} "
                  f"sockets ended; writer {settled}; squeeze overlimits {hits.count}")
            assert hits.count > 0, "the squeeze held nothing back"
            if rotate:
                assert ended >= 1
                assert bytes(pool[cp.WARM_MAX : cp.WARM_MAX + BURST]) == snapshot, \
                    f"{after - before} bytes of the burst landed after the rotation"
                assert settled["done"] < BURST // cp.PIECE, f"the burst completed after the rotation: {settled}"
            else:
                assert after > before, "nothing more landed after fi_close alone: this run shows no hazard"
        finally:
            stop_proc(proc)
