"""A delivery fence posted on a NEW tcp;ofi_rxm connection still lands after every byte the OLD
connection delivers (issue 15 S5: the review of "the fence goes on the same connection").

Why the fence is sound even when the prefill side's rxm reconnected without our code knowing
(decode_node.service's release on a confirmed AbortPrefill): libfabric 1.17 rxm keeps one
connection per peer endpoint, and a connection request from the same address and process while
the old one is CONNECTED (or ACCEPTING) is rejected (prov/rxm/src/rxm_conn.c
rxm_process_connreq, "simultaneous, reject peer", RXM_REJECT_EALREADY); the writer retries
(rxm_process_reject keeps its conn IDLE, rxm_get_conn -> rxm_connect, FI_EAGAIN) until the target
closed the old one itself (its EOF / reset -> FI_SHUTDOWN -> rxm_process_shutdown ->
rxm_close_conn: tcpx_ep_close, socket closed, nothing more read from it). So the target reads a
later connection only after it stopped reading the earlier one: a byte of the old connection
either landed before the fence or never lands. This is rxm's implementation, not an API promise:
a libfabric upgrade that breaks it fails this test. (libfabric after 1.17 can spread a peer's RMA
over several connections, FI_OFI_RXM_NUM_MSG_EPS > 1; it then stops granting FI_ORDER_WAW, so
TransferEngine.writes_ordered is False and no fence is asked for or trusted.)

The worst case, built here with real endpoints across the veth wire of tests/support/netfault.py
(the writer in the far namespace, the target here): the writer completes writes that are still in
its kernel (the old connection C1 alone is blocked in the wire), closes C1 itself (disconnect:
FI_AV_REMOVE_CLEANUP, an orphaned socket that keeps the bytes), then posts the fence, which opens
C2 -- whose packets pass. Asserted, never assumed: C2 was tried (SYNs counted) and the fence did
not land while C1's bytes were held; once C1 passes, its orphaned bytes land, then the fence, and
not one byte of C1 after the fence.

The writer is this file run as a script inside the far namespace (`python test_fence_reconnect.py
NODE`; stdin/stdout JSON lines, see `_writer`). Blocking waits: each writer answer WRITER_ANSWER_S,
the fence FENCE_WITHIN_S after C1 is let through, every `ip`/`iptables` call netfault's bound.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))):   # tests/, the repository
    if _path not in sys.path:
        sys.path.insert(0, _path)

from support.writer_side import WriteCounts, reply, writer_endpoint  # noqa: E402

from fabric import FabricConfig, PageWrites, TransferEngine  # noqa: E402
from pdserve.engine.cache.hostmem import alloc_buffer  # noqa: E402

POOL = 16 << 20
WARM = 4 << 20          # grows the writer's socket send buffer before C1 is blocked
BURST_AT = 8 << 20      # the burst's bytes land at [BURST_AT, BURST_AT + BURST)
BURST = 6 << 20
PIECE = 1 << 20         # one burst write
FENCE_BYTES = 8
PATTERN = 0xAB          # every byte the writer sends
WARM_TAG, BURST_TAG, FENCE_TAG = 0x1111, 0x2222, 0x3333
SETTLE_S = 0.7          # the burst's local completions (handed to the blocked socket) within this
BLOCKED_S = 3.0         # C1 held, C2 free: the fence must not land meanwhile
FENCE_WITHIN_S = 25.0   # after C1 passes: its next retransmission, its bytes, its end, then C2
AFTER_FENCE_S = 1.5     # watched after the fence: nothing of C1 may land
WRITER_ANSWER_S = 30.0


# --- the writer (far namespace) ---------------------------------------------------------------

def _writer(node: str) -> int:
    """A prefill-like endpoint. Commands (one JSON line each, one JSON answer):
    {"warm": 1} -> {"warm": true}; {"burst": 1} -> {"posted", "done", "failed"} after SETTLE_S;
    {"drop": 1} (disconnect: rxm closes C1, its kernel keeps the bytes) -> {"dropped": true};
    {"fence": 1} (a new connection) -> {"fence_posted": true}; {"wait": S} -> the counts."""
    with writer_endpoint(node, POOL, PATTERN) as (engine, region, hello):
        target, fence_dst = pickle.loads(base64.b64decode(hello["target"]))
        counts = WriteCounts("done", "failed", "fence_done", "fence_failed")
        posted = 0
        for line in sys.stdin:
            cmd = json.loads(line)
            if "warm" in cmd:
                engine.write_sync(PageWrites(region, [0], target, [0], [WARM], WARM_TAG), timeout=30)
                reply({"warm": True})
            elif "burst" in cmd:
                for i in range(BURST // PIECE):
                    off = BURST_AT + i * PIECE
                    engine.write(PageWrites(region, [off], target, [off], [PIECE], BURST_TAG),
                                 lambda: counts.settle("done"), lambda _e: counts.settle("failed"))
                posted = BURST // PIECE
                time.sleep(SETTLE_S)
                c = counts.snapshot()
                reply({"posted": posted, "done": c["done"], "failed": c["failed"]})
            elif "drop" in cmd:
                engine.disconnect(target.peer)
                reply({"dropped": True})
            elif "fence" in cmd:
                engine.write(PageWrites(region, [0], fence_dst, [0], [FENCE_BYTES], FENCE_TAG, imm_mode="every"),
                             lambda: counts.settle("fence_done"), lambda _e: counts.settle("fence_failed"))
                reply({"fence_posted": True})
            elif "wait" in cmd:
                c = counts.wait_for(lambda c: c["fence_done"] + c["fence_failed"] >= 1, float(cmd["wait"]))
                reply(dict(c, posted=posted))
    return 0


if __name__ == "__main__":
    raise SystemExit(_writer(sys.argv[1]))


# --- the test (root namespace: the target) ----------------------------------------------------

import pytest  # noqa: E402
from support import netfault as nf  # noqa: E402
from support.line_proc import ask as ask_line, stop as stop_proc  # noqa: E402
from support.net_fixture import fault_net_fixture  # noqa: E402, F401  (the fixture "net")

REASON = nf.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network-fault harness unavailable: {REASON}")


def ask(proc: subprocess.Popen, cmd: dict) -> dict:
    return ask_line(proc, cmd, WRITER_ANSWER_S)


def _c1_port(net: nf.FaultNet) -> int:
    """The writer-side port of its one established connection to us (C1)."""
    text = nf.in_ns(net.far_ns, "ss", "-Htn", "state", "established").stdout
    ports = [int(parts[2].rsplit(":", 1)[1]) for parts in (line.split() for line in text.splitlines())
             if len(parts) >= 4 and parts[3].rsplit(":", 1)[0] == net.near_addr]
    assert len(ports) == 1, f"expected one connection from the writer to {net.near_addr}, found: {text!r}"
    return ports[0]


def _counters(net: nf.FaultNet) -> dict[str, int]:
    """Packets matched by the wire's FORWARD rules, summed per target (DROP: C1's, ACCEPT: SYNs)."""
    text = nf.in_ns(net.wire_ns, "iptables", "-w", "5", "-L", "FORWARD", "-v", "-x", "-n").stdout
    out: dict[str, int] = {}
    for line in text.splitlines()[2:]:
        parts = line.split()
        if len(parts) >= 3:
            out[parts[2]] = out.get(parts[2], 0) + int(parts[0])
    return out


@pytest.mark.timeout(120)
def test_fence_on_a_new_connection_lands_after_the_old_connections_bytes(net) -> None:
    with TransferEngine(FabricConfig(provider="tcp;ofi_rxm", node=net.near_addr, peer_timeout_s=60.0)) as engine:
        assert engine.closes_connections and engine.writes_ordered
        pool = alloc_buffer(POOL)
        region = engine.register(pool.view)
        fence_buf = alloc_buffer(4096)
        fence_region = engine.register(fence_buf.view)

        def burst_bytes() -> int:
            return bytes(pool[BURST_AT:BURST_AT + BURST]).count(PATTERN)

        seen: dict[str, int] = {}
        fenced = threading.Event()

        def on_fence(_tag: int) -> None:   # progress thread: what had landed when the fence did
            seen["burst_writes"] = engine.imm_counter.landed(BURST_TAG)
            seen["burst_bytes"] = burst_bytes()
            fenced.set()

        engine.imm_counter.expect(FENCE_TAG, 1, on_fence)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", net.far_ns, sys.executable, os.path.abspath(__file__), net.far_addr],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rules: list[tuple[str, ...]] = []
        try:
            descs = (region.descriptor, fence_region.descriptor)
            assert "peer" in ask(proc, {"target": base64.b64encode(pickle.dumps(descs)).decode()})
            assert ask(proc, {"warm": 1}) == {"warm": True}
            deadline = time.monotonic() + 10.0   # completed there means handed to its socket
            while bytes(pool[:WARM]).count(PATTERN) < WARM and time.monotonic() < deadline:
                time.sleep(0.01)
            assert bytes(pool[:WARM]).count(PATTERN) == WARM
            port = _c1_port(net)
            # C1 held both ways in the wire; new connections' SYNs (C2's) counted and let through
            rules = [("-p", "tcp", "-s", net.far_addr, "--sport", str(port), "-j", "DROP"),
                     ("-p", "tcp", "-d", net.far_addr, "--dport", str(port), "-j", "DROP"),
                     ("-p", "tcp", "--syn", "-s", net.far_addr, "-d", net.near_addr, "-j", "ACCEPT")]
            for rule in rules:
                nf.in_ns(net.wire_ns, "iptables", "-w", "5", "-I", "FORWARD", *rule)
            burst = ask(proc, {"burst": 1})
            assert burst["done"] >= 1, f"no burst write completed locally while C1 was held: {burst}"
            held = burst_bytes()
            assert held < burst["done"] * PIECE, (f"the {burst['done']} locally completed writes all landed "
                                                  f"({held} bytes): nothing of them was held in the writer's kernel")
            assert ask(proc, {"drop": 1}) == {"dropped": True}   # C1 closed there: an orphaned socket
            assert ask(proc, {"fence": 1}) == {"fence_posted": True}   # opens C2
            landed_while_held = fenced.wait(BLOCKED_S)
            counts = _counters(net)
            assert counts.get("DROP", 0) > 0, f"the wire dropped nothing of C1: {counts}"
            assert counts.get("ACCEPT", 0) > 0, f"the writer never tried a new connection (no SYN): {counts}"
            assert not landed_while_held, (
                f"the fence landed on a new connection while the old one still held bytes of writes completed "
                f"before it (landed then: {seen}, {held} of the burst's bytes before the close)")
            before = burst_bytes()
            for rule in reversed(rules[:2]):   # let C1 through: its orphaned bytes, then its end
                nf.in_ns(net.wire_ns, "iptables", "-w", "5", "-D", "FORWARD", *rule)
            rules = rules[2:]
            assert fenced.wait(FENCE_WITHIN_S), f"the fence never landed after C1 was let through ({burst})"
            time.sleep(AFTER_FENCE_S)
            final_bytes, final_writes = burst_bytes(), engine.imm_counter.landed(BURST_TAG)
            settled = ask(proc, {"wait": 10})
            print(f"\nburst {burst}; bytes landed while held {before}, at the fence {seen['burst_bytes']} "
                  f"({seen['burst_writes']} writes), final {final_bytes} ({final_writes}); writer {settled}; "
                  f"wire {counts}")
            assert seen["burst_bytes"] > before, ("no orphaned byte of C1 landed after it was let through: this "
                                                  "run shows no old-connection bytes for the fence to follow")
            assert (final_bytes, final_writes) == (seen["burst_bytes"], seen["burst_writes"]), \
                f"bytes of the old connection landed after the fence: {seen} at the fence, final " \
                f"{final_bytes} bytes / {final_writes} writes"
            assert settled["fence_done"] == 1, f"the fence did not complete at the writer: {settled}"
        finally:
            for rule in reversed(rules):
                nf.in_ns(net.wire_ns, "iptables", "-w", "5", "-D", "FORWARD", *rule, check=False)
            stop_proc(proc)
