"""The prefill node's core: one engine, one fabric endpoint, one KV sender, and the lifecycle of
each Prefill (D1, D5-D8, D11, D12, S4, S5). Knows nothing of gRPC: the server converts.

Transfer identity (D20): work is keyed by TransferKey (the decode node's fabric engine id, its
request id, the attempt); the engine request id and the sender's key are the key's
`engine_request_id`, unique per key. A retry of a request id from another decode node, or a new
attempt, is a new transfer; the same key twice is refused.

Lifecycle of one request:
    validate -> connect the decode node's fabric peer (once per peer) -> sender.add(target, key)
    -> engine request (prefill_only, hold_blocks) queued on the engine thread in the same
    synchronous step, so the sender sees its first chunk -> the sender posts the writes layer by
    layer -> when nothing of the transfer is in flight it calls `release(rid)` -> we end the
    engine request if it still runs (failed or aborted mid-prefill) and free its held blocks ->
    the key is tombstoned (FINISHED: every write completed locally; CONNECTION_FAILED: the
    fabric connection to the decode node failed) -> the Prefill call answers. Every accepted
    request ends in exactly one release (S2).

After a failed write (the peer failed at the transport) the source pages are freed only once the
peer is disconnected: on tcp;ofi_rxm the writes of a failed peer are failed at once in our
bookkeeping (fabric peer_fail) while the provider may still hold them and send their bytes from
the source pages; removing the peer from the address vector closes its connection (with
FI_AV_REMOVE_CLEANUP, which fabric.engine turns on), which drops what it still queued. shm closes
the peer's transmit endpoint at peer_fail already.

AbortPrefill (S5), bound to this process: a request naming another prefill engine id (a restart
at the same address) is WRONG_ENGINE, never confirmed. An active transfer is aborted and waited
for (ABORT_WAIT_S). A FINISHED key is confirmed with a delivery fence: one write carrying the
decode node's fence tag, posted between the same pair of endpoints after every write of the
transfer completed locally (`KvSender.fence`). It may travel on a newer connection than the
writes (rxm reconnects by itself after a reset), which is sound: rxm 1.17 accepts a connection
from an endpoint only once the previous one is closed at the target, so each earlier write has
landed before the fence or never will (tests/fabric/test_fence_reconnect.py); the connection
epoch (`_epochs`) covers only the connections this process closed (`_retire_peer`). Writes
between one pair of endpoints are delivered in order (FI_ORDER_WAW,
which fabric's hints ask for and tcp;ofi_rxm and shm grant in libfabric 1.17; a fence is posted
only where it was granted, TransferEngine.writes_ordered: else a delivery-complete endpoint
confirms without one, and any other answers FINISHED unconfirmed), so once the decode node
counted the fence, every write of the transfer has landed. On RDMA providers (verbs, efa) and
shm a local completion already means the target has the data (delivery complete), so there the
fence only confirms what the completions said; on tcp;ofi_rxm, where "completed locally" means
handed to the socket, it is what makes the confirmation sound. A key whose connection failed
since cannot be fenced (not confirmed). Both unconfirmed answers (FINISHED, CONNECTION_FAILED)
still say the key is terminal: nothing more will ever be posted for it and every posted write
completed locally, in error or not (the tombstone is written by its release, after
`_retire_peer` disconnected a failed peer); the decode node then releases the pages by closing
its own side of our connection.
An unknown key is remembered as refused (a later Prefill for it answers ABORTED and never writes)
and is not confirmed the first time; from then on it is REFUSED, confirmed (nothing was posted).

Threads:
- the asyncio loop (gRPC handlers) owns `_active`, `_aborted`, `_peers`; it validates, adds
  transfers, talks to the engine only through `EngineThread` (`generate`, `call`, `abort`).
- the engine thread (EngineThread) runs forward passes and the sender's engine events (the
  sender is the engine's PrefillConnector).
- the sender's messenger thread and the fabric progress thread call `_on_release`, which only
  hands the release to the loop.

Blocking waits and their bounds:
- a Prefill's handshake with a new decode fabric peer (`_connect`, in a worker thread, so the loop
  keeps answering): TransferEngine.connect's timeout (5 s, fabric.peers), then UNAVAILABLE.
- a Prefill's wait for its release (`_Job.released`): the request's `deadline_s`, else the gRPC
  call's own deadline (the decode node always sets one, DecodeNodeConfig.prefill_timeout_s) or the
  caller going away (cancelled; the server's keepalive finds a stopped caller within seconds). The
  release itself comes once the engine ended the request and every posted write completed or
  failed (a peer with writes out and no completion fails after FabricConfig.peer_timeout_s,
  default 5 s). Past the deadline: the aborted transfer's release, ABORT_WAIT_S, then TimeoutError
  naming the deadline.
- after the release (`_outcome`): the sender's future's bridge (settled before the release, so at
  once), ABORT_WAIT_S, then TimeoutError naming it; the engine stream's end, ENGINE_END_WAIT_S
  (then logged, and 0 cached tokens reported).
- AbortPrefill (`abort`): an active transfer's release after its abort, its `timeout`
  (ABORT_WAIT_S), then ACTIVE, unconfirmed. The fence is posted on the loop and never awaited: its
  write_pages does not wait (the endpoint shook hands at the transfer's connect; else at most that
  handshake, 5 s, fabric.peers).
- engine-thread calls (`EngineThread.call` / `abort` in `_release` and `_stop_engine`, background
  tasks nobody awaits without a bound): one engine step (commands run between steps), or
  EngineDeadError at once from a dead engine thread; each first waits for its job's engine add to
  be queued (`_Job.queued`, set at the engine task's first step: one loop turn). Only a hung step
  holds them, and every wait above bounds its caller meanwhile.
- `_retire_peer` (on the loop): TransferEngine.disconnect, the endpoint's lock and fi_av_remove;
  no wait on the peer. The sender's lock (validate, add, abort, fence): bookkeeping only
  (kv_messenger.sender).
- `drain`: the in-flight transfers' releases after their abort, DRAIN_WAIT_S (the rest logged).
- `close` / `close_now` (in a worker thread): the messenger thread's stop
  (kv_messenger.sender.CLOSE_JOIN_S), the engine thread's (CLOSE_WAIT_S, logged if it still runs),
  the fabric endpoint's (FABRIC_CLOSE_WAIT_S for outstanding writes, then fabric.engine's own
  bounds: the goodbyes, the progress thread's stop). The model load in `__init__`: none (it takes
  what it takes; serve_node runs it in a worker thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from fabric import FabricConfig, FabricError, PeerDescriptor, RemoteDescriptor, TransferEngine
from kv_messenger import KvSender, TransferResult, TransferTicket
from kv_messenger.placement import placement_info
from kv_messenger.sender import PostError
from kv_messenger.ticket import TransferKey
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineDeadError, EngineThread
from pdserve.engine.faults import NO_FAULTS, FaultPlan
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.build_identity import engine_identity
from pdserve.serving.metrics import node_metrics
from pdserve_api.servers import StatusError, UnavailableError

logger = logging.getLogger(__name__)

ABORT_WAIT_S = 10.0        # AbortPrefill / deadline: how long to wait for in-flight writes to settle
ENGINE_END_WAIT_S = 5.0    # after the release: how long to wait for the engine stream to end
CLOSE_WAIT_S = 5.0         # close: how long the engine thread may take to stop
DRAIN_WAIT_S = 5.0         # drain: how long the aborted in-flight transfers may take to release
FABRIC_CLOSE_WAIT_S = 2.0  # close: how long the fabric endpoint drains outstanding writes (close_timeout_s)
REMEMBERED_ABORTS = 65536  # keys aborted before (or after) their Prefill, refused with ABORTED
REMEMBERED_FINISHED = 65536   # keys that ended here (tombstones for AbortPrefill)
REMEMBERED_PEERS = 4096    # decode-node fabric peers we have connected to
REMEMBERED_EPOCHS = 4096   # decode-node fabric peers whose connection generation we keep

# What this process knows of a transfer (the wire's TransferState, by name).
UNKNOWN, ACTIVE, FINISHED, REFUSED, CONNECTION_FAILED, WRONG_ENGINE = (
    "unknown", "active", "finished", "refused", "connection_failed", "wrong_engine")


def _retrieve(task: asyncio.Future) -> None:
    """Done callback: mark a background task's exception as seen (it is reported elsewhere)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("background call failed: %s", task.exception())


