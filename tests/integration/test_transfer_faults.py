"""Faults on the KV transfer path, on a real cluster (2 prefill nodes, 1 decode node; shm, and
tcp;ofi_rxm where a confirmation needs the delivery fence; issue 15).

Each fault runs a batch of concurrent long-prompt requests through the router and strikes a prefill
node while it has transfers in flight. Every test asserts, never assumes:
- every request ends with its tokens (S1: 0 lost, a second prefill node is available);
- afterwards every node is back to free == total with nothing quarantined, held, tagged, slotted or
  in flight (NodeInfo.transfers), and no stale write was counted (S2, S5): the decode node's
  `pdserve:kv_stale_writes_total` is 0 on its /metrics;
- a batch of victim requests run right after, on the reused pages, gives the greedy output of the
  same batch run before any fault, so no late write corrupted a page (S5).

Faults: (a) a prefill node SIGKILLed mid-transfer; (b) one SIGSTOPped for 3x the decode node's
stall bound (`--prefill-stall`, 3 s) then SIGCONTed: the requests complete via the other node while
it is stopped, its attempts' pages stay quarantined until it resumes and confirms; (d) after (a),
AbortPrefill to the restarted process at the same address, naming the old process, is not a
confirmation. (c), the same request id from two decode engines / a second attempt on one prefill
node, is test_prefill_node's test_same_request_id_from_two_decode_engines_and_a_second_attempt; here
every retry is a second attempt of its request id on the other node.

What the faults measured (recovery seconds: from the fault to the last request's completion, and for
(b) from SIGCONT to the quarantine's release) is printed, never asserted (timings are not pass/fail).
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from support.batch import complete_all, complete_all_async
from support.cluster import (
    node_info,
    process_pid,
    running_cluster,
    transfer_leftovers,
    wait_busy,
)
from support.prometheus import fetch, parse, total
from support.wait import wait_until

from kv_messenger.ticket import peer_from_bytes
from pdserve.engine.sampling_params import SamplingParams
from pdserve_api.v1 import prefill_pb2, prefill_pb2_grpc

STALL_S = 3.0                         # the decode node's default --prefill-stall
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# ~200 tokens each, distinct heads (no prefix-cache hit between them): ~7 prefill chunks of 32
FAULT_PROMPTS = [f"Fault batch prompt {i}: " + "the quick brown fox jumps over the lazy dog and runs away. " * 15
                 for i in range(6)]
VICTIMS = [("The history of the Roman empire begins with " * 6), ("def fibonacci(n):\n    " * 8),
           ("Photosynthesis converts light into chemical energy; " * 7), ("Paris, Berlin, Madrid, Rome, " * 12)]
BATCH_TIMEOUT_S = 120.0
CLEAN_WITHIN_S = 30.0

CLUSTER = dict(prefill=2, decode=1, port=0, num_blocks=256, threads_per_node=1,
               engine_args=("--max-batch-tokens", "32"), startup_timeout_s=150, router_health_interval_s=0.5)


@pytest.fixture(scope="module", params=["shm", "tcp;ofi_rxm"], ids=["shm", "tcp"])
def cluster(request, tmp_path_factory):
    with running_cluster(tmp_path_factory, "faults-" + request.param.split(";")[0], provider=request.param,
                         **CLUSTER) as c:
        yield c


async def _batch(url: str, prompts: list[str], tag: str) -> dict[str, tuple[int, ...] | str]:
    return await complete_all_async(url, prompts, GREEDY, tag, BATCH_TIMEOUT_S)


def batch(url: str, prompts: list[str], tag: str) -> dict[str, tuple[int, ...] | str]:
    return complete_all(url, prompts, GREEDY, tag, BATCH_TIMEOUT_S)


def stale_writes(cluster) -> float:
    """The decode node's pdserve:kv_stale_writes_total (the family must be exposed)."""
    text, _ = fetch(cluster.metrics_urls["decode-0"])
    samples = parse(text)
    assert any(name == "pdserve:kv_stale_writes_total" for name, _ in samples), "no kv_stale_writes_total"
    return total(samples, "pdserve:kv_stale_writes_total")


def quarantine_age(cluster, peer: str) -> float | None:
    """The decode node's pdserve:kv_quarantine_oldest_seconds for prefill node `peer`, None if absent."""
    text, _ = fetch(cluster.metrics_urls["decode-0"])
    ages = [v for (n, ls), v in parse(text).items() if n == "pdserve:kv_quarantine_oldest_seconds"
            and ("peer", peer) in ls]
    return ages[0] if ages else None


def assert_clean(cluster, addresses: list[str]) -> None:
    """Every node back to nothing held (bounded), and no stale write anywhere."""
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S,
               "every node free == total with nothing quarantined, held, tagged or in flight", interval=0.2)
    assert stale_writes(cluster) == 0


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, tuple[int, ...]]:
    """The victims' greedy outputs on the fault-free cluster."""
    out = batch(cluster.url, VICTIMS, "victim")
    assert all(isinstance(v, tuple) and v for v in out.values()), out
    return out


