"""The prefill node's core: one engine and the prefill side of the transfer protocol, and the
lifecycle of each Prefill (D1, D5-D8, D11, D12, S4, S5). Knows nothing of gRPC: the server converts.

The transfer half lives in kv_messenger.prefill_transfers (`PrefillTransfers`: the fabric endpoint,
the KV sender, the registry keyed by TransferKey, tombstones, connection epochs, the AbortPrefill
answer and its fence); its guarantees are argued in docs/transfer-prefill-side.md. This module
builds it with the engine, validates each Prefill against the model and the sender, runs the engine
request and turns a transfer's end into the Prefill's answer.

Lifecycle of one request:
    validate -> PrefillTransfers.begin (connect the decode peer once, refuse an aborted or repeated
    key, sender.add) -> engine request (TransferRole.PREFILL) queued on the engine thread in
    the same loop turn, so the sender sees its first chunk -> the sender posts the writes layer by
    layer -> once nothing of the transfer is in flight the transfers' release ends the engine
    request if it still runs and frees its held pages (`_EnginePages`: the sender's KvReleased event,
    applied by the engine) -> the key is tombstoned ->
    the Prefill answers. Every accepted request ends in exactly one release (S2).

Threads:
- the asyncio loop (gRPC handlers) owns the node and its PrefillTransfers; it validates, begins
  transfers and talks to the engine only through `EngineThread` (`generate`, `abort`) and the
  sender's events (`KvSender.release_pages`).
- the engine thread (EngineThread) runs forward passes, calls the sender's hooks and takes its
  events (the sender is the engine's PrefillConnector).
- the sender's messenger thread and the fabric progress thread resolve the transfers' futures,
  whose callbacks only hand the release to the loop (kv_messenger.prefill_transfers).

Blocking waits and their bounds:
- a Prefill's handshake with a new decode fabric peer (PrefillTransfers.begin, in a worker thread,
  so the loop keeps answering): TransferEngine.connect's timeout (5 s, fabric.peers), then
  UNAVAILABLE.
- a Prefill's wait for its release (PrefillTransfers.run_to_release): the request's `deadline_s`, else
  the gRPC call's own deadline (the decode node always sets one, DecodeNodeConfig.prefill_timeout_s)
  or the caller going away (cancelled; the server's keepalive finds a stopped caller within
  seconds). The release itself comes once the engine ended the request and every posted write
  completed or failed (a peer with writes out and no completion fails after
  FabricConfig.peer_timeout_s, default 5 s). Past the deadline: the aborted transfer's release,
  ABORT_WAIT_S, then TimeoutError naming the deadline.
- after the release (`_outcome`): PrefillTransfers.settled, ABORT_WAIT_S, then TimeoutError naming
  it; the engine stream's end, ENGINE_END_WAIT_S (then logged, and 0 cached tokens reported).
- AbortPrefill (`abort`): PrefillTransfers.abort, an active transfer's release after its abort,
  its `timeout` (ABORT_WAIT_S), then ACTIVE, unconfirmed; the fence is posted, never awaited.
- engine-thread calls (`_EnginePages.stop` / `free`, from the transfers' release and background
  aborts): one engine step (commands run between steps), or EngineDeadError at once from a dead
  engine thread; each first waits for its transfer's engine add to be queued (one loop turn).
- `drain`: the in-flight transfers' releases after their abort, DRAIN_WAIT_S (the rest logged).
- `close` / `close_now` (in a worker thread): the messenger thread's stop
  (kv_messenger.sender.CLOSE_JOIN_S), the engine thread's (CLOSE_WAIT_S, logged if it still runs),
  the fabric endpoint's (FABRIC_CLOSE_WAIT_S for outstanding writes, then fabric.engine's own
  bounds: the goodbyes, the progress thread's stop). The model load in `__init__`: none (it takes
  what it takes; serve_node runs it in a worker thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from kv_messenger import TransferResult, TransferTicket
from kv_messenger.placement import placement_info
from kv_messenger.prefill_peers import REMEMBERED_EPOCHS, REMEMBERED_PEERS, ConnectionEpochs
from kv_messenger.prefill_transfers import (
    ABORT_WAIT_S,
    ACTIVE,
    CONNECTION_FAILED,
    FABRIC_CLOSE_WAIT_S,
    FINISHED,
    REFUSED,
    REMEMBERED_ABORTS,
    REMEMBERED_FINISHED,
    UNKNOWN,
    WRONG_ENGINE,
    AbortedError,
    AbortOutcome,
    AbortSpec,
    PrefillTransfer,
    PrefillTransfers,
)
from kv_messenger.sender import KvSender
from kv_messenger.ticket import TransferKey
from kv_messenger.transport import PeerDescriptor
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineDeadError, EngineThread
from pdserve.engine.faults import NO_FAULTS, FaultPlan
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import TransferRole
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.build_identity import engine_identity
from pdserve.serving.metrics import node_metrics
from pdserve_api.servers import UnavailableError

# Moved to kv_messenger.prefill_transfers / prefill_peers (issue 30); still importable from here
# (deprecated: import them from kv_messenger).
__all__ = [
    "ABORT_WAIT_S", "ACTIVE", "CONNECTION_FAILED", "FABRIC_CLOSE_WAIT_S", "FINISHED", "REFUSED",
    "REMEMBERED_ABORTS", "REMEMBERED_EPOCHS", "REMEMBERED_FINISHED", "REMEMBERED_PEERS", "UNKNOWN",
    "WRONG_ENGINE", "AbortOutcome", "AbortSpec", "AbortedError", "ConnectionEpochs", "LoadSnapshot",
    "PrefillNode", "PrefillNodeConfig", "PrefillOutcome", "PrefillSpec",
]

logger = logging.getLogger(__name__)

ENGINE_END_WAIT_S = 5.0    # after the release: how long to wait for the engine stream to end
CLOSE_WAIT_S = 5.0         # close: how long the engine thread may take to stop
DRAIN_WAIT_S = 5.0         # drain: how long the aborted in-flight transfers may take to release


@dataclass(frozen=True)
class PrefillNodeConfig:
    engine: EngineConfig
    provider: str | None = "shm"        # libfabric provider; None: $FI_PROVIDER or the default
    fabric_node: str | None = None      # local address the fabric endpoint binds (not for shm)
    node_id: str = field(default_factory=lambda: f"prefill-{uuid.uuid4().hex[:12]}")
    faults: FaultPlan = NO_FAULTS       # TEST ONLY: the injected fault plan (pdserve.engine.faults)


@dataclass(frozen=True)
class PrefillSpec:
    """One Prefill call, decoded from the wire (domain types only)."""

    request_id: str
    token_ids: list[int]
    target: TransferTicket
    peer: PeerDescriptor
    model: str = ""
    deadline_s: float | None = None
    decode_tp_size: int = 1
    cached_tokens: int = 0
    context_capacity: int = 0           # 0: not stated
    context_top_k: int = 0              # 0: not stated (the codec's default)
    attempt: int = 0                    # D20: with the peer's engine id and request_id, the key

    @property
    def key(self) -> TransferKey:
        return TransferKey(self.peer.engine_id, self.request_id, self.attempt)


@dataclass(frozen=True)
class PrefillOutcome:
    result: TransferResult
    queue_time_s: float
    compute_time_s: float
    last_layer_to_completion_s: float
    # Leading tokens this node took from its prefix cache instead of computing (E12; their pages
    # were still written to the decode node): PrefillResponse.prefill_cached_tokens.
    cached_tokens: int = 0


@dataclass(frozen=True)
class LoadSnapshot:
    held_requests: int = 0          # finished engine requests whose blocks are not released yet
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    waiting_requests: int = 0
    running_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0


@dataclass(frozen=True)
class _EngineEnd:
    """How a transfer's engine request ended: its final output, or the engine's refusal."""

    final: RequestOutput | None
    error: Exception | None = None      # the engine refused the request (bad input, dead engine)


class _EnginePages:
    """The transfers' HeldPages (kv_messenger.prefill_transfers): the request is stopped through the
    engine thread, its pages released through the sender's KvReleased event (the connector's way back)."""

    def __init__(self, engine: EngineThread, sender: KvSender) -> None:
        self.engine = engine
        self.sender = sender

    async def stop(self, engine_request_id: str) -> bool:
        return await self.engine.abort(engine_request_id)

    async def free(self, engine_request_id: str) -> None:
        await self.sender.release_pages(engine_request_id)


class PrefillNode:
    """Build with `PrefillNode(config)` (slow: loads the model; fine in a worker thread), then
    `await start()` on the serving loop and use its coroutines there."""

    def __init__(self, config: PrefillNodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self._closing = False
        self._engine_tasks: set[asyncio.Task] = set()   # each Prefill's engine stream consumer (_run_engine)
        # The transport first: the engine hands its KV pool to the sender (a PrefillConnector)
        # while it is built, and the sender registers it (the engine's pool is on huge pages).
        self.transfers = PrefillTransfers.open(config.provider, config.fabric_node, config.faults)
        self.sender = self.transfers.sender
        try:
            # UnsupportedModelError (a ValueError) for sliding-window / hybrid models
            self.engine = EngineThread(LLMEngine(config.engine, kv_connector=self.sender), faults=config.faults)
        except BaseException:
            self.transfers.close()
            raise
        self.sender.inbox.bind(self.engine)   # the connector's events reach this engine thread
        eng = self.engine.engine
        info = eng.info()
        self.layout = self.sender.layout
        self.codec = self.sender.codec
        self.model_name: str = info.model_name
        self.vocab_size: int = info.vocab_size
        self.num_layers: int = info.num_layers
        self.num_kv_heads: int = info.num_kv_heads
        self.tp_size: int = self.sender.shards.scheme.tp_size
        self.kv_heads_per_rank: int = len(self.sender.shards.scheme.rank_heads[0])
        self.max_model_len: int = info.max_model_len
        self.page_size: int = info.page_size
        self.provider: str = self.transfers.provider
        # NodeInfo.build (version skew): the KV layout with this node's context record layout
        self.identity = engine_identity(eng, self.codec.top_k, self.codec.version, self.codec.hidden_kind,
                                        self.codec.history_rows)
        for where in placement_info(self.sender.placements):      # D16, pdserve:kv_shard_placement_info
            node_metrics().kv_shard_placement.labels(**where.labels()).set(1)
        logger.info("prefill node %s: model %s, %d KV blocks of %d tokens, fabric %s",
                    self.node_id, self.model_name, info.num_blocks, self.page_size, self.transfers.transport)

    async def start(self) -> None:
        self.transfers.start(asyncio.get_running_loop(), _EnginePages(self.engine, self.sender))

    @property
    def peer(self) -> PeerDescriptor:
        return self.transfers.peer

    # --- Prefill (loop) ------------------------------------------------------------------------

    def validate(self, spec: PrefillSpec) -> None:
        """Raise ValueError naming the offending value if `spec` cannot be served here."""
        rid, t = spec.request_id, spec.target
        if not rid:
            raise ValueError("request_id is empty")
        if spec.model and spec.model != self.model_name:
            raise ValueError(f"request {rid}: model {spec.model!r} is not served here (this node serves "
                             f"{self.model_name!r})")
        n = len(spec.token_ids)
        if n < 1:
            raise ValueError(f"request {rid}: no tokens to prefill (token_ids is empty)")
        bad = [x for x in spec.token_ids if not 0 <= x < self.vocab_size]
        if bad:
            raise ValueError(f"request {rid}: token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if n + 1 > self.max_model_len:
            raise ValueError(f"request {rid}: {n} tokens to prefill plus the last prompt token exceed the "
                             f"model's context of {self.max_model_len} tokens")
        if spec.decode_tp_size not in (0, t.sharding.tp_size):
            raise ValueError(f"request {rid}: decode tp_size {spec.decode_tp_size} but the ticket describes "
                             f"{t.sharding.tp_size} ranks")
        if spec.cached_tokens:
            raise ValueError(f"request {rid}: cached_tokens={spec.cached_tokens} is not supported (must be 0)")
        if spec.peer.provider != self.provider:
            raise ValueError(f"request {rid}: decode node's fabric provider {spec.peer.provider!r} differs "
                             f"from this node's {self.provider!r}")
        if t.num_prefill_tokens != n:
            raise ValueError(f"request {rid}: target covers {t.num_prefill_tokens} tokens, request has {n}")
        t.check_fits(self.layout)
        want = self.sender.expected_writes(t)   # the shard plan of our split into the decode node's (D14)
        if t.expected_writes != want:
            raise ValueError(f"request {rid}: expected_writes={t.expected_writes} but this node "
                             f"({self.sender.shards.describe()}) will post {want} into the decode node's split "
                             f"({t.decode_shards.describe()})")
        if spec.context_capacity and spec.context_capacity < self.codec.slot_nbytes:
            raise ValueError(f"request {rid}: context slot of {spec.context_capacity} bytes, "
                             f"needs {self.codec.slot_nbytes}")
        if spec.context_top_k and spec.context_top_k != self.codec.top_k:
            raise ValueError(f"request {rid}: logits_top_k={spec.context_top_k} not supported "
                             f"(this node writes the top {self.codec.top_k})")

    async def prefill(self, spec: PrefillSpec) -> PrefillOutcome:
        """Prefill `spec` and push its KV; raises ValueError, AbortedError, UnavailableError,
        TimeoutError (deadline) or RuntimeError (engine failure). Cancelling it aborts the transfer."""
        received = time.monotonic()
        if not self.transfers.started:
            raise UnavailableError(f"prefill node {self.node_id} is starting")
        if self._closing:
            raise UnavailableError(f"prefill node {self.node_id} is shutting down")
        self.validate(spec)
        t = await self.transfers.begin(spec.key, spec.target, spec.peer, received)
        engine_task = asyncio.create_task(self._run_engine(t, spec.token_ids), name=f"prefill-{t.request_id}")
        self._engine_tasks.add(engine_task)   # held until it ends, even once this call was cancelled
        engine_task.add_done_callback(self._engine_tasks.discard)
        await self.transfers.run_to_release(t, spec.deadline_s)   # TimeoutError past the deadline
        return await self._outcome(t, engine_task)

    async def _run_engine(self, t: PrefillTransfer, token_ids: list[int]) -> _EngineEnd:
        """Consume the engine's stream for a transfer; stop the transfer if the engine ends it early.

        Never cancelled (it ends when the engine request does): a cancelled EngineThread.call
        could leave the engine thread setting a result on a cancelled future.
        """
        stream = self.engine.generate(token_ids, SamplingParams(max_tokens=1), request_id=t.request_id,
                                      role=TransferRole.PREFILL)
        t.queued.set()   # waiters run after this step, which submits the add below
        final: RequestOutput | None = None
        try:
            async for out in stream:
                if out.finished:
                    final = out
        except (ValueError, EngineDeadError) as e:   # refused by the engine (nothing queued)
            self.transfers.end_posting(t)
            return _EngineEnd(None, e)
        reason = final.completion.finish_reason if final is not None and final.completion is not None else None
        if reason != "prefilled":
            if final is not None and final.error:
                logger.warning("request %s: engine ended it: %s", t.request_id, final.error)
            self.transfers.end_posting(t)
        return _EngineEnd(final)

    async def _outcome(self, t: PrefillTransfer, engine_task: asyncio.Task) -> PrefillOutcome:
        rid = t.request_id
        await self.transfers.settled(t)
        end: _EngineEnd | None = None
        try:
            end = await asyncio.wait_for(asyncio.shield(engine_task), ENGINE_END_WAIT_S)
        except TimeoutError:
            logger.error("request %s: engine stream did not end %.0f s after its release", rid, ENGINE_END_WAIT_S)
        final = end.final if end is not None else None
        res = self.transfers.result(t)   # raises for the transport's failures
        if res is not None:
            scheduled = final.first_scheduled_time if final is not None else None
            first = scheduled or res.first_post_time or t.received
            if final is None:  # the engine stream did not end in time (logged above): its count is unknown
                logger.warning("request %s: prefix-cache hit unknown, reporting 0 cached tokens", rid)
            return PrefillOutcome(res, max(0.0, first - t.received), max(0.0, res.last_layer_time - first),
                                  max(0.0, res.done_time - res.last_layer_time),
                                  cached_tokens=final.num_cached_tokens if final is not None else 0)
        if end is not None and end.error is not None:
            raise end.error
        if self._closing:
            raise UnavailableError(f"request {rid}: prefill node {self.node_id} is shutting down")
        if final is not None and final.error:
            raise RuntimeError(f"request {rid}: engine failed: {final.error}")
        raise AbortedError(f"request {rid}: prefill aborted")

    # --- AbortPrefill, load (loop) ---------------------------------------------------------------

    async def abort(self, spec: AbortSpec, timeout: float = ABORT_WAIT_S) -> AbortOutcome:
        """Stop a transfer; confirmed once this process can vouch that no write of it can land in
        the decode node's memory (S5; PrefillTransfers.abort, docs/transfer-prefill-side.md)."""
        return await self.transfers.abort(spec, timeout)

    async def load(self) -> LoadSnapshot:
        """The load as of the engine's last step or idle tick (EngineThread.last_load, at most one
        step old), with the loop's own exact count of Prefill calls in progress."""
        if not self.engine.is_running:
            raise UnavailableError(f"prefill node {self.node_id}: engine stopped")
        load = self.engine.last_load
        return LoadSnapshot(
            held_requests=self.engine.engine.num_held_requests,
            outstanding_requests=len(self.transfers),
            outstanding_tokens=load.prompt_tokens_left,
            waiting_requests=load.num_waiting,
            running_requests=load.num_running,
            free_kv_blocks=load.free_blocks,
            total_kv_blocks=load.total_blocks,
        )

    # --- shutdown (loop) -----------------------------------------------------------------------

    async def drain(self, timeout: float = DRAIN_WAIT_S) -> None:
        """Refuse new prefills and abort the in-flight ones (they answer UNAVAILABLE)."""
        self._closing = True
        await self.transfers.drain(timeout)

    async def close(self) -> None:
        """Stop the sender, the engine thread and the fabric endpoint (a few seconds at most)."""
        self._closing = True
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        """Blocking `close`, for a node that never started serving (bounded by CLOSE_WAIT_S each)."""
        self._closing = True
        self.transfers.close_sender()
        self.engine.shutdown(timeout=CLOSE_WAIT_S)
        if self.engine.is_running:   # closed anyway: the process is stopping
            logger.warning("prefill node %s: engine thread still running %.0f s after its shutdown (CLOSE_WAIT_S)",
                           self.node_id, CLOSE_WAIT_S)
        self.transfers.close_transport()
