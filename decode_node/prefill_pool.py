"""The prefill nodes a decode node can use, and which one gets the next request.

Selection is by least outstanding prompt tokens (R3): the tokens this decode node has sent to a
node and not yet seen finish, plus the node's own reported load, refreshed by GetNodeInfo. A node
whose calls fail is marked down and probed again later.

With prefix affinity (`--prefill-routing prefix`), a prompt goes to the node that was sent its
leading blocks before (the prefix cache that can skip them is the prefill node's), as long as that
node's load is under the cap (pdserve.serving.prefix_index.LoadCap); otherwise, and with no match, least
loaded. A node marked down is forgotten: it may have restarted with an empty cache.

Version skew (NodeInfo.build, pdserve.serving.build_identity): a node whose model or KV-layout hash
differs from this decode node's (or that reports none) is never chosen; the skip is logged with both
identities when it starts and ends, and pdserve:incompatible_peers{peer} is 1 while it lasts.

The pool is the decode side's `PrefillClient` and each node its `PrefillTarget`
(kv_messenger.decode.client): the transfer state machine calls `PrefillNode.prefill` / `abort`,
which turn grpc.aio's errors into RpcError here, at the node's edge.

Runs on the decode node's asyncio loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from kv_messenger.decode.client import RpcError
from kv_messenger.ticket import peer_from_bytes
from pdserve.serving.build_identity import BuildIdentity, incompatibility
from pdserve.serving.channels import PLAINTEXT, ChannelSecurity, open_channel
from pdserve.serving.discovery import Membership
from pdserve.serving.metrics import node_metrics
from pdserve.serving.prefix_index import Candidate, LoadCap, PrefixIndex, chain_hashes, choose, token_blocks
from pdserve_api.v1 import node_pb2, node_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

RETRY_DOWN_AFTER_S = 2.0
# A restarted prefill node is reconnected within about a second (gRPC's default backoff grows to
# minutes while it is down, and a node back at its address would stay unused that long).
RECONNECT = (("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
             ("grpc.max_reconnect_backoff_ms", 1000))
PREFILL_ROUTING = ("least-loaded", "prefix")


@dataclass(frozen=True)
class PrefixAffinity:
    """Prefix-aware choice of prefill nodes: blocks of `block_tokens` ids (the decode node's page
    size), the first `max_blocks` of a prompt, `capacity` block hashes remembered, the load cap."""

    block_tokens: int = 16
    max_blocks: int = 128
    capacity: int = 1 << 16
    cap: LoadCap = LoadCap()

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_blocks < 1 or self.capacity < 1:
            raise ValueError(f"prefix affinity needs block_tokens, max_blocks and capacity >= 1, got "
                             f"{self.block_tokens}, {self.max_blocks}, {self.capacity}")


@dataclass
class PrefillNode:
    address: str
    channel: grpc.aio.Channel
    prefill_stub: prefill_pb2_grpc.PrefillServiceStub
    info: node_pb2_grpc.NodeServiceStub
    peer: object | None = None            # fabric PeerDescriptor, from NodeInfo
    tp_size: int = 1                      # its tensor-parallel size, from NodeInfo (fixes the write count, D14)
    reported_tokens: int = 0              # outstanding tokens the node reports
    sent_tokens: int = 0                  # tokens this decode node has in flight there
    holds: int = 0                        # quarantines whose AbortPrefill still goes here
    down_since: float | None = None
    down_reason: str = ""
    last_answer: float = 0.0              # time.monotonic() of its last GetNodeInfo answer (stall detection)
    node_id: str = ""
    incompatible: str = ""                # why its build cannot pair with ours ('' when it can)
    extra: dict = field(default_factory=dict)

    @property
    def load(self) -> int:
        return self.sent_tokens + self.reported_tokens

    async def prefill(self, req: prefill_pb2.PrefillRequest, timeout: float) -> prefill_pb2.PrefillResponse:
        """One Prefill call (deadline `timeout`); RpcError when it fails. Cancelling it cancels the call."""
        try:
            return await self.prefill_stub.Prefill(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise RpcError(e.code().name, e.details()) from e

    async def abort(self, req: prefill_pb2.AbortPrefillRequest,
                    timeout: float) -> prefill_pb2.AbortPrefillResponse:
        """One AbortPrefill call (deadline `timeout`); RpcError when it fails."""
        try:
            return await self.prefill_stub.AbortPrefill(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise RpcError(e.code().name, e.details()) from e


class PrefillPool:
    def __init__(self, addresses: list[str], affinity: PrefixAffinity | None = None,
                 security: ChannelSecurity = PLAINTEXT, identity: BuildIdentity | None = None) -> None:
        if not addresses:
            raise ValueError("a decode node needs at least one prefill node address (or --colocated)")
        self.affinity = affinity
        self.index = PrefixIndex(affinity.capacity) if affinity is not None else None
        self.identity = identity   # this decode node's build: None checks nothing (pool tests)
        self.nodes: list[PrefillNode] = []
        # Static addresses now; dns:NAME:PORT entries resolved at each refresh (pdserve.serving.discovery).
        self.members = Membership(addresses)
        self._retired: list[PrefillNode] = []   # left discovery; channel closed once nothing is in flight there

        def connect(addr: str) -> PrefillNode:
            ch = open_channel(addr, security, options=RECONNECT)   # TLS / token as configured, keepalive
            return PrefillNode(addr, ch, prefill_pb2_grpc.PrefillServiceStub(ch), node_pb2_grpc.NodeServiceStub(ch))

        self._connect = connect
        self.nodes.extend(connect(addr) for addr in self.members.static)

    async def refresh(self, timeout: float = 2.0) -> None:
        """Poll every node's NodeInfo (load and fabric peer) at once, so that a stalled node does
        not delay the others' answers (stall detection reads them); failures mark a node down."""
        await self.discover()
        await asyncio.gather(*(self.refresh_node(n, timeout) for n in self.nodes))

    async def refresh_node(self, n: PrefillNode, timeout: float = 2.0) -> None:
        """Poll one node's NodeInfo; a failure (no answer, or a fabric peer we cannot read) marks it down."""
        try:
            info = await n.info.GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            self.mark_down(n, f"GetNodeInfo: {e.code().name}")
            return
        try:   # a malformed or version-skewed descriptor marks the node down; its poll goes on
            peer = peer_from_bytes(info.fabric_peer) if info.fabric_peer else None
        except ValueError as e:
            if n.down_since is None:
                logger.error("prefill node %s (%s) answered an unusable fabric peer: %s", n.address,
                             info.node_id or "?", e)
            self.mark_down(n, f"GetNodeInfo: unusable fabric_peer ({e})")
            return
        n.last_answer = time.monotonic()
        n.node_id = info.node_id
        self._check_build(n, info)
        n.reported_tokens = int(info.load.outstanding_tokens)
        n.tp_size = max(1, int(info.sharding.tp_size)) if info.HasField("sharding") else 1
        if peer is not None:
            if n.peer is not None and peer.engine_id != n.peer.engine_id:
                logger.info("prefill node %s restarted (fabric engine %s, was %s)", n.address, peer.engine_id[:8],
                            n.peer.engine_id[:8])
            n.peer = peer
        if n.down_since is not None:
            logger.info("prefill node %s is back", n.address)
        n.down_since = None

    async def discover(self) -> list[PrefillNode]:
        """dns: entries resolved again: new prefill nodes join (chosen once a refresh read their
        NodeInfo), nodes that left are chosen no more. Returns the nodes that joined."""
        added: list[PrefillNode] = []
        change = await self.members.refresh()
        if change is not None:
            gone = set(change.removed)
            for n in [n for n in self.nodes if n.address in gone]:
                self.nodes.remove(n)
                self._retired.append(n)
                if n.incompatible:   # gone: no longer skipped
                    node_metrics().incompatible_peers.labels(peer=n.address).set(0)
                if self.index is not None:
                    self.index.forget(n.address)
            known = {n.address for n in self.nodes}
            added = [self._connect(a) for a in change.added if a not in known]
            self.nodes.extend(added)
        # a retired node's channel stays open while a quarantine still asks it to confirm its abort
        for n in [n for n in self._retired if n.sent_tokens == 0 and n.holds == 0]:
            self._retired.remove(n)
            await n.channel.close()
        return added

    def _check_build(self, n: PrefillNode, info: node_pb2.NodeInfo) -> None:
        """Skip `n` while its model or KV layout differs from ours (logged at each change, and the gauge)."""
        if self.identity is None:
            return
        why = incompatibility(self.identity, BuildIdentity.from_pb(info.build))
        if why and why != n.incompatible:
            logger.error("prefill node %s (%s) skipped: %s", n.address, info.node_id or "?", why)
        elif not why and n.incompatible:
            logger.info("prefill node %s (%s) is compatible again: %s", n.address, info.node_id or "?",
                        self.identity.describe())
        n.incompatible = why
        node_metrics().incompatible_peers.labels(peer=n.address).set(1 if why else 0)

    def mark_down(self, node: PrefillNode, why: str) -> None:
        if node.down_since is None:
            logger.warning("prefill node %s marked down: %s", node.address, why)
        node.down_since = time.monotonic()
        node.down_reason = why
        if self.index is not None:
            self.index.forget(node.address)

    def usable(self) -> bool:
        """Whether some node can be sent work now: up, its fabric engine known, its build compatible."""
        return any(n.peer is not None and n.down_since is None and not n.incompatible for n in self.nodes)

    def describe_down(self) -> str:
        """'ADDR (down: why)' for every node currently out of rotation."""
        return "; ".join([f"{n.address} (down: {n.down_reason})" for n in self.nodes if n.down_since is not None]
                         + [f"{n.address} (incompatible: {n.incompatible})" for n in self.nodes
                            if n.incompatible and n.down_since is None])

    def choose(self, exclude: set[str] = frozenset(), token_ids: Sequence[int] = ()) -> PrefillNode | None:
        """The up node for a prompt of `token_ids` (down nodes are retried after a while): least
        outstanding prompt tokens, or with prefix affinity the node sent its prefix before (under the
        load cap), which is then recorded as sent it. None when every node is excluded or down."""
        now = time.monotonic()
        # Only nodes whose fabric engine we know (an abort must name it, S5); up ones first, and a
        # down one only once RETRY_DOWN_AFTER_S passed and no up one is left.
        known = [n for n in self.nodes if n.address not in exclude and n.peer is not None and not n.incompatible]
        candidates = [n for n in known if n.down_since is None] or [
            n for n in known if n.down_since is not None and now - n.down_since > RETRY_DOWN_AFTER_S]
        if not candidates:
            return None
        if self.affinity is None or self.index is None:
            return min(candidates, key=lambda n: n.load)
        hashes = chain_hashes(token_blocks(token_ids, self.affinity.block_tokens, self.affinity.max_blocks))
        ranked = [Candidate(n.address, n.load, i) for i, n in enumerate(candidates)]
        picked = choose(ranked, self.index.matches(hashes), self.affinity.cap)
        self.index.record(hashes, picked.key)
        return self.by_address(picked.key)

    def retry_in(self, exclude: set[str] = frozenset()) -> float | None:
        """When `choose(exclude)` found nothing: seconds until a node marked down (not excluded, not
        incompatible; known or never answered yet) may be tried again; None when there is none (a
        busy node's missed GetNodeInfo also marks it down, and its request should wait for it rather
        than fail)."""
        now = time.monotonic()
        # A node that has never answered (its fabric engine unknown: it was still starting when it
        # was first polled) is waited for the same way: its refresh loop polls it every
        # POOL_REFRESH_S meanwhile, and choose() takes it once it answered (a request arriving just
        # after the cluster came up must not fail because the one untried node was polled too early).
        waits = [max(0.0, n.down_since + RETRY_DOWN_AFTER_S - now) for n in self.nodes
                 if n.address not in exclude and n.down_since is not None and not n.incompatible]
        return min(waits) if waits else None

    def by_address(self, address: str) -> PrefillNode:
        for n in self.nodes:
            if n.address == address:
                return n
        raise KeyError(address)

    async def close(self) -> None:
        for n in [*self.nodes, *self._retired]:
            await n.channel.close()
