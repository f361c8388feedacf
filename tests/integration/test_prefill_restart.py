"""A prefill node restarted at the same address with transfers in flight (issue 15's evidence; S1,
S2, S5, D20), on a real cluster: 2 prefill nodes, 1 decode node and the router, tcp;ofi_rxm on
loopback, the default model, small pools.

Same address: the restarted process gets the same gRPC port (Cluster.restart) and the same fabric
address: prefill-0's tcp provider listens on one pinned port (FI_TCP_PORT_LOW_RANGE =
FI_TCP_PORT_HIGH_RANGE, outside the ephemeral range), so the old and the new process have the same
fabric address bytes and differ only in their fabric engine id. (On shm the address names the
process, so "the same address" cannot happen there; test_transfer_faults covers its restart.)

The test strikes prefill-0 with SIGKILL while it has a transfer in flight, starts it again at once
(the batch still running), and asserts, never assumes:
- every request of the batch ends with its tokens (S1: the second prefill node takes the retries);
- the restarted process has the old fabric address and a new engine id;
- every attempt the decode node quarantined on prefill-0 was released by proof that the old
  process is gone ("prefill endpoint gone" in the decode node's log), never by "abort confirmed":
  the hold is bound to the old engine id, and the restarted process, asked directly for each of
  those keys naming the old engine, answers WRONG_ENGINE, not confirmed;
- the victims, on pages the dead process's attempts used, give the fault-free greedy tokens;
- afterwards every node is back to free == total with nothing quarantined, held, tagged, slotted or
  in flight (NodeInfo.transfers), and the decode node's pdserve:kv_stale_writes_total is 0;
- then (the second test) fresh requests are prefilled by the restarted process (its
  pdserve:prefill_requests_total{ok} moves) with the fault-free tokens (it found the fabric bug
  described above that test, since fixed).
Timings are printed, never asserted. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import socket
import subprocess
import time

import grpc
import pytest
from support.batch import complete_all
from support.cluster import node_info, transfer_leftovers
from support.prometheus import fetch, parse, total
from support.wait import wait_until

from kv_messenger.ticket import peer_from_bytes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.launcher import Cluster, _child_env, spawn
from pdserve_api.v1 import prefill_pb2, prefill_pb2_grpc

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# ~200 tokens each, distinct heads: ~7 prefill chunks of 32, seconds of transfer on two cores
FAULT_PROMPTS = [f"Restart batch prompt {i}: " + "the quick brown fox jumps over the lazy dog and runs away. " * 15
                 for i in range(6)]
VICTIMS = ["The history of the Roman empire begins with " * 6, "Photosynthesis converts light into energy; " * 7]
BATCH_TIMEOUT_S = 120.0
CLEAN_WITHIN_S = 30.0
SERVED_WITHIN_S = 12.0    # the restarted process prefills a fresh request within this (2 Prefill tries)
PINNED_PORTS = range(20400, 20500)   # candidates for prefill-0's one fabric port (below the ephemeral range)

_QUARANTINED = re.compile(r"request (\S+) attempt (\d+): prefill on (\S+) failed .*its pages are quarantined")
_RELEASED = re.compile(r"request (\S+) attempt (\d+): (.+) after [\d.]+ s; \d+ quarantined pages released")


def _pinned_port() -> int:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in PINNED_PORTS:
        assert port < low, f"pinned fabric port {port} is inside the ephemeral range (from {low})"
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {PINNED_PORTS} for prefill-0's fabric endpoint")


class PinnedFabricCluster(Cluster):
    """A Cluster whose child `pinned` listens for fabric (tcp provider) on one fixed port, in every
    process it runs: a restart has the same fabric address."""

    def __init__(self, pinned: str, fabric_port: int, **options: object) -> None:
        super().__init__(**options)
        self.pinned, self.fabric_port = pinned, fabric_port

    def _spawn(self, name: str) -> None:
        child = self._children[name]
        env = _child_env()
        if name == self.pinned:
            env["FI_TCP_PORT_LOW_RANGE"] = env["FI_TCP_PORT_HIGH_RANGE"] = str(self.fabric_port)
        with open(child.log_path, "ab") as log:
            log.write(f"$ {' '.join(child.spec.argv)}\n".encode())
            log.flush()
            child.proc = spawn(child.spec.argv, child.spec.cpus, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with PinnedFabricCluster("prefill-0", _pinned_port(), prefill=2, decode=1, port=0, http_port=None,
                             provider="tcp;ofi_rxm", num_blocks=192, threads_per_node=1,
                             engine_args=("--max-batch-tokens", "32"), startup_timeout_s=150,
                             router_health_interval_s=0.5,
                             log_dir=str(tmp_path_factory.mktemp("prefill-restart"))) as c:
        yield c


def batch(url: str, prompts: list[str], tag: str) -> dict[str, tuple[int, ...] | str]:
    return complete_all(url, prompts, GREEDY, tag, BATCH_TIMEOUT_S)


def _metric(cluster: Cluster, name: str, metric: str, **labels: str) -> float:
    text, _ = fetch(cluster.metrics_urls[name])
    samples = parse(text)
    assert any(n == metric for n, _ in samples), f"{name} exports no {metric}"
    return total(samples, metric, **labels)


def test_prefill_restarted_at_the_same_address_with_transfers_in_flight(cluster):
    name = "prefill-0"
    address = cluster.processes[name].address
    decode = cluster.processes["decode-0"].address
    reference = batch(cluster.url, VICTIMS, "ref")
    assert all(isinstance(v, tuple) and len(v) == GREEDY.max_tokens for v in reference.values()), reference
    old = peer_from_bytes(node_info(address).fabric_peer)

    # The batch runs on a thread of its own; kill and restart on this (main) thread: a child's
    # death signal (PR_SET_PDEATHSIG) follows the thread that started it, so a child started from
    # an executor thread would be killed when that thread ends.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(batch, cluster.url, FAULT_PROMPTS, "restart")

        def transferring() -> bool:   # prefill-0 runs a Prefill and the decode node awaits KV
            assert not running.done(), "the batch ended before prefill-0 had a transfer in flight"
            return bool(node_info(address).transfers.active_transfers and node_info(decode).transfers.tags_in_use)

        wait_until(transferring, 60.0, f"{name} to have a transfer in flight", interval=0.02)
        killed = time.monotonic()
        cluster.kill(name, signal.SIGKILL)
        cluster.restart(name)   # the same address at once, the batch still running on the other node
        serving = time.monotonic()
        results = running.result(timeout=BATCH_TIMEOUT_S + 60)
        done = time.monotonic()
    lost = {rid: r for rid, r in results.items() if not (isinstance(r, tuple) and len(r) == GREEDY.max_tokens)}
    assert not lost, f"requests lost, failed or short with a second prefill node up: {lost}"

    new = peer_from_bytes(node_info(address).fabric_peer)
    assert new.address == old.address, "the restarted process has another fabric address: the test tests nothing"
    assert new.engine_id != old.engine_id and new.pid != old.pid

    # every node clean: the dead process's quarantines are released (by proof) within the bound
    addresses = [cluster.processes[n].address for n in ("prefill-0", "prefill-1", "decode-0")]
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S,
               "every node free == total with nothing quarantined, held, tagged or in flight", interval=0.2)
    clean = time.monotonic()

    log = (cluster.log_dir / "decode-0.log").read_text(errors="replace")
    quarantined = {(m[1], int(m[2])) for m in _QUARANTINED.finditer(log) if m[3] == address}
    released = {(m[1], int(m[2])): m[3] for m in _RELEASED.finditer(log)}
    assert quarantined, f"no attempt on {address} was quarantined: the kill struck no transfer"
    assert all(k in released for k in quarantined), f"quarantines never released: {quarantined - set(released)}"
    how = {k: released[k] for k in quarantined}
    assert all(h == "prefill endpoint gone" for h in how.values()), \
        f"a quarantine of the dead process was released by something else than its death: {how}"

    # the restarted process never vouches for the old one's keys
    decode_engine = peer_from_bytes(node_info(decode).fabric_peer).engine_id
    with grpc.insecure_channel(address) as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        for rid, attempt in sorted(quarantined):
            for _ in range(2):   # asked twice: a remembered refusal must not turn into a confirmation
                resp = stub.AbortPrefill(prefill_pb2.AbortPrefillRequest(
                    request_id=rid, decode_engine_id=decode_engine, attempt=attempt,
                    prefill_engine_id=old.engine_id), timeout=10)
                assert not resp.confirmed and resp.state == prefill_pb2.TRANSFER_STATE_WRONG_ENGINE, (rid, resp)
                assert resp.prefill_engine_id == new.engine_id

    # the pages the dead process's attempts used, reused by the other node: the fault-free tokens
    after = batch(cluster.url, VICTIMS, "ref")
    assert after == reference, "greedy output on reused pages differs from the fault-free run"
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S, "every node clean after the victims",
               interval=0.2)
    assert _metric(cluster, "decode-0", "pdserve:kv_stale_writes_total") == 0
    print(f"\nprefill restart at {address} (fabric {old.address.hex()[:24]}): {len(results)} requests, 0 lost; "
          f"restarted process serving {serving - killed:.1f} s after the kill, batch done {done - killed:.1f} s, "
          f"every node clean {clean - killed:.1f} s after it; {len(quarantined)} quarantined attempts, all "
          "released by the old endpoint's death")


class NotServedByTheRestartError(AssertionError):
    """The restarted process prefilled no fresh request within SERVED_WITHIN_S."""


# Found by this test and fixed: the restarted process's HELLO from the dead one's address rebinds
# it (PeerTable.rebind), which did not clear the failed state the old process left (fabric.peers
# and pdf_peer.failed), so every send there, the HELLO's answer first, failed with FI_EHOSTUNREACH;
# rebind now reinserts a failed address as connect() does. The prefill node's connect() also ran
# on its event loop (5 s, GetNodeInfo unanswered meanwhile); it runs in a worker thread now.
def test_new_requests_are_served_by_the_restarted_process(cluster):
    """Runs after the restart test (module order): fresh requests reach the restarted prefill-0."""
    name = "prefill-0"
    reference = batch(cluster.url, VICTIMS[:1], "ref-again")
    assert all(isinstance(v, tuple) and len(v) == GREEDY.max_tokens for v in reference.values()), reference

    def served_by_new() -> bool:
        got = batch(cluster.url, VICTIMS[:1], f"fresh-{time.monotonic_ns()}")
        assert list(got.values()) == list(reference.values()), got
        # a labelled counter has no sample until the process counts one: while the fresh requests
        # all went to prefill-1, the restarted prefill-0 exports none (not yet, rather than a failure)
        text, _ = fetch(cluster.metrics_urls[name])
        return total(parse(text), "pdserve:prefill_requests_total", outcome="ok") > 0

    try:
        wait_until(served_by_new, SERVED_WITHIN_S, f"the restarted {name} to prefill a fresh request", interval=0.5)
    except AssertionError as e:
        if "waiting for the restarted" not in str(e):
            raise
        raise NotServedByTheRestartError(str(e)) from None
    addresses = [cluster.processes[n].address for n in ("prefill-0", "prefill-1", "decode-0")]
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S, "every node clean after the fresh requests",
               interval=0.2)
    assert _metric(cluster, "decode-0", "pdserve:kv_stale_writes_total") == 0
