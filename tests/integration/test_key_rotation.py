"""KV memory-key rotation (decode_node.service, --rotate-key-after; issue 15 item 1, S5): a prefill
node stopped for good with a transfer in flight no longer holds the decode node's pages for ever.

A real cluster on tcp;ofi_rxm over loopback (1 prefill node, 1 decode node with
--local-prefill-fallback and --rotate-key-after 2, the router). A batch of long prompts runs; the
prefill node is SIGSTOPped while it has transfers in flight and stays stopped. Asserted, never
assumed:
- every request of the batch ends with its tokens (the stalled attempts are prefilled again on
  the decode node);
- while the prefill process is still stopped, the decode node rotates its key once
  (pdserve:kv_key_rotations_total) and is back to free == total with nothing quarantined, tagged
  or slotted, and pdserve:kv_stale_writes_total is 0;
- the point: the stopped process is then resumed while a batch of victim requests decodes in the
  released pages (they need most of the small pool, so they reuse them), and finishes what it had
  posted under the old key. Not one of those writes lands: the victims' greedy tokens equal the
  same batch's on the fault-free cluster, no stale write is counted, and every node ends clean;
- a fresh batch afterwards gives the same tokens, prefilled (some of it at least) by the resumed
  prefill node under the new key.

Whether the resumed process still posts old writes depends on where SIGSTOP caught it (here it
usually finds its Prefill calls cancelled and aborts them); the write caught mid-stream, the
case that needs the connections ended, is tests/fabric/test_key_rotation_sockets.py.

The prefix cache is off everywhere, so the victims' pages are written by their own prefill, not
shared with the reference run's. Timings are printed, never asserted. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from support.batch import complete_all, complete_all_async
from support.cluster import process_pid, running_cluster, transfer_leftovers, wait_busy
from support.prometheus import fetch, parse, total
from support.wait import wait_until

from pdserve.engine.sampling_params import SamplingParams

ROTATE_AFTER_S = 2.0
FAULT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
VICTIM = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# ~200 tokens each (13 pages of 16), distinct heads: ~7 prefill chunks of 32
FAULT_PROMPTS = [f"Rotation batch prompt {i}: " + "the quick brown fox jumps over the lazy dog and runs away. " * 15
                 for i in range(3)]
VICTIMS = [f"Victim {i}: " + s * 12 for i, s in enumerate((
    "The history of the Roman empire begins with ", "def fibonacci(n):\n    return ",
    "Photosynthesis converts light into chemical energy; ", "Paris, Berlin, Madrid, Rome, Vienna, "))]
BATCH_TIMEOUT_S = 90.0
CLEAN_WITHIN_S = 20.0
NUM_BLOCKS = 72   # the victims (4 x ~9 pages) take half of it while running

CLUSTER = dict(prefill=1, decode=1, port=0, num_blocks=NUM_BLOCKS, threads_per_node=1, provider="tcp;ofi_rxm",
               engine_args=("--max-batch-tokens", "32", "--no-prefix-cache"),
               decode_args=("--local-prefill-fallback", "--rotate-key-after", str(ROTATE_AFTER_S)),
               startup_timeout_s=150, router_health_interval_s=0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, "key-rotation", **CLUSTER) as c:
        yield c


async def _batch(url: str, prompts: list[str], params: SamplingParams, tag: str) -> dict[str, tuple[int, ...] | str]:
    return await complete_all_async(url, prompts, params, tag, BATCH_TIMEOUT_S)


def batch(url: str, prompts: list[str], params: SamplingParams, tag: str) -> dict[str, tuple[int, ...] | str]:
    return complete_all(url, prompts, params, tag, BATCH_TIMEOUT_S)


def decode_metric(cluster, name: str, node: str = "decode-0", **labels: str) -> float:
    """A counter of a node's /metrics (the family must be exposed)."""
    text, _ = fetch(cluster.metrics_urls[node])
    samples = parse(text)
    assert any(n == name for n, _ in samples), f"no {name} on {node}"
    return total(samples, name, **labels)


def _complete(results: dict, params: SamplingParams) -> None:
    lost = {rid: r for rid, r in results.items() if not (isinstance(r, tuple) and len(r) == params.max_tokens)}
    assert not lost, f"requests lost or short: {lost}"


@pytest.mark.timeout(240)
def test_a_stopped_prefill_host_costs_a_key_rotation_and_its_late_writes_never_land(cluster):
    reference = batch(cluster.url, VICTIMS, VICTIM, "reference")
    _complete(reference, VICTIM)
    prefill = cluster.processes["prefill-0"].address
    decode = cluster.processes["decode-0"].address
    pid = process_pid(cluster, "prefill-0")
    assert decode_metric(cluster, "pdserve:kv_key_rotations_total") == 0

    loop = asyncio.new_event_loop()
    stopped = False
    try:
        task = loop.create_task(_batch(cluster.url, FAULT_PROMPTS, FAULT, "fault"))
        loop.run_until_complete(asyncio.sleep(0.2))
        loop.run_until_complete(asyncio.to_thread(wait_busy, prefill, 60.0))
        os.kill(pid, signal.SIGSTOP)
        stopped, struck = True, time.monotonic()
        results = loop.run_until_complete(asyncio.wait_for(task, BATCH_TIMEOUT_S + 30))
        _complete(results, FAULT)
        done = time.monotonic() - struck
        # still stopped: the rotation alone releases what the stopped process may write into
        wait_until(lambda: decode_metric(cluster, "pdserve:kv_key_rotations_total") >= 1, 30,
                   "a KV key rotation on the decode node")
        wait_until(lambda: transfer_leftovers([decode]), CLEAN_WITHIN_S,
                   "the decode node free == total with nothing quarantined, tagged or slotted", interval=0.2)
        released = time.monotonic() - struck
        assert decode_metric(cluster, "pdserve:kv_stale_writes_total") == 0
        # the victims decode in the released pages while the stopped process resumes and finishes
        # its old writes
        task = loop.create_task(_batch(cluster.url, VICTIMS, VICTIM, "victim"))
        loop.run_until_complete(asyncio.sleep(1.0))
        os.kill(pid, signal.SIGCONT)
        stopped = False
        victims = loop.run_until_complete(asyncio.wait_for(task, BATCH_TIMEOUT_S + 30))
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        loop.close()
    assert victims == {rid.replace("reference", "victim"): v for rid, v in reference.items()}
    wait_until(lambda: transfer_leftovers([prefill, decode]), CLEAN_WITHIN_S,
               "every node free == total with nothing held after the resume", interval=0.2)
    assert decode_metric(cluster, "pdserve:kv_stale_writes_total") == 0
    assert decode_metric(cluster, "pdserve:kv_key_rotations_total") == 1
    print(f"\nprefill SIGSTOP mid-transfer: {len(results)} requests done {done:.2f} s after the stop, the key "
          f"rotated and every page free {released:.2f} s after it; victims equal the fault-free run")
    # and the resumed prefill node serves again, its writes under the new key landing whole
    ok = decode_metric(cluster, "pdserve:prefill_requests_total", "prefill-0", outcome="ok")
    after = batch(cluster.url, VICTIMS[:2], VICTIM, "after")
    assert after == {f"after-{i}": reference[f"reference-{i}"] for i in range(2)}
    assert decode_metric(cluster, "pdserve:prefill_requests_total", "prefill-0", outcome="ok") > ok
