"""Clusters for the tests that start them (tests/integration: the API tests, test_cluster,
test_bench_harness, test_cluster_metrics): starting one with its logs in a temporary folder, as a
fixture, and the page-leak checks made on every node through the GetNodeInfo RPC (R4, S2)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pdserve.serving.channels import PLAINTEXT, ChannelSecurity, open_sync_channel
from pdserve.tools.launcher import Cluster
from pdserve_api.v1 import common_pb2, node_pb2, node_pb2_grpc
from support.wait import wait_until

# The API tests' cluster (test_http_api.py, test_grpc_api.py): one prefill and one decode node, small
# engines (two cores); prompts of more than 16 tokens take several prefill chunks (short steps: a
# cancel waits for the step in flight), so a long prompt keeps the prefill node busy long enough to
# be cut short.
# Pages of 64 tokens: the short prompts these tests repeat (a chat turn is 37 tokens with its
# template) never fill a page, so no request reuses pages another one left in a prefix cache; the
# long prompts start with a tag of their own (test_http_api's cached-tokens test repeats one on
# purpose).
API_CLUSTER = dict(prefill=1, decode=1, port=0, http_port=0, num_blocks=64, threads_per_node=1,
                   engine_args=("--max-batch-tokens", "16", "--page-size", "64"), startup_timeout_s=150,
                   router_health_interval_s=0.5)
# ~790 tokens: about 50 prefill chunks on the prefill node (seconds of work), 13 of 64 pages.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 56
FREE_WITHIN_S = 1.0  # R4: a cancelled request holds no page anywhere this long after the cancel
LEAK_WAIT_S = 30.0   # S2: after a run, frees may trail the last stream by this much at most


@contextlib.contextmanager
def running_cluster(tmp_path_factory: pytest.TempPathFactory, name: str, **config: Any) -> Iterator[Cluster]:
    """A started Cluster(**config), its processes' logs in a fresh temporary folder `name`; stopped on exit."""
    with Cluster(log_dir=str(tmp_path_factory.mktemp(name)), **config) as cluster:
        yield cluster


def cluster_fixture(name: str, scope: str = "module", **config: Any):
    """A pytest fixture (assign it to a name in the test module) yielding running_cluster(name, **config)."""

    @pytest.fixture(scope=scope)
    def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
        with running_cluster(tmp_path_factory, name, **config) as c:
            yield c

    return cluster


def node_load(address: str, timeout: float = 5.0, security: ChannelSecurity = PLAINTEXT) -> common_pb2.NodeLoad:
    with open_sync_channel(address, security) as channel:
        return node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=timeout).load


def node_addresses(cluster: Cluster) -> list[str]:
    return [s.address for s in cluster.specs if s.role != "router"]


@dataclass(frozen=True)
class PageState:
    """The nodes that still hold KV pages or requests: address -> (free blocks, total blocks,
    outstanding requests). True when there are none (so wait_until can wait for it)."""

    held: dict[str, tuple[int, int, int]]

    def __bool__(self) -> bool:
        return not self.held


def page_state(cluster: Cluster) -> PageState:
    loads = {a: node_load(a, security=cluster.client_security) for a in node_addresses(cluster)}
    return PageState({a: (x.free_kv_blocks, x.total_kv_blocks, x.outstanding_requests) for a, x in loads.items()
                      if x.free_kv_blocks != x.total_kv_blocks or x.outstanding_requests})


def wait_busy(address: str, timeout: float = 60.0) -> None:
    """Until the node at `address` has a request in flight (bounded)."""
    wait_until(lambda: node_load(address).outstanding_requests, timeout,
               f"node {address} to have a request in flight (outstanding requests)")


def assert_no_page_leak(cluster: Cluster, within: float = LEAK_WAIT_S) -> None:
    """S2: every node's free blocks return to its total and nothing is outstanding (bounded: frees
    may trail the stream)."""
    wait_until(lambda: page_state(cluster), within,
               "every node's pages free (address: free, total, outstanding requests)", interval=0.2)


def assert_all_free(cluster: Cluster, since: float, within: float = FREE_WITHIN_S) -> float:
    """Every node's free KV blocks equal its total and nothing is outstanding, no later than `within`
    seconds after the monotonic time `since`; returns how long after `since` that was seen."""
    remaining = max(since + within - time.monotonic(), 1e-3)  # one look even when `within` is spent
    wait_until(lambda: page_state(cluster), remaining,
               f"every node's pages free within {within} s of the cancel "
               "(address: free, total, outstanding requests)")
    return time.monotonic() - since


# --- transfer faults (tests/integration/test_transfer_faults.py) ----------------------------------


def node_info(address: str, timeout: float = 5.0, security: ChannelSecurity = PLAINTEXT) -> node_pb2.NodeInfo:
    with open_sync_channel(address, security) as channel:
        return node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=timeout)


@dataclass(frozen=True)
class TransferLeftovers:
    """What nodes still track after a fault: address -> the non-zero counts among free != total
    blocks, outstanding requests and NodeInfo.transfers (quarantined pages and transfers, tags,
    context slots, held requests, active transfers, stale writes). True when there is none."""

    left: dict[str, dict[str, int]]

    def __bool__(self) -> bool:
        return not self.left


def transfer_leftovers(addresses: list[str]) -> TransferLeftovers:
    left: dict[str, dict[str, int]] = {}
    for a in addresses:
        info = node_info(a)
        t, load = info.transfers, info.load
        counts = {"used_blocks": load.total_kv_blocks - load.free_kv_blocks,
                  "outstanding": load.outstanding_requests,
                  **{f.name: int(v) for f, v in t.ListFields()}}
        counts = {k: v for k, v in counts.items() if v}
        if counts:
            left[a] = counts
    return TransferLeftovers(left)


def process_pid(cluster: Cluster, name: str) -> int:
    """The pid of a running child (SIGSTOP / SIGCONT fault tests: Cluster.kill waits for an exit)."""
    proc = cluster._children[name].proc   # the launcher keeps its children private
    assert proc is not None and proc.poll() is None, f"{name} is not running"
    return proc.pid


_ROUTED = re.compile(r"generate request_id=(\S+) node=(\S+) .* resumed=(\d+)")


def routed(cluster: Cluster) -> list[tuple[str, str, int]]:
    """Every attempt the router's log names, in order: (request id, decode node address, tokens the
    attempt resumed after: 0 for a first attempt, > 0 for a stream the router moved)."""
    log = (cluster.log_dir / "router.log").read_text(errors="replace")
    return [(m[1], m[2], int(m[3])) for m in _ROUTED.finditer(log)]
