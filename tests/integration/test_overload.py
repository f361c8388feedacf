"""Overload on a real cluster (issue 15's evidence: "prefill overload (300 concurrent long prompts);
decode out of pages; 2000 concurrent streams"; S2, S8).

One cluster: 1 prefill + 1 decode node and the router, a tiny model, small pools (64 pages of 16
tokens on each node: 1024 tokens), the router's in-flight cap lowered to ROUTER_INFLIGHT_CAP.
Every test asserts, never assumes:
- every request ends, within its deadline, with its tokens or an explicit RESOURCE_EXHAUSTED
  (the router's or a node's cap); no other error, no request left hanging;
- no process exited;
- afterwards every node is back to free == total with nothing held, tagged, slotted or in flight,
  and no stale KV write was counted;
- a fresh request succeeds.

(a) prefill overload: 300 concurrent prompts of ~110 tokens (7 pages each: the decode pool holds 9
    at a time, the 300 together need 33x the pool) through the router;
(b) decode out of pages: 12 concurrent requests that each grow to 10 pages while decoding (120
    pages together, the pool has 64): they queue or are preempted, and the greedy tokens of those
    run alone before are the same under the squeeze;
(c) 2000 concurrent streams (max_tokens 2) on one grpc.aio channel: more than the router's cap,
    so the rest must be refused explicitly; the router's open file descriptors return to their
    baseline (plus a small bound) and its resident memory grows by less than RSS_GROWTH_BOUND.

Counts of what ended how are printed, never asserted beyond the rules above. Every wait is bounded
(per request REQUEST_TIMEOUT_S, per batch BATCH_TIMEOUT_S, cleanup CLEAN_WITHIN_S).
"""

from __future__ import annotations

import asyncio
import collections
import os

import grpc
import pytest
from support.cluster import process_pid, running_cluster, transfer_leftovers
from support.prometheus import fetch, parse, total
from support.tiny_models import make_tiny_checkpoint
from support.wait import wait_until

from pdserve_api.v1 import generate_pb2, generate_pb2_grpc

REQUEST_TIMEOUT_S = 90.0
BATCH_TIMEOUT_S = 150.0
CLEAN_WITHIN_S = 30.0
ROUTER_INFLIGHT_CAP = 600
FD_SLACK = 16                       # fds the router may hold beyond its baseline once the streams ended
RSS_GROWTH_BOUND = 256 << 20        # bytes of resident memory the 2000 streams may leave behind
PAGE = 16
# The router's health Check deadline. Its default (1 s) is missed under the 2000-stream burst on 2
# cores, and one miss takes the only decode node out of rotation: ~6% of the streams then end
# UNAVAILABLE "no healthy decode node ... health check failed: DEADLINE_EXCEEDED" (reported to the
# router's owner; a busy node is not a dead one). Keepalive still notices a dead node within ~10 s.
HEALTH_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "tiny-llama")
    with running_cluster(tmp_path_factory, "overload", prefill=1, decode=1, port=0, http_port=None, model=str(model),
                         num_blocks=64, threads_per_node=1, startup_timeout_s=150, router_health_interval_s=0.5,
                         engine_args=("--max-batch-tokens", "64", "--page-size", str(PAGE)),
                         router_args=("--max-inflight-requests", str(ROUTER_INFLIGHT_CAP),
                                      "--health-timeout", str(HEALTH_TIMEOUT_S))) as c:
        yield c


