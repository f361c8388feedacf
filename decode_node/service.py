"""The decode node's core: one engine and, disaggregated, the decode side of the transfer
(kv_messenger.decode.DecodeTransfers: one fabric endpoint, the KV receiver, the attempts,
quarantines and key rotation) plus the prefill pool (decode_node.prefill_pool) it sends work to.
Knows nothing of the gRPC server: decode_node.server converts and serves.

This module is a thin server: the config, building the parts, a request's begin and end, the
pool's refresh loops, load and transfer info. The transfer protocol (attempts, the Prefill call's
deadline and stall watch, S7 / D19, quarantine holds with AbortPrefill, fences and closes, key
rotation) is kv_messenger.decode's; its correctness argument and state diagrams are
docs/transfer-safety.md.

Threads and tasks: the engine thread (EngineThread) runs schedule -> run -> update, calls the
receiver's hooks and takes its events back (the transfer's completions: kv_messenger.decode.transfers,
kv_messenger.completions); the asyncio loop serves gRPC, runs this node's
pool refresh loops and the transfers' tasks; the fabric progress thread reports landed writes.

Blocking waits, with their bounds (all on the loop; no executor thread is parked): GetNodeInfo of
each prefill node every POOL_REFRESH_S (its own timeout, decode_node.prefill_pool); and, in
kv_messenger.decode, each listed with its bound in its module: a Prefill call, the write count,
a verification and a finished request's wait for its Prefill response (attempt.py); AbortPrefill,
its fence, a close of our connection and a hold's rounds and drain (quarantine.py: the hold itself
is unbounded by design, S5); a key rotation (rotation.py); an attempt whose only untried prefill
nodes are marked down waits for their retry (prefill_pool.RETRY_DOWN_AFTER_S, transfers.py).

TEST ONLY: the fault plan (DecodeNodeConfig.faults, pdserve.engine.faults) reaches the engine
thread, the receiver and the Prefill call (FaultPlan.bad_shard_key: PrefillWatch); without a plan,
no effect.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from decode_node.prefill_pool import PREFILL_ROUTING, PrefillNode, PrefillPool, PrefixAffinity
from kv_messenger import KvReceiver
from kv_messenger.decode import (  # noqa: F401 (re-exported: the names' old home, deprecated)
    ABORT_RPC_TIMEOUT_S,
    CHECKSUM_RETRIES_SAME_NODE,
    DRAIN_GRACE_S,
    DRAIN_WAIT_S,
    FENCE_WAIT_S,
    HOLD_BACKOFF_MAX_S,
    HOLD_BACKOFF_S,
    HOLD_POLL_S,
    KV_LANDED_WAIT_S,
    PREFILL_RESPONSE_WAIT_S,
    QUARANTINE_LOG_S,
    ROTATE_CLOSE_WAIT_S,
    ROTATE_POLL_S,
    STALL_POLL_S,
    DecodeTransfers,
    PrefillOutcome,
    Quarantine,
    RequestState,
    RequestTable,
    TransferSettings,
    TransferTelemetry,
)
from kv_messenger.decode.attempt import Attempt
from kv_messenger.placement import placement_info
from kv_messenger.ticket import peer_to_bytes
from kv_messenger.transport import TransferEngine, open_transfer_engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.faults import BAD_SHARD_KEY_ENV, NO_FAULTS, FaultPlan
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import TransferRole
from pdserve.serving.build_identity import engine_identity
from pdserve.serving.channels import PLAINTEXT, ChannelSecurity
from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import node_metrics, request_metrics
from pdserve_api.v1 import common_pb2, node_pb2

logger = logging.getLogger(__name__)

POOL_REFRESH_S = 1.0         # GetNodeInfo of every prefill node, this often
TEST_BAD_SHARD_KEY_ENV = BAD_SHARD_KEY_ENV   # deprecated alias: pdserve.engine.faults.BAD_SHARD_KEY_ENV
# Deprecated (issue 30): the transfer's names moved to kv_messenger.decode; the constants, RequestState,
# PrefillOutcome and Quarantine imported above are re-exported from here for their old importers.
Transfer = Attempt   # deprecated alias: kv_messenger.decode.Attempt


@dataclass(frozen=True)
class DecodeNodeConfig:
    """One decode (or colocated) node."""

    engine: EngineConfig
    node_id: str
    colocated: bool = False
    prefill_addresses: tuple[str, ...] = ()   # HOST:PORT of the prefill nodes (not colocated)
    provider: str | None = "shm"              # libfabric provider; None: $FI_PROVIDER or the default
    fabric_node: str | None = None            # local address the fabric endpoint binds (not for shm)
    prefill_timeout_s: float = 60.0           # deadline of one Prefill call
    stall_s: float = 3.0                      # no write landed and no health answer this long: stalled
    local_prefill_fallback: bool = False      # no prefill node can serve: prefill here instead of failing
    prefill_routing: str = "least-loaded"
    channel_security: ChannelSecurity = PLAINTEXT   # of the channels to prefill nodes (mTLS, token)
    max_waiting_requests: int = 2048          # requests held before their first token; more: RESOURCE_EXHAUSTED (S8)
    release_unfenced_by_close: bool = False   # ended-unfenced holds released by closing our connection
    kv_checksum: bool = False                 # S7: verify CRC32C of every landed run before scheduling
    # a hold this old, prefill silent or end unfenced: rotate the key (None: off; docs/transfer-safety.md)
    rotate_key_after_s: float | None = None
    faults: FaultPlan = NO_FAULTS             # TEST ONLY: the injected fault plan (pdserve.engine.faults)

    def __post_init__(self) -> None:
        if self.prefill_routing not in PREFILL_ROUTING:
            raise ValueError(f"prefill routing must be one of {PREFILL_ROUTING}, got {self.prefill_routing!r}")
        if not self.node_id:
            raise ValueError("node_id is empty")
        if not self.prefill_timeout_s > 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {self.prefill_timeout_s!r}")
        if not self.stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {self.stall_s!r}")
        if self.rotate_key_after_s is not None and not self.rotate_key_after_s > 0:
            raise ValueError(f"rotate_key_after_s must be > 0 (or None: off), got {self.rotate_key_after_s!r}")
        if self.colocated and self.prefill_addresses:
            raise ValueError(f"a colocated node uses no prefill nodes, got {list(self.prefill_addresses)}")

    def transfer_settings(self) -> TransferSettings:
        """The decode side's transfer options (kv_messenger.decode)."""
        return TransferSettings(
            node_id=self.node_id, prefill_timeout_s=self.prefill_timeout_s, stall_s=self.stall_s,
            local_prefill_fallback=self.local_prefill_fallback, max_waiting_requests=self.max_waiting_requests,
            release_unfenced_by_close=self.release_unfenced_by_close, kv_checksum=self.kv_checksum,
            rotate_key_after_s=self.rotate_key_after_s, faults=self.faults)