class ConnectionEpochs:
    """The connection generation of each decode-node fabric peer, bounded (REMEMBERED_EPOCHS).

    A transfer records its peer's generation when it starts (its tombstone keeps it); a failed
    transfer disconnects the peer and `bump`s it, so a fence on a later connection proves nothing
    of a transfer of an older generation. Generations come from one counter for every peer, and a
    peer forgotten to keep the map bounded raises the `floor` that every peer not in the map
    reads: a forgotten peer's generation never goes back to one a tombstone recorded before its
    failure (that would confirm an unprovable fence), while a tombstone of another peer may read a
    newer generation than it recorded and answer CONNECTION_FAILED (unconfirmed, never unsound).
    """

    def __init__(self, capacity: int = REMEMBERED_EPOCHS) -> None:
        if capacity < 1:
            raise ValueError(f"ConnectionEpochs needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._by_peer: OrderedDict[str, int] = OrderedDict()
        self._last = 0     # the newest generation handed out, any peer
        self.floor = 0     # at least every forgotten peer's generation

    def __len__(self) -> int:
        return len(self._by_peer)

    def get(self, engine_id: str) -> int:
        return self._by_peer.get(engine_id, self.floor)

    def bump(self, engine_id: str) -> int:
        """A new generation for this peer (its connection was closed); returns it."""
        self._last += 1
        self._by_peer[engine_id] = self._last
        self._by_peer.move_to_end(engine_id)
        while len(self._by_peer) > self.capacity:
            _, forgotten = self._by_peer.popitem(last=False)
            self.floor = max(self.floor, forgotten)
        return self._last


class AbortedError(StatusError):
    """The Prefill was stopped by AbortPrefill (or arrived after it)."""

    code = grpc.StatusCode.ABORTED


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
class AbortSpec:
    """One AbortPrefill call, decoded from the wire."""

    key: TransferKey
    prefill_engine_id: str              # the process the decode node dispatched to
    fence_tag: int = 0                  # 0: no fence asked
    fence_region: RemoteDescriptor | None = None


@dataclass(frozen=True)
class AbortOutcome:
    confirmed: bool
    state: str                          # UNKNOWN, ACTIVE, FINISHED, ...
    fence_posted: bool = False


@dataclass(frozen=True)
class _Tomb:
    """How a transfer ended here: its state and the connection generation it used."""

    state: str
    epoch: int


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


@dataclass
class _Job:
    request_id: str                          # the engine's: key.engine_request_id
    key: TransferKey
    epoch: int                               # the peer's connection generation when it started
    peer: PeerDescriptor                     # the decode fabric peer it writes to (disconnected on failure)
    future: concurrent.futures.Future        # the sender's, resolves with a TransferResult
    received: float                          # time.monotonic() of the RPC's receipt
    transfer_done: asyncio.Future            # resolves (with None) once `future` is done
    queued: asyncio.Event = field(default_factory=asyncio.Event)     # engine add submitted
    released: asyncio.Event = field(default_factory=asyncio.Event)   # held blocks freed
    engine_task: asyncio.Task | None = None  # consumes the engine's output stream
    engine_error: Exception | None = None    # the engine refused the request (bad input)


class PrefillNode:
    """Build with `PrefillNode(config)` (slow: loads the model; fine in a worker thread), then
    `await start()` on the serving loop and use its coroutines there."""

    def __init__(self, config: PrefillNodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self._loop: asyncio.AbstractEventLoop | None = None   # the serving loop, from start()
        self._active: dict[str, _Job] = {}                  # by engine request id
        self._aborted: OrderedDict[TransferKey, None] = OrderedDict()
        self._finished: OrderedDict[TransferKey, _Tomb] = OrderedDict()
        self._peers: OrderedDict[str, PeerDescriptor] = OrderedDict()   # engine_id -> connected peer
        # engine_id -> connection generation: a new one each time a transfer to it failed at the
        # fabric (the peer is disconnected then): a fence on a later connection proves nothing of the old.
        self._epochs = ConnectionEpochs()
        self._closing = False
        self._background: set[asyncio.Future] = set()
        # The transport first: the engine hands its KV pool to the sender (a PrefillConnector)
        # while it is built, and the sender registers it (the engine's pool is on huge pages).
        self.transport = TransferEngine(FabricConfig(provider=config.provider, node=config.fabric_node,
                                                  close_timeout_s=FABRIC_CLOSE_WAIT_S))
        try:
            self.sender = KvSender(self.transport, faults=config.faults)
            try:
                # UnsupportedModelError (a ValueError) for sliding-window / hybrid models
                self.engine = EngineThread(LLMEngine(config.engine, kv_connector=self.sender), faults=config.faults)
            except BaseException:
                self.sender.close()
                raise
        except BaseException:
            self.transport.close()
            raise
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
        self.provider: str = self.transport.provider
        # NodeInfo.build (version skew): the KV layout with this node's context record layout
        self.identity = engine_identity(eng, self.codec.top_k, self.codec.version, self.codec.hidden_kind,
                                        self.codec.history_rows)
        for where in placement_info(self.sender.placements):      # D16, pdserve:kv_shard_placement_info
            node_metrics().kv_shard_placement.labels(**where.labels()).set(1)
        logger.info("prefill node %s: model %s, %d KV blocks of %d tokens, fabric %s",
                    self.node_id, self.model_name, info.num_blocks, self.page_size, self.transport)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    @property
    def peer(self) -> PeerDescriptor:
        return self.transport.peer_descriptor

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
        if self._loop is None:
            raise UnavailableError(f"prefill node {self.node_id} is starting")
        if self._closing:
            raise UnavailableError(f"prefill node {self.node_id} is shutting down")
        self.validate(spec)
        key = spec.key
        rid = key.engine_request_id
        await self._connect(spec.peer)   # before the checks: nothing awaits between them and the add
        if key in self._aborted:
            raise AbortedError(f"request {spec.request_id} attempt {spec.attempt} was aborted before its Prefill "
                               "arrived")
        if rid in self._active or key in self._finished:
            raise ValueError(f"request {spec.request_id!r} attempt {spec.attempt} from decode peer "
                             f"{key.decode_engine_id[:8]} was sent here before (a retry takes a new attempt)")
        future = self.sender.add(spec.target, rid)     # before the engine sees the request
        # Once nothing of the transfer is in flight, free the request's held blocks (D11).
        future.add_done_callback(lambda _f, rid=rid: self._on_release(rid))
        job = _Job(rid, key, self._epochs.get(key.decode_engine_id), spec.peer, future, received,
                   self._bridge(future))
        self._active[rid] = job
        job.engine_task = asyncio.create_task(self._run_engine(job, spec.token_ids), name=f"prefill-{rid}")
        try:
            async with asyncio.timeout(spec.deadline_s):
                await job.released.wait()
        except TimeoutError:
            self._abort_job(job)
            await self._wait_released(job, ABORT_WAIT_S)
            raise TimeoutError(f"request {rid}: prefill exceeded its deadline of {spec.deadline_s} s") from None
        except asyncio.CancelledError:
            # The caller went away (decode node cancelled or died): nothing more is posted; the
            # release follows once no write is in flight (S4, S5).
            logger.info("request %s: Prefill call cancelled by the caller; aborting its transfer", rid)
            self._abort_job(job)
            raise
        return await self._outcome(job, spec)

    async def _run_engine(self, job: _Job, token_ids: list[int]) -> RequestOutput | None:
        """Consume the engine's stream for a job; stop the transfer if the engine ends it early.

        Never cancelled (it ends when the engine request does): a cancelled EngineThread.call
        could leave the engine thread setting a result on a cancelled future.
        """
        stream = self.engine.generate(token_ids, SamplingParams(max_tokens=1), request_id=job.request_id,
                                      prefill_only=True, hold_blocks=True)
        job.queued.set()   # waiters run after this step, which submits the add below
        final: RequestOutput | None = None
        try:
            async for out in stream:
                if out.finished:
                    final = out
        except (ValueError, EngineDeadError) as e:   # refused by the engine (nothing queued)
            job.engine_error = e
            self.sender.abort(job.request_id)
            return None
        reason = final.completion.finish_reason if final is not None and final.completion is not None else None
        if reason != "prefilled":
            if final is not None and final.error:
                logger.warning("request %s: engine ended it: %s", job.request_id, final.error)
            self.sender.abort(job.request_id)
        return final

    async def _outcome(self, job: _Job, spec: PrefillSpec) -> PrefillOutcome:
        rid = job.request_id
        try:
            await asyncio.wait_for(asyncio.shield(job.transfer_done), ABORT_WAIT_S)
        except TimeoutError:
            raise TimeoutError(f"request {rid}: transfer not settled {ABORT_WAIT_S:.0f} s after its release "
                               "(ABORT_WAIT_S)") from None
        final: RequestOutput | None = None
        assert job.engine_task is not None
        try:
            final = await asyncio.wait_for(asyncio.shield(job.engine_task), ENGINE_END_WAIT_S)
        except TimeoutError:
            logger.error("request %s: engine stream did not end %.0f s after its release", rid, ENGINE_END_WAIT_S)
        exc = job.future.exception()
        if exc is None:
            res: TransferResult = job.future.result()
            scheduled = final.first_scheduled_time if final is not None else None
            first = scheduled or res.first_post_time or job.received
            if final is None:  # the engine stream did not end in time (logged above): its count is unknown
                logger.warning("request %s: prefix-cache hit unknown, reporting 0 cached tokens", rid)
            return PrefillOutcome(res, max(0.0, first - job.received), max(0.0, res.last_layer_time - first),
                                  max(0.0, res.done_time - res.last_layer_time),
                                  cached_tokens=final.num_cached_tokens if final is not None else 0)
        if isinstance(exc, FabricError):
            raise UnavailableError(f"request {rid}: KV transfer to decode node peer {spec.peer.engine_id[:8]} "
                                   f"failed: {exc}")
        if isinstance(exc, StatusError):   # e.g. StagingFullError (RESOURCE_EXHAUSTED): this request only
            raise exc
        if isinstance(exc, PostError):      # a bug while posting: this request only, named (INTERNAL)
            raise RuntimeError(f"request {rid}: {exc}")
        if job.engine_error is not None:
            raise job.engine_error
        if self._closing:
            raise UnavailableError(f"request {rid}: prefill node {self.node_id} is shutting down")
        if final is not None and final.error:
            raise RuntimeError(f"request {rid}: engine failed: {final.error}")
        raise AbortedError(f"request {rid}: prefill aborted")

    def _abort_job(self, job: _Job) -> None:
        """Stop posting for a job and stop computing it; its blocks stay held until the release."""
        self.sender.abort(job.request_id)
        task = asyncio.ensure_future(self._stop_engine(job))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_retrieve)

    async def _stop_engine(self, job: _Job) -> None:
        await job.queued.wait()   # never abort before the add: the add would then run unchecked
        await self.engine.abort(job.request_id)   # hold_blocks: the blocks stay until the release

    async def _connect(self, peer: PeerDescriptor) -> None:
        """Shake hands with a decode node's fabric engine once (TransferEngine.connect, bounded by its
        5 s timeout), in a worker thread: the loop keeps answering meanwhile (GetNodeInfo, aborts)."""
        if peer.engine_id in self._peers:
            self._peers.move_to_end(peer.engine_id)
            return
        try:
            await asyncio.to_thread(self.transport.connect, peer)
        except FabricError as e:
            raise UnavailableError(f"cannot reach the decode node's fabric peer {peer.engine_id[:8]} "
                                   f"(pid {peer.pid}): {e}") from e
        self._peers[peer.engine_id] = peer
        logger.info("connected to decode fabric peer %s (pid %d)", peer.engine_id[:8], peer.pid)
        while len(self._peers) > REMEMBERED_PEERS:
            self._peers.popitem(last=False)   # forgetting only means a fresh connect next time

    def _bridge(self, future: concurrent.futures.Future) -> asyncio.Future:
        """An asyncio future that resolves (with None) when the sender's future is done."""
        done = self._loop.create_future()

        def settle(_: asyncio.Future) -> None:
            if not done.done():
                done.set_result(None)

        future.add_done_callback(lambda _f: self._loop.call_soon_threadsafe(settle, done))
        return done

    async def _wait_released(self, job: _Job, timeout: float) -> bool:
        try:
            await asyncio.wait_for(job.released.wait(), timeout)
            return True
        except TimeoutError:
            logger.error("request %s: transfer still in flight %.0f s after its abort", job.request_id, timeout)
            return False

    # --- release (messenger / progress thread -> loop -> engine thread) --------------------------

    def _on_release(self, request_id: str) -> None:
        """The sender has nothing of `request_id` in flight any more (any non-engine thread)."""
        try:
            asyncio.run_coroutine_threadsafe(self._release(request_id), self._loop)
        except RuntimeError as e:   # the loop is closed: the process is exiting
            logger.warning("request %s: release not scheduled: %s", request_id, e)

    async def _release(self, request_id: str) -> None:
        job = self._active.get(request_id)
        try:
            if job is not None:
                await job.queued.wait()    # its engine add is queued before our abort/release
                if isinstance(job.future.exception(), FabricError):
                    self._retire_peer(job.peer)   # before its source pages are freed
            if await self.engine.abort(request_id):
                logger.info("request %s: stopped its prefill (transfer ended before the prefill did)", request_id)
            freed = await self.engine.call(lambda: self._release_blocks(request_id))
            logger.debug("request %s: released %d blocks", request_id, freed)
        except EngineDeadError as e:
            logger.warning("request %s: engine gone, blocks not released: %s", request_id, e)
        finally:
            if job is not None and self._active.get(request_id) is job:
                failed = isinstance(job.future.exception(), FabricError)
                self._tombstone(job.key, _Tomb(CONNECTION_FAILED if failed else FINISHED, job.epoch))
                del self._active[request_id]
                job.released.set()

    def _retire_peer(self, peer: PeerDescriptor) -> None:
        """A transfer to this decode peer failed at the fabric: disconnect it (its connection and
        whatever the provider still queued on it go), so that nothing more is sent from the
        transfer's source pages; the next Prefill from it connects afresh. The job's own peer is
        disconnected even when `_peers` forgot it meanwhile (REMEMBERED_PEERS): forgetting a peer
        does not close its connection."""
        engine_id = peer.engine_id
        epoch = self._epochs.bump(engine_id)
        self._peers.pop(engine_id, None)
        try:
            self.transport.disconnect(peer)
        except FabricError as e:
            logger.warning("decode peer %s: disconnect after a failed transfer: %s", engine_id[:8], e)
            return
        logger.info("decode peer %s disconnected after a failed transfer (connection generation %d)",
                    engine_id[:8], epoch)

    def _tombstone(self, key: TransferKey, tomb: _Tomb) -> None:
        self._finished[key] = tomb
        self._finished.move_to_end(key)
        while len(self._finished) > REMEMBERED_FINISHED:
            self._finished.popitem(last=False)

    def _release_blocks(self, request_id: str) -> int:
        """Engine thread: free the blocks the request held (none if the engine never admitted it)."""
        try:
            return self.engine.engine.release_blocks(request_id)
        except KeyError:   # refused at add, or ended before it held anything
            logger.debug("request %s held no blocks", request_id)
            return 0

    # --- AbortPrefill (loop) -------------------------------------------------------------------

    def _remember_abort(self, key: TransferKey) -> None:
        self._aborted[key] = None
        self._aborted.move_to_end(key)
        while len(self._aborted) > REMEMBERED_ABORTS:
            self._aborted.popitem(last=False)

    async def abort(self, spec: AbortSpec, timeout: float = ABORT_WAIT_S) -> AbortOutcome:
        """Stop a transfer; confirmed once this process can vouch that no write of it can land in
        the decode node's memory (S5; see the module docstring)."""
        key = spec.key
        if spec.prefill_engine_id != self.transport.engine_id:
            logger.info("abort of %s attempt %d names prefill engine %s, this is %s: not confirmed", key.request_id,
                        key.attempt, spec.prefill_engine_id[:8], self.transport.engine_id[:8])
            return AbortOutcome(False, WRONG_ENGINE)
        job = self._active.get(key.engine_request_id)
        if job is not None:
            self._abort_job(job)
            if not await self._wait_released(job, timeout):
                return AbortOutcome(False, ACTIVE)
        tomb = self._finished.get(key)
        if tomb is None:
            if key in self._aborted:
                return AbortOutcome(True, REFUSED)
            self._remember_abort(key)
            logger.info("abort of %s attempt %d: never seen here; remembered as refused", key.request_id, key.attempt)
            return AbortOutcome(False, UNKNOWN)
        if tomb.state != FINISHED or tomb.epoch != self._epochs.get(key.decode_engine_id):
            return AbortOutcome(False, CONNECTION_FAILED)
        if not spec.fence_tag or spec.fence_region is None:
            return AbortOutcome(True, FINISHED)
        if not self.transport.writes_ordered:
            if self.transport.delivery_complete:   # each write completed only once delivered
                return AbortOutcome(True, FINISHED)
            # a fence would prove nothing: finished (terminal), but unfenced (the decode node
            # closes its connection instead, decode_node.service)
            return AbortOutcome(False, FINISHED)
        if spec.fence_region.peer.engine_id != key.decode_engine_id:
            raise ValueError(f"abort of {key.request_id}: the fence region belongs to engine "
                             f"{spec.fence_region.peer.engine_id[:8]}, not the transfer's {key.decode_engine_id[:8]}")
        try:
            fence = self.sender.fence(spec.fence_region, spec.fence_tag)
        except FabricError as e:
            logger.warning("abort of %s attempt %d: fence not posted: %s", key.request_id, key.attempt, e)
            return AbortOutcome(False, FINISHED)
        # A fence that fails after it was posted never lands: the decode side waits FENCE_WAIT_S and
        # asks again; say why here (fabric progress thread).
        def fence_done(f: concurrent.futures.Future, k: TransferKey = key) -> None:
            if not f.cancelled() and f.exception() is not None:
                logger.warning("abort of %s attempt %d: its fence write failed: %s", k.request_id, k.attempt,
                               f.exception())

        fence.add_done_callback(fence_done)
        return AbortOutcome(True, FINISHED, fence_posted=True)

    # --- load (loop, reads on the engine thread) -----------------------------------------------

    async def load(self) -> LoadSnapshot:
        """The load as of the engine's last step or idle tick (EngineThread.last_load, at most one
        step old), with the loop's own exact count of Prefill calls in progress."""
        if not self.engine.is_running:
            raise UnavailableError(f"prefill node {self.node_id}: engine stopped")
        load = self.engine.last_load
        return LoadSnapshot(
            held_requests=self.engine.engine.num_held_requests,
            outstanding_requests=len(self._active),
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
        jobs = list(self._active.values())
        if jobs:
            logger.info("aborting %d in-flight prefills for shutdown", len(jobs))
        for job in jobs:
            self._abort_job(job)
        if jobs:
            done, pending = await asyncio.wait([asyncio.ensure_future(j.released.wait()) for j in jobs],
                                               timeout=timeout)
            for p in pending:
                p.cancel()
            if pending:
                logger.warning("%d prefills still had writes in flight at shutdown", len(pending))

    async def close(self) -> None:
        """Stop the sender, the engine thread and the fabric endpoint (a few seconds at most)."""
        self._closing = True
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        """Blocking `close`, for a node that never started serving (bounded by CLOSE_WAIT_S each)."""
        self._closing = True
        self.sender.close()
        self.engine.shutdown(timeout=CLOSE_WAIT_S)
        if self.engine.is_running:   # closed anyway: the process is stopping
            logger.warning("prefill node %s: engine thread still running %.0f s after its shutdown (CLOSE_WAIT_S)",
                           self.node_id, CLOSE_WAIT_S)
        self.transport.close()