def _request(rid: str, text: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(request_id=rid, text=text, sampling=generate_pb2.SamplingOptions(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def _one(stub: generate_pb2_grpc.GenerateServiceStub, req: generate_pb2.GenerateRequest) -> tuple[int, ...] | str:
    """The request's tokens, or 'CODE: details' of the status it ended with."""
    tokens: list[int] = []
    try:
        async for msg in stub.Generate(req, timeout=REQUEST_TIMEOUT_S):
            tokens.extend(msg.token_ids)
            if msg.error:
                return f"error in stream: {msg.error}"
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return tuple(tokens)


def run_batch(cluster, requests: list[generate_pb2.GenerateRequest]) -> dict[str, tuple[int, ...] | str]:
    async def go() -> dict[str, tuple[int, ...] | str]:
        async with grpc.aio.insecure_channel(cluster.url) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            outs = await asyncio.gather(*(_one(stub, r) for r in requests))
        return {r.request_id: o for r, o in zip(requests, outs, strict=True)}

    return asyncio.run(asyncio.wait_for(go(), BATCH_TIMEOUT_S))


def assert_ended_explicitly(results: dict[str, tuple[int, ...] | str], max_tokens: int, what: str) -> None:
    """Every request has its max_tokens tokens or an explicit RESOURCE_EXHAUSTED; prints the tally."""
    bad = {rid: r for rid, r in results.items()
           if not (isinstance(r, tuple) and len(r) == max_tokens)
           and not (isinstance(r, str) and r.startswith("RESOURCE_EXHAUSTED"))}
    tally = collections.Counter("tokens" if isinstance(r, tuple) else r.split(":")[0] for r in results.values())
    print(f"{what}: {dict(tally)}")
    assert not bad, f"{what}: {len(bad)} requests ended otherwise: {dict(list(bad.items())[:5])}"
    assert tally["tokens"] > 0, f"{what}: no request was served at all: {dict(tally)}"


def stale_writes(cluster) -> float:
    samples = parse(fetch(cluster.metrics_urls["decode-0"])[0])
    assert any(name == "pdserve:kv_stale_writes_total" for name, _ in samples), "no kv_stale_writes_total"
    return total(samples, "pdserve:kv_stale_writes_total")


def assert_recovered(cluster) -> None:
    assert not cluster.poll(), f"processes exited: {cluster.poll()}"
    nodes = [s.address for s in cluster.specs if s.role != "router"]
    wait_until(lambda: transfer_leftovers(nodes), CLEAN_WITHIN_S,
               "every node free == total with nothing held, tagged, slotted or in flight", interval=0.2)
    assert stale_writes(cluster) == 0
    fresh = run_batch(cluster, [_request("fresh", "The capital of France is", 4)])
    assert isinstance(fresh["fresh"], tuple) and len(fresh["fresh"]) == 4, fresh


def test_prefill_overload_300_long_prompts(cluster):
    # ~110 tokens each (7 pages of 16), distinct heads: no prefix-cache hit between them
    filler = "the quick brown fox jumps over the lazy dog and runs into the forest. " * 7
    reqs = [_request(f"long-{i}", f"Overload prompt number {i}: {filler}", 2) for i in range(300)]
    assert_ended_explicitly(run_batch(cluster, reqs), 2, "300 long prompts")
    assert_recovered(cluster)


def test_decode_out_of_pages(cluster):
    # 12 prompts of ~30 tokens growing by 130 tokens: 10 pages each at the end, 120 together
    prompts = [f"Decode squeeze {i}: " + "one two three four five six seven eight nine ten " * 2 for i in range(12)]
    solo = {f"squeeze-{i}": run_batch(cluster, [_request(f"squeeze-{i}", prompts[i], 130)])[f"squeeze-{i}"]
            for i in (0, 5)}
    assert all(isinstance(v, tuple) and len(v) == 130 for v in solo.values()), solo
    results = run_batch(cluster, [_request(f"squeeze-{i}", p, 130) for i, p in enumerate(prompts)])
    assert_ended_explicitly(results, 130, "12 requests of 10 pages on a 64-page pool")
    for rid, tokens in solo.items():
        if isinstance(results[rid], tuple):
            assert results[rid] == tokens, f"{rid}: greedy tokens under the squeeze differ from its solo run"
    assert_recovered(cluster)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_2000_concurrent_streams(cluster):
    router = process_pid(cluster, "router")
    assert_recovered(cluster)   # warm: the router's channels and the first request's allocations exist
    fds0, rss0 = _fds(router), _rss(router)
    reqs = [_request(f"stream-{i}", f"Stream {i % 50} says", 2) for i in range(2000)]
    results = run_batch(cluster, reqs)
    assert_ended_explicitly(results, 2, "2000 streams")
    assert_recovered(cluster)
    wait_until(lambda: _fds(router) <= fds0 + FD_SLACK, CLEAN_WITHIN_S,
               f"the router's open fds back to its baseline {fds0} + {FD_SLACK}")
    grown = _rss(router) - rss0
    print(f"router: fds {fds0} -> {_fds(router)}, RSS {rss0 >> 20} MiB -> {(rss0 + grown) >> 20} MiB")
    assert grown < RSS_GROWTH_BOUND, f"the router's resident memory grew by {grown >> 20} MiB"
