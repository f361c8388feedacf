"""What the decode side's transfer state machine needs from its node, as small typed interfaces:
the prefill nodes it sends work to (`PrefillTarget`: one Prefill / AbortPrefill call, the node's
last health answer), the pool that chooses among them (`PrefillClient`), and the node's metrics
and log binding (`TransferTelemetry`: kv_messenger may not import pdserve.serving).

decode_node supplies them over gRPC (decode_node.prefill_pool) and turns grpc.aio's errors into
`RpcError` at that edge: the state machine reads only a status code's name and its details, so
nothing here names grpc, and a unit test drives the state machine with a fake client
(tests/unit/test_decode_transfer_states.py). The requests and answers are the wire's protobuf
messages (pdserve_api), which kv_messenger may build.

Owns no state, runs on no thread of its own; nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve_api.v1 import prefill_pb2

UNAVAILABLE = "UNAVAILABLE"   # the status code name that marks a prefill node down


class RpcError(Exception):
    """A Prefill or AbortPrefill call that failed: the gRPC status code's name and its details
    (converted from grpc.aio.AioRpcError by the node, decode_node.prefill_pool)."""

    def __init__(self, code: str, details: str | None) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code         # e.g. "UNAVAILABLE", "DEADLINE_EXCEEDED"
        self.details = details   # as the server (or the channel) said it; may be None


class PrefillTarget(Protocol):
    """One prefill node, as the transfers use it (loop-owned; decode_node.prefill_pool.PrefillNode)."""

    address: str
    peer: Any               # its fabric PeerDescriptor (from GetNodeInfo); None until known
    tp_size: int            # its tensor-parallel size (fixes the write count, D14)
    last_answer: float      # time.monotonic() of its last GetNodeInfo answer (stall detection)
    sent_tokens: int        # prompt tokens this node has in flight there (its load)
    holds: int              # quarantines whose AbortPrefill still goes there (keeps its channel open)

    async def prefill(self, req: prefill_pb2.PrefillRequest, timeout: float) -> prefill_pb2.PrefillResponse:
        """One Prefill call; RpcError when it fails."""
        ...

    async def abort(self, req: prefill_pb2.AbortPrefillRequest,
                    timeout: float) -> prefill_pb2.AbortPrefillResponse:
        """One AbortPrefill call; RpcError when it fails."""
        ...


class PrefillClient(Protocol):
    """The prefill pool (decode_node.prefill_pool.PrefillPool): which node gets an attempt."""

    nodes: Sequence[PrefillTarget]

    def choose(self, exclude: set[str], token_ids: Sequence[int]) -> PrefillTarget | None:
        """An up node not in `exclude` whose fabric engine is known; None when there is none."""
        ...

    def retry_in(self, exclude: set[str]) -> float | None:
        """Seconds until a node marked down may be tried again; None when there is none."""
        ...

    def describe_down(self) -> str:
        """'ADDR (down: why)' for every node out of rotation."""
        ...

    def mark_down(self, node: PrefillTarget, why: str) -> None:
        ...


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Labelled(Protocol):
    def labels(self, *args: str, **kwargs: str) -> Any: ...

    def remove(self, *labels: str) -> None: ...


@dataclass(frozen=True)
class TransferTelemetry:
    """The node's metric families the transfers count in (pdserve.serving.metrics.NodeMetrics'
    members of the same names), and how a task binds its request id to its log lines
    (pdserve.serving.logs.bind_request_id)."""

    kv_stale_writes: Counter
    kv_context_rejected: Counter
    kv_checksum_failures: Counter
    kv_checksums_verified: Counter
    kv_key_rotations: Counter
    kv_quarantine_oldest: Labelled     # gauge, label peer
    kv_transfer_bytes: Labelled        # counter, labels model_name, side
    kv_transfer_seconds: Labelled      # histogram, labels model_name, side
    bind_request_id: Callable[[str], None]
