"""Back-pressure on a real node (S8): a decode node refuses a request past --max-waiting-requests
(requests without a first token yet) with RESOURCE_EXHAUSTED naming the count and the cap, on its
own port; through the router the same refusal is gRPC RESOURCE_EXHAUSTED and HTTP 429 with
Retry-After, and the node keeps serving once its queue drains. One colocated node (cheapest: no
prefill node, no fabric) with a waiting cap of 1 and a long prompt that keeps it prefilling."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from support.cluster import LONG_PROMPT, assert_no_page_leak, running_cluster, wait_busy

from pdserve_api.v1 import generate_pb2, generate_pb2_grpc

CLUSTER = dict(colocated=1, port=0, http_port=0, num_blocks=64, threads_per_node=1, startup_timeout_s=150,
               engine_args=("--max-batch-tokens", "16", "--page-size", "64", "--max-waiting-requests", "1"),
               router_health_interval_s=0.5)
WAIT = 120.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, "backpressure", **CLUSTER) as c:
        yield c


def _short(rid: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(request_id=rid, text="The capital of France is",
                                        sampling=generate_pb2.SamplingOptions(max_tokens=2, temperature=0))


def test_a_full_decode_node_refuses_with_resource_exhausted_and_the_router_answers_429(cluster):
    node = next(s.address for s in cluster.specs if s.role == "colocated")

    async def go():
        async with grpc.aio.insecure_channel(node) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            long = stub.Generate(generate_pb2.GenerateRequest(
                request_id="long", text="backpressure: " + LONG_PROMPT,
                sampling=generate_pb2.SamplingOptions(max_tokens=2)), timeout=WAIT)
            first = asyncio.ensure_future(long.read())
            await asyncio.to_thread(wait_busy, node)      # admitted, prefilling: it waits for its first token
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(_short("refused"), timeout=WAIT).read()
            direct = err.value.code(), err.value.details()

            def http() -> tuple[int, str | None, str]:
                body = json.dumps({"prompt": "The capital of France is", "max_tokens": 2}).encode()
                req = urllib.request.Request(f"{cluster.http_url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=WAIT) as r:
                        return r.status, None, r.read().decode()
                except urllib.error.HTTPError as e:
                    return e.code, e.headers.get("Retry-After"), e.read().decode()

            via_router = await asyncio.to_thread(http)
            long.cancel()
            first.cancel()
            return direct, via_router

    (code, details), (status, retry_after, body) = asyncio.run(asyncio.wait_for(go(), WAIT))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "1 requests waiting for their first token, its cap (max 1)" in details
    assert status == 429 and retry_after == "1", (status, retry_after, body)
    assert "every decode node is full" in json.loads(body)["error"]["message"]
    assert_no_page_leak(cluster)
    with grpc.insecure_channel(node) as channel:      # drained: served again
        *_, last = generate_pb2_grpc.GenerateServiceStub(channel).Generate(_short("after"), timeout=WAIT)
    assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