class DecodeNode:
    """Engine + the transfers' state machine + prefill pool. Build it (slow: loads the model), then
    `await start()` on the serving loop."""

    def __init__(self, config: DecodeNodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.colocated = config.colocated
        # every request's role: its prompt KV comes from a prefill node unless this node is colocated
        self.request_role = TransferRole.LOCAL if config.colocated else TransferRole.REMOTE_PREFILL
        self.metrics = node_metrics()
        request_metrics()  # registered now, so that /metrics names every family before the first request
        self.requests = RequestTable()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport: TransferEngine | None = None
        self.transfers: DecodeTransfers | None = None
        self.pool: PrefillPool | None = None
        self._refreshers: list[asyncio.Task] = []
        self.closing = False
        if config.faults.bad_shard_key:
            logger.warning("TEST ONLY: %r: those requests' attempts are sent a wrong memory key for one decode "
                           "rank's pool", config.faults.bad_shard_key)
        if config.colocated:
            self.engine = EngineThread(LLMEngine(config.engine), faults=config.faults)
        else:
            self.transport = open_transfer_engine(config.provider, config.fabric_node)
            try:
                self.transfers = DecodeTransfers(self.transport, config.transfer_settings(), self._telemetry(),
                                                 self.requests)
                # UnsupportedModelError (a ValueError): sliding-window / hybrid models
                self.engine = EngineThread(LLMEngine(config.engine, kv_connector=self.transfers.receiver),
                                           faults=config.faults)
            except BaseException:
                self.transport.close()
                raise
            self.transfers.attach(self.engine)
        self.llm = self.engine.engine
        info = self.llm.info()
        self.model_name: str = info.model_name
        self.max_model_len: int = info.max_model_len
        self._page_size = info.page_size
        plan = self.llm.tp_plan   # None at TP 1
        self.tp_size: int = plan.tp_size if plan is not None else 1
        self.kv_heads_per_rank: int = len(plan.ranks[0].kv_heads) if plan is not None else info.num_kv_heads
        # NodeInfo.build; prefill nodes of another model or KV layout are skipped (PrefillPool)
        codec = self.receiver.codec if self.receiver is not None else None
        self.identity = (engine_identity(self.llm, codec.top_k, codec.version, codec.hidden_kind, codec.history_rows)
                         if codec is not None
                         else engine_identity(self.llm, 0))
        for where in placement_info(self.receiver.placements if self.receiver is not None else ()):   # D16
            self.metrics.kv_shard_placement.labels(**where.labels()).set(1)

    def _telemetry(self) -> TransferTelemetry:
        m = self.metrics
        return TransferTelemetry(
            kv_stale_writes=m.kv_stale_writes, kv_context_rejected=m.kv_context_rejected,
            kv_checksum_failures=m.kv_checksum_failures, kv_checksums_verified=m.kv_checksums_verified,
            kv_key_rotations=m.kv_key_rotations, kv_quarantine_oldest=m.kv_quarantine_oldest,
            kv_transfer_bytes=m.kv_transfer_bytes, kv_transfer_seconds=m.kv_transfer_seconds,
            bind_request_id=bind_request_id)

    @property
    def receiver(self) -> KvReceiver | None:
        """Disaggregated: the engine's DecodeConnector (built by the transfers)."""
        return self.transfers.receiver if self.transfers is not None else None

    @property
    def tokenizer(self):  # a transformers tokenizer
        return self.llm.tokenizer

    async def start(self) -> None:
        """On the serving loop: open the prefill pool's channels (grpc.aio needs the loop)."""
        self.loop = asyncio.get_running_loop()
        if not self.config.colocated:
            cfg = self.config
            affinity = PrefixAffinity(block_tokens=self._page_size) if cfg.prefill_routing == "prefix" else None
            self.pool = PrefillPool(list(cfg.prefill_addresses), affinity, cfg.channel_security, self.identity)
            assert self.transfers is not None
            self.transfers.start(self.pool)
            await self.pool.refresh()
            # one loop per node: a stalled node's timeouts never delay another's answers, which
            # stall detection reads (PrefillNode.last_answer)
            self._refreshers = [asyncio.create_task(self._refresh_loop(n)) for n in self.pool.nodes]
            if self.pool.members.dynamic:   # dns: prefill targets, resolved again (pdserve.serving.discovery)
                self._refreshers.append(asyncio.create_task(self._discover_loop()))
            self.transfers.start_rotation()

    def readiness(self) -> str:
        """'' when this node can take requests, else why not (pdserve.serving.node_server's readiness:
        GenerateService NOT_SERVING): no prefill node is reachable and local prefill is not allowed."""
        if self.colocated or self.config.local_prefill_fallback:
            return ""
        if self.pool is None:
            return "the prefill pool is not started"
        if self.pool.usable():
            return ""
        return f"no prefill node is reachable ({self.pool.describe_down() or 'none answered yet'})"

    async def _refresh_loop(self, node: PrefillNode) -> None:
        assert self.pool is not None
        while node in self.pool.nodes:   # a node that left discovery is polled no more
            await asyncio.sleep(POOL_REFRESH_S)
            try:
                await self.pool.refresh_node(node)
            except Exception as e:   # a bug must not end this node's polls unseen: logged, marked down
                logger.exception("prefill node %s: refresh failed", node.address)
                self.pool.mark_down(node, f"refresh failed: {type(e).__name__}: {e}")

    async def _discover_loop(self) -> None:
        """Resolve the dns: prefill targets every POOL_REFRESH_S; a node that joins is polled at once,
        then by a refresh loop of its own."""
        assert self.pool is not None
        while True:
            await asyncio.sleep(POOL_REFRESH_S)
            for node in await self.pool.discover():
                await self.pool.refresh_node(node)
                self._refreshers.append(asyncio.create_task(self._refresh_loop(node)))

    async def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE); the in-flight ones go on until the server stops."""
        self.closing = True

    async def close(self) -> None:
        self.closing = True
        if self.transfers is not None:
            self.transfers.cancel()
        self.engine.shutdown()
        for task in self._refreshers:
            task.cancel()
        if self.pool is not None:
            await self.pool.close()
        if self.transport is not None:
            self.transport.close()

    # --- requests (loop) ---------------------------------------------------------------------------

    def begin(self, rid: str) -> RequestState:
        """A Generate handler starts serving `rid`; ValueError if the id is in use here."""
        return self.requests.begin(rid)

    def end(self, state: RequestState) -> None:
        """The handler of `state` is done: stop a transfer whose KV never landed; the state goes
        now, or when its transfer task ends."""
        self.requests.end(state)

    async def prefill_outcome(self, state: RequestState) -> PrefillOutcome | None:
        """Loop: the successful remote prefill of a request that is finishing, if it had one (waits
        at most PREFILL_RESPONSE_WAIT_S for its Prefill response: RequestTable.prefill_outcome)."""
        return await self.requests.prefill_outcome(state)

    def transfer_info(self) -> node_pb2.TransferInfo:
        """What this node still tracks of its transfers (any thread: counts read as they are)."""
        if self.receiver is None:
            return node_pb2.TransferInfo(held_requests=self.llm.num_held_requests)
        return node_pb2.TransferInfo(
            quarantined_kv_blocks=self.llm.num_quarantined_blocks, quarantined_transfers=self.llm.num_quarantines,
            tags_in_use=self.receiver.num_tags_in_use, context_slots_in_use=self.receiver.num_slots_in_use,
            stale_writes=self.receiver.stale_writes, held_requests=self.llm.num_held_requests)

    # --- load ---------------------------------------------------------------------------------

    def node_info(self) -> node_pb2.NodeInfo:
        """This node's identity and load for the router (any thread: reads EngineThread.last_load)."""
        info, load = self.llm.info(), self.engine.last_load
        role = node_pb2.NODE_ROLE_COLOCATED if self.colocated else node_pb2.NODE_ROLE_DECODE
        return node_pb2.NodeInfo(
            node_id=self.node_id, role=role, model=info.model_name,
            sharding=common_pb2.ShardingScheme(tp_size=self.tp_size, kv_heads_per_rank=self.kv_heads_per_rank,
                                               total_kv_heads=info.num_kv_heads),
            load=common_pb2.NodeLoad(
                outstanding_requests=load.num_unfinished,
                outstanding_tokens=load.prompt_tokens_left + load.output_tokens_left,
                waiting_requests=load.num_waiting, running_requests=load.num_running,
                free_kv_blocks=load.free_blocks, total_kv_blocks=load.total_blocks,
                page_size=info.page_size),
            num_layers=info.num_layers, max_context_length=info.max_model_len,
            fabric_peer=peer_to_bytes(self.transport.peer_descriptor) if self.transport is not None else b"",
            transfers=self.transfer_info(), build=self.identity.to_pb(),
        )
