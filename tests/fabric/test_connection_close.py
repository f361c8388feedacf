"""Closing our side of a tcp;ofi_rxm connection refuses what the peer still had in flight
(decode_node.service: a quarantine whose prefill side ended unfenced is released this way).

Real endpoints across a veth wire (tests/support/netfault.py's fault network): the writer
(close_peer.py) in the far namespace, the target here. The writer posts a burst while the wire is
partitioned, then disconnects the target (as the prefill node's `_retire_peer` does): rxm closes
its socket, whose kernel keeps the unsent bytes and flushes them once the wire heals (an orphaned
socket). Without a close on our side those bytes land after the heal (the hazard: pages released
then would be overwritten); with `close_connection` + a drain before the heal, not one byte of
the burst lands afterwards, and the writer sees its burst fail. Asserted, never assumed: the
burst was in flight (nothing of it landed before the close), the partition dropped packets.
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
from pdserve.engine.cache.hostmem import alloc_buffer

REASON = nf.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network-fault harness unavailable: {REASON}")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import close_peer as cp  # noqa: E402

WARM = 4 << 20          # grows the writer's socket send buffer before the partition
BURST = 12 << 20
HEALED_WAIT_S = 3.0     # after the heal: the orphan's next retransmission (a ~1 s partition) reaches us within this


def _landed(pool) -> int:
    """Bytes of the burst's range that hold the writer's pattern."""
    burst = bytes(pool[cp.WARM_MAX : cp.WARM_MAX + BURST])
    return burst.count(cp.PATTERN)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("close_here", [False, True], ids=["no-close:orphan-lands", "close:refused"])
def test_orphaned_bytes_land_unless_we_close_our_side(net, close_here: bool) -> None:
    with TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node=net.near_addr, peer_timeout_s=60.0)) as engine:
        assert engine.closes_connections
        pool = alloc_buffer(cp.POOL)
        region = engine.register(pool.view)
        proc, writer = start_writer(net, region.descriptor)
        try:
            warm_up(proc, pool, WARM, cp.PATTERN)
            with nf.partition(net) as hits:
                assert ask(proc, {"burst": BURST})["posted"] == BURST // cp.PIECE
                time.sleep(0.5)
                assert ask(proc, {"drop": 1}) == {"dropped": True}
                time.sleep(0.2)
                if close_here:
                    engine.close_connection(writer)
                    drain(engine)
                before = _landed(pool)
                snapshot = bytes(pool[cp.WARM_MAX : cp.WARM_MAX + BURST])
            assert hits.count > 0, "the partition dropped nothing: the burst was never held in flight"
            assert before < BURST, "the whole burst landed before the close: nothing was in flight"
            healed = time.monotonic()
            deadline = healed + HEALED_WAIT_S
            while time.monotonic() < deadline and _landed(pool) == before:
                time.sleep(0.1)
            after = _landed(pool)
            first_s = time.monotonic() - healed
            settled = ask(proc, {"wait": 10})
            print(f"\nclose_here={close_here}: burst bytes landed before the heal {before}, after {after} "
                  f"of {BURST} ({first_s:.1f} s after the heal); writer: {settled}; partition hits {hits.count}")
            if close_here:
                assert bytes(pool[cp.WARM_MAX : cp.WARM_MAX + BURST]) == snapshot, \
                    f"{after - before} bytes of the burst landed after we closed our side"
                assert settled["done"] < BURST // cp.PIECE, f"the burst completed after our close: {settled}"
            else:
                assert after > before, ("no orphaned byte landed after the heal: this run shows no hazard for "
                                        "the close to remove")
        finally:
            stop_proc(proc)
