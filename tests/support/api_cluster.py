"""What the API tests (test_http_api.py, test_grpc_api.py) share: the cluster they start, and the
page-leak checks they make on every node through the GetNodeInfo RPC (R4, S2)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # router/ and the nodes may postdate the editable install
    sys.path.insert(0, str(ROOT))

from pdserve_api.v1 import common_pb2, node_pb2, node_pb2_grpc  # noqa: E402

NODES_EXIST = (ROOT / "prefill_node" / "__main__.py").exists() and (ROOT / "decode_node" / "__main__.py").exists()

# One prefill and one decode node, small engines (two cores); prompts of more than 16 tokens take
# several prefill chunks (short steps: a cancel waits for the step in flight), so a long prompt keeps
# the prefill node busy long enough to be cut short.
# Pages of 64 tokens: the short prompts these tests repeat (a chat turn is 37 tokens with its
# template) never fill a page, so no request reuses pages another one left in a prefix cache; the
# long prompts start with a tag of their own (test_http_api's cached-tokens test repeats one on
# purpose).
CLUSTER = dict(prefill=1, decode=1, port=0, http_port=0, num_blocks=64, threads_per_node=1,
               engine_args=("--max-batch-tokens", "16", "--page-size", "64"), startup_timeout_s=150,
               router_health_interval_s=0.5)
# ~790 tokens: about 50 prefill chunks on the prefill node (seconds of work), 13 of 64 pages.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 56
FREE_WITHIN_S = 1.0  # R4: a cancelled request holds no page anywhere this long after the cancel


def node_load(address: str, timeout: float = 5.0) -> common_pb2.NodeLoad:
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=timeout).load


def node_addresses(cluster) -> list[str]:
    return [s.address for s in cluster.specs if s.role != "router"]


def wait_busy(address: str, timeout: float = 60.0) -> None:
    """Until the node at `address` has a request in flight (bounded)."""
    deadline = time.monotonic() + timeout
    while node_load(address).outstanding_requests == 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"node {address} never had a request in flight within {timeout} s")
        time.sleep(0.02)


def assert_all_free(cluster, since: float, within: float = FREE_WITHIN_S) -> float:
    """Every node's free KV blocks equal its total and nothing is outstanding, no later than `within`
    seconds after the monotonic time `since`; returns how long after `since` that was seen."""
    nodes = node_addresses(cluster)
    while True:
        loads = {a: node_load(a) for a in nodes}
        held = {a: (x.free_kv_blocks, x.total_kv_blocks, x.outstanding_requests) for a, x in loads.items()
                if x.free_kv_blocks != x.total_kv_blocks or x.outstanding_requests}
        elapsed = time.monotonic() - since
        if not held:
            return elapsed
        if elapsed > within:
            raise AssertionError(f"{elapsed:.2f} s after the cancel, pages are still held "
                                 f"(address: free, total, outstanding requests): {held}")
        time.sleep(0.02)