def _all_completed(results: dict[str, tuple[int, ...] | str]) -> None:
    lost = {rid: r for rid, r in results.items() if not (isinstance(r, tuple) and len(r) == GREEDY.max_tokens)}
    assert not lost, f"requests lost or short: {lost}"


def _victims_match(cluster, reference) -> None:
    after = batch(cluster.url, VICTIMS, "victim")
    assert after == reference


def _strike_mid_transfer(cluster, name: str, strike) -> tuple[dict, float]:
    """Start the fault batch, strike `name` once it has a transfer in flight; the results and the
    seconds from the strike to the last completion."""
    address = cluster.processes[name].address
    loop = asyncio.new_event_loop()
    try:
        # prompts of this strike only: a prefix-cache hit on an earlier strike's batch would make
        # the prefills so short that the strike may land after every transfer completed
        prompts = [f"{strike.__name__}: {p}" for p in FAULT_PROMPTS]
        task = loop.create_task(_batch(cluster.url, prompts, f"{name}-{strike.__name__}"))
        loop.run_until_complete(asyncio.sleep(0.2))   # the streams are open
        loop.run_until_complete(asyncio.to_thread(wait_busy, address, 60.0))
        struck = time.monotonic()
        strike()
        results = loop.run_until_complete(asyncio.wait_for(task, BATCH_TIMEOUT_S + 30))
        return results, time.monotonic() - struck
    finally:
        loop.close()


def test_prefill_sigkill_mid_transfer_loses_nothing_and_a_restart_never_confirms(cluster, reference):
    name = "prefill-0"
    address = cluster.processes[name].address
    old_engine = peer_from_bytes(node_info(address).fabric_peer).engine_id

    def sigkill() -> None:
        cluster.kill(name, signal.SIGKILL)

    results, recovery = _strike_mid_transfer(cluster, name, sigkill)
    _all_completed(results)
    others = [cluster.processes[n].address for n in ("prefill-1", "decode-0")]
    assert_clean(cluster, others)
    print(f"\nprefill SIGKILL mid-transfer: {len(results)} requests, 0 lost, last one done {recovery:.2f} s after "
          "the kill")
    _victims_match(cluster, reference)

    # (d) the same address, a new process: an abort naming the old one is not a confirmation
    cluster.restart(name)
    with grpc.insecure_channel(address) as ch:
        resp = prefill_pb2_grpc.PrefillServiceStub(ch).AbortPrefill(prefill_pb2.AbortPrefillRequest(
            request_id=f"{name}-sigkill-0", decode_engine_id="d" * 32, attempt=0, prefill_engine_id=old_engine),
            timeout=10)
    assert not resp.confirmed and resp.state == prefill_pb2.TRANSFER_STATE_WRONG_ENGINE
    assert resp.prefill_engine_id and resp.prefill_engine_id != old_engine
    wait_until(lambda: node_info(cluster.processes["decode-0"].address).load.total_kv_blocks, 10, "decode serving")
    assert_clean(cluster, [cluster.processes[n].address for n in ("prefill-0", "prefill-1", "decode-0")])
    _victims_match(cluster, reference)


def test_prefill_sigstop_for_three_stall_bounds_recovers_via_the_other_node(cluster, reference):
    name = "prefill-1"
    pid = process_pid(cluster, name)
    decode = cluster.processes["decode-0"].address
    stopped_at: list[float] = []

    def sigstop() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    try:
        # the node stays stopped until every request has completed (via the other node), and for
        # at least 3x the stall bound
        results, recovery = _strike_mid_transfer(cluster, name, sigstop)
        _all_completed(results)
        time.sleep(max(0.0, stopped_at[0] + 3 * STALL_S - time.monotonic()))
        held = node_info(decode).transfers
        # the stopped node's attempts may still write: their pages stay out of use while it is stopped
        assert held.quarantined_transfers > 0 and held.quarantined_kv_blocks > 0, held
        assert stale_writes(cluster) == 0
        # and the hold is visible with its age (updated each round of the hold)
        peer = cluster.processes[name].address
        age = wait_until(lambda: quarantine_age(cluster, peer), 20, f"pdserve:kv_quarantine_oldest_seconds{{{peer}}}")
        assert 0 < age < time.monotonic() - stopped_at[0] + 1, age
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    assert_clean(cluster, [cluster.processes[n].address for n in ("prefill-0", "prefill-1", "decode-0")])
    released = time.monotonic() - resumed
    assert quarantine_age(cluster, peer) is None, "the age gauge outlived the quarantine"
    print(f"\nprefill SIGSTOP {3 * STALL_S:.0f} s: {len(results)} requests, 0 lost, last one done {recovery:.2f} s "
          f"after the stop; {held.quarantined_kv_blocks} quarantined pages released {released:.2f} s after SIGCONT")
    _victims_match(cluster, reference)
