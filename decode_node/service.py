"""The decode node's core: one engine, and (disaggregated) one fabric endpoint, one KV receiver,
the prefill pool, and the transfer of each request's prompt KV. Knows nothing of the gRPC server:
decode_node.server converts and serves.

Threads and tasks:
- the engine thread (EngineThread) runs schedule -> run -> update; the receiver is the engine's
  DecodeConnector, and its `ticket_ready` event (a request has its pages) hands the ticket to the
  asyncio loop;
- the asyncio loop serves gRPC and runs one transfer task per request (the Prefill call, with a
  deadline, retries and safe abandonment);
- the fabric progress thread reports the completed immediate-data count (`kv_landed`), handed to
  the engine thread, which makes the request schedulable (D4: never before).

Abandonment (S3, S5): when a Prefill call fails, times out, or the client goes away, the pages
are released only once no write can land any more: the prefill node confirmed AbortPrefill, or
its fabric endpoint is gone, or the call never reached a node that was never reachable.

Per request, one `RequestState` (while its Generate handler runs) holds when it was admitted, its
transfer, where it was prefilled and how that went.

Blocking waits, with their bounds: a Prefill call (`DecodeNodeConfig.prefill_timeout_s`); the
write count after a successful Prefill (KV_LANDED_WAIT_S); AbortPrefill (ABORT_RPC_TIMEOUT_S);
the peer's endpoint going away (PEER_GONE_WAIT_S per probe round); a finished request's wait for
its Prefill response (PREFILL_RESPONSE_WAIT_S).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from decode_node.prefill_pool import PREFILL_ROUTING, PrefillNode, PrefillPool, PrefixAffinity
from fabric import FabricConfig, TransferEngine
from kv_messenger import KvReceiver, ReceiverEvents, TransferTicket
from kv_messenger.ticket import peer_to_bytes
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import node_metrics, request_metrics
from pdserve_api.v1 import common_pb2, node_pb2, prefill_pb2

logger = logging.getLogger(__name__)

# A request whose KV has landed may finish before its Prefill response is processed (a one-token
# answer): its final message waits this long at most for the response's timings and cached count.
PREFILL_RESPONSE_WAIT_S = 10.0
KV_LANDED_WAIT_S = 10.0      # after a successful Prefill: the write count completes within this
ABORT_RPC_TIMEOUT_S = 10.0   # deadline of one AbortPrefill call
PEER_GONE_WAIT_S = 10.0      # how long one check for a prefill endpoint's death waits
HOLD_PROBE_S = 30.0          # pages held after an unconfirmed abort: re-check the endpoint this often
POOL_REFRESH_S = 1.0         # GetNodeInfo of every prefill node, this often


@dataclass(frozen=True)
class DecodeNodeConfig:
    """One decode (or colocated) node."""
from pdserve.serving.channels import PLAINTEXT, ChannelSecurity

    engine: EngineConfig
    node_id: str
    colocated: bool = False
    prefill_addresses: tuple[str, ...] = ()   # HOST:PORT of the prefill nodes (not colocated)
    provider: str | None = "shm"              # libfabric provider; None: $FI_PROVIDER or the default
    fabric_node: str | None = None            # local address the fabric endpoint binds (not for shm)
    prefill_timeout_s: float = 60.0           # deadline of one Prefill call
    local_prefill_fallback: bool = False      # no prefill node can serve: prefill here instead of failing
    prefill_routing: str = "least-loaded"

    def __post_init__(self) -> None:
        if self.prefill_routing not in PREFILL_ROUTING:
            raise ValueError(f"prefill routing must be one of {PREFILL_ROUTING}, got {self.prefill_routing!r}")
        if not self.node_id:
            raise ValueError("node_id is empty")
        if not self.prefill_timeout_s > 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {self.prefill_timeout_s!r}")
        if self.colocated and self.prefill_addresses:
            raise ValueError(f"a colocated node uses no prefill nodes, got {list(self.prefill_addresses)}")


@dataclass(frozen=True)
class PrefillOutcome:
    """A successful remote prefill, as the final message reports it."""

    call_start: float      # time.monotonic() of the Prefill call
    prefill_s: float       # prefill-side time from receipt to the last layer done
    tail_s: float          # the rest until the write count completed here
    cached_tokens: int     # prompt tokens the prefill node took from its prefix cache (not computed)


@dataclass
class Transfer:
    """One request's prompt KV on its way here (loop-owned)."""
    channel_security: ChannelSecurity = PLAINTEXT   # of the channels to prefill nodes (mTLS, token)
    max_waiting_requests: int = 2048          # requests held before their first token; more: RESOURCE_EXHAUSTED (S8)

    token_ids: tuple[int, ...]                # prompt minus its last token
    task: asyncio.Task | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    node: PrefillNode | None = None
    ready_time: float = 0.0


@dataclass
class RequestState:
    """What the node tracks for one request while its Generate handler runs."""

    request_id: str
    admitted: float = 0.0                     # pages allocated (written once, by the engine thread)
    transfer: Transfer | None = None
    prefilled_on: str = ""                    # address of the prefill node last asked
    outcome: PrefillOutcome | None = None     # its successful remote prefill
    handler_done: bool = False                # kept only until its transfer task ends


class DecodeNode(ReceiverEvents):
    """Engine + receiver + prefill pool. Build it (slow: loads the model), then `await start()` on
    the serving loop."""

    def __init__(self, config: DecodeNodeConfig) -> None:
        self.config = config
        self.node_id = config.node_id
        self.colocated = config.colocated
        self.metrics = node_metrics()
        request_metrics()  # registered now, so that /metrics names every family before the first request
        self.requests: dict[str, RequestState] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transport: TransferEngine | None = None
        self.receiver: KvReceiver | None = None
        self.pool: PrefillPool | None = None
        self._refresher: asyncio.Task | None = None
        self.closing = False
        if config.colocated:
            self.engine = EngineThread(LLMEngine(config.engine))
        else:
            self.transport = TransferEngine(FabricConfig(provider=config.provider, node=config.fabric_node))
            try:
                self.receiver = KvReceiver(self.transport, events=self)
                # UnsupportedModelError (a ValueError): sliding-window / hybrid models
                self.engine = EngineThread(LLMEngine(config.engine, kv_connector=self.receiver))
            except BaseException:
                self.transport.close()
                raise
        self.llm = self.engine.engine
        info = self.llm.info()
        self.model_name: str = info.model_name
        self.max_model_len: int = info.max_model_len
        self._page_size = info.page_size

    @property
    def tokenizer(self):  # a transformers tokenizer
        return self.llm.tokenizer

    async def start(self) -> None:
        """On the serving loop: open the prefill pool's channels (grpc.aio needs the loop)."""
        self.loop = asyncio.get_running_loop()
        if not self.config.colocated:
            cfg = self.config
            affinity = PrefixAffinity(block_tokens=self._page_size) if cfg.prefill_routing == "prefix" else None
            self.pool = PrefillPool(list(cfg.prefill_addresses), affinity, cfg.channel_security)
            await self.pool.refresh()
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        assert self.pool is not None
        while True:
            await asyncio.sleep(POOL_REFRESH_S)
            await self.pool.refresh()

    async def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE); the in-flight ones go on until the server stops."""
        self.closing = True

    async def close(self) -> None:
        self.closing = True
        for state in list(self.requests.values()):
            if state.transfer is not None and state.transfer.task is not None:
                state.transfer.task.cancel()
        self.engine.shutdown()
        if self._refresher is not None:
            self._refresher.cancel()
        if self.pool is not None:
            await self.pool.close()
        if self.transport is not None:
            self.transport.close()

    # --- requests (loop) ---------------------------------------------------------------------------

    def begin(self, rid: str) -> RequestState:
        """A Generate handler starts serving `rid`; ValueError if the id is in use here."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        state = self.requests[rid] = RequestState(rid)
        return state

    def end(self, state: RequestState) -> None:
        """The handler of `state` is done: stop a transfer whose KV never landed; the state goes
        now, or when its transfer task ends."""
        state.handler_done = True
        t = state.transfer
        if t is not None and t.task is not None and not t.task.done():
            if not t.ready.is_set():
                t.task.cancel()
            return
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        if self.requests.get(state.request_id) is state:
            del self.requests[state.request_id]

    async def prefill_outcome(self, state: RequestState) -> PrefillOutcome | None:
        """Loop: the successful remote prefill of a request that is finishing, if it had one.

        Its KV landed (so it could decode) but the Prefill response may not be processed yet: wait
        for the transfer task, at most PREFILL_RESPONSE_WAIT_S. A transfer whose KV never landed
        (aborted, failed, prefilled locally) is not waited for."""
        t = state.transfer
        if t is not None and t.task is not None and t.ready.is_set() and not t.task.done():
            done, _ = await asyncio.wait({t.task}, timeout=PREFILL_RESPONSE_WAIT_S)
            if not done:
                logger.warning("request %s: no Prefill response %.0f s after its KV landed; timings and "
                               "cached prompt tokens reported as 0", state.request_id, PREFILL_RESPONSE_WAIT_S)
        outcome, state.outcome = state.outcome, None
        return outcome

    # --- receiver events (engine thread / fabric progress thread) -----------------------------------

    def ticket_ready(self, ticket: TransferTicket, token_ids: tuple[int, ...]) -> None:
        """Engine thread: pages allocated (D3); hand the transfer to the loop."""
        rid = ticket.request_id
        state = self.requests.get(rid)
        if state is not None and not state.admitted:
            state.admitted = time.monotonic()
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._start_transfer, rid, token_ids, ticket)

    def ticket_refused(self, request_id: str, error: str) -> None:
        self.engine.submit(lambda: self._fail_waiting(request_id, error))

    def kv_landed(self, request_id: str) -> None:
        """Fabric progress thread: every write has landed."""
        self.engine.submit(lambda: self._kv_ready(request_id))

    # --- engine thread ----------------------------------------------------------------------------

    def _kv_ready(self, rid: str) -> None:
        assert self.receiver is not None and self.loop is not None
        self.receiver.finish(rid)
        r = self.llm.get_request(rid)
        if r is not None and r.status is RequestStatus.WAITING_FOR_KV:
            self.llm.kv_ready(rid)
        elif self.llm.is_held(rid):
            self.llm.release_blocks(rid)  # aborted while its KV was landing: now nothing can land
        self.loop.call_soon_threadsafe(self._mark_ready, rid)

    def _fail_waiting(self, rid: str, error: str) -> None:
        """Engine thread: end a waiting request with an error and free its pages (abandonment is safe)."""
        out = self.llm.kv_abandoned(rid, prefill_locally=False, error=error)
        if out is not None:
            self.engine.deliver(out)
        if self.llm.is_held(rid):
            self.llm.release_blocks(rid)

    def _abandoned(self, rid: str, error: str, locally: bool) -> None:
        """Engine thread: the transfer can no longer write; fall back to local prefill or fail."""
        assert self.receiver is not None
        self.receiver.abandon(rid)
        r = self.llm.get_request(rid)
        if r is not None and r.status is RequestStatus.WAITING_FOR_KV and locally:
            self.llm.kv_abandoned(rid, prefill_locally=True, error=error)
            return
        self._fail_waiting(rid, error)

    def _reprepare(self, rid: str) -> TransferTicket | None:
        """Engine thread: a fresh tag for a retry on another prefill node (same pages)."""
        assert self.receiver is not None
        self.receiver.abandon(rid)
        r = self.llm.get_request(rid)
        if r is None or r.status is not RequestStatus.WAITING_FOR_KV:
            self._release_if_held(rid)
            return None
        return self.receiver.prepare(rid, r.num_prompt_tokens, self.llm.block_table(rid))

    def _release_if_held(self, rid: str) -> None:
        assert self.receiver is not None
        self.receiver.abandon(rid)
        if self.llm.is_held(rid):
            self.llm.release_blocks(rid)

    def _hold_until_gone(self, rid: str, node: PrefillNode, msg: str) -> None:
        assert self.transport is not None and self.loop is not None
        out = self.llm.kv_abandoned(rid, prefill_locally=False, error=msg)  # keeps the pages held
        if out is not None:
            self.engine.deliver(out)
        transport = self.transport

        async def wait_gone() -> None:
            while not await asyncio.to_thread(transport.wait_peer_gone, node.peer, HOLD_PROBE_S):
                logger.warning("request %s: pages held until prefill node %s's endpoint is gone", rid, node.address)
            self.engine.submit(lambda: self._release_if_held(rid))

        self.loop.call_soon_threadsafe(lambda: asyncio.create_task(wait_gone()))

    # --- the loop: transfers ---------------------------------------------------------------------

    def _start_transfer(self, rid: str, tokens: tuple[int, ...], ticket: TransferTicket) -> None:
        t = Transfer(tokens)
        state = self.requests.get(rid)
        if state is None:   # its handler is gone already: the transfer still runs, to end safely
            state = self.requests[rid] = RequestState(rid, handler_done=True)
        state.transfer = t
        t.task = asyncio.create_task(self._run_transfer(state, ticket))

    def _mark_ready(self, rid: str) -> None:
        state = self.requests.get(rid)
        t = state.transfer if state is not None else None
        if t is not None:
            t.ready_time = time.monotonic()
            t.ready.set()

    async def _run_transfer(self, state: RequestState, ticket: TransferTicket | None) -> None:
        bind_request_id(state.request_id)  # this task serves one request's transfer
        assert self.pool is not None and state.transfer is not None
        t, rid = state.transfer, state.request_id
        tried: set[str] = set()
        errors: list[str] = []
        try:
            while ticket is not None:
                node = self.pool.choose(exclude=tried, token_ids=list(t.token_ids))
                if node is None:
                    why = "; ".join(errors) or self.pool.describe_down() or "no prefill node configured"
                    msg = f"no prefill node could prefill request {rid}: {why}"
                    logger.warning(msg)
                    self.engine.submit(lambda msg=msg: self._abandoned(rid, msg, self.config.local_prefill_fallback))
                    return
                tried.add(node.address)
                t.node = node
                state.prefilled_on = node.address
                ok, err = await self._prefill_on(node, state, ticket)
                if ok:
                    return
                errors.append(f"{node.address}: {err}")
                if not await self._abandon_on(node, rid):
                    # Writes may still land: the pages stay reserved until the endpoint is gone.
                    msg = f"prefill on {node.address} failed ({err}); its writes may still land"
                    self.engine.submit(lambda node=node, msg=msg: self._hold_until_gone(rid, node, msg))
                    return
                ticket = await self.engine.call(lambda: self._reprepare(rid))
            # None: the request ended meanwhile (its pages were released)
        except asyncio.CancelledError:
            # The client went away: make sure nothing can still land before the pages are reused.
            if t.node is not None and not t.ready.is_set():
                safe = await asyncio.shield(self._abandon_on(t.node, rid))
                if safe:
                    self.engine.submit(lambda: self._release_if_held(rid))
            raise
        finally:
            if state.handler_done:
                self._forget(state)

    async def _prefill_on(self, node: PrefillNode, state: RequestState, ticket: TransferTicket) -> tuple[bool, str]:
        assert self.transport is not None and state.transfer is not None
        t = state.transfer
        timeout = self.config.prefill_timeout_s
        req = ticket.to_pb(list(t.token_ids), self.transport.peer_descriptor, "", timeout)
        node.sent_tokens += len(t.token_ids)
        call_start = time.monotonic()
        try:
            resp = await node.prefill.Prefill(req, timeout=timeout)
            await asyncio.wait_for(t.ready.wait(), timeout=KV_LANDED_WAIT_S)  # writes delivered: the count follows
            # Prefill-side time from receipt to the last layer done; the rest until the count
            # completed here is the transfer tail (loopback RPC latency included).
            prefill_s = resp.timings.queue_time_s + resp.timings.compute_time_s
            state.outcome = PrefillOutcome(call_start, prefill_s, t.ready_time - call_start - prefill_s,
                                           resp.prefill_cached_tokens)
            self.metrics.kv_transfer_bytes.labels(model_name=self.model_name, side="decode").inc(resp.bytes_written)
            self.metrics.kv_transfer_seconds.labels(model_name=self.model_name, side="decode").observe(
                t.ready_time - call_start)
            return True, ""
        except grpc.aio.AioRpcError as e:
            if t.ready.is_set():
                return True, ""
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                assert self.pool is not None
                self.pool.mark_down(node, e.details() or "unavailable")
            return False, f"{e.code().name}: {e.details()}"
        except asyncio.TimeoutError:
            return False, f"Prefill returned but the write count did not complete within {KV_LANDED_WAIT_S:.0f} s"
        finally:
            node.sent_tokens -= len(t.token_ids)

    async def _abandon_on(self, node: PrefillNode, rid: str) -> bool:
        """True once no write for the request can land any more (S5)."""
        assert self.transport is not None
        try:
            resp = await node.prefill.AbortPrefill(prefill_pb2.AbortPrefillRequest(request_id=rid),
                                                   timeout=ABORT_RPC_TIMEOUT_S)
            if resp.confirmed:
                return True
        except grpc.aio.AioRpcError as e:
            logger.info("AbortPrefill of %s on %s failed: %s", rid, node.address, e.code().name)
        if node.peer is None:
            # We never learned this node's fabric endpoint, so it never answered us: it never got
            # our memory descriptors through a live Prefill either.
            return True
        return await asyncio.to_thread(self.transport.wait_peer_gone, node.peer, PEER_GONE_WAIT_S)

    # --- load ---------------------------------------------------------------------------------

    def node_info(self) -> node_pb2.NodeInfo:
        """This node's identity and load for the router (any thread: reads EngineThread.last_load)."""
        info, load = self.llm.info(), self.engine.last_load
        role = node_pb2.NODE_ROLE_COLOCATED if self.colocated else node_pb2.NODE_ROLE_DECODE
        return node_pb2.NodeInfo(
            node_id=self.node_id, role=role, model=info.model_name,
            sharding=common_pb2.ShardingScheme(tp_size=1, kv_heads_per_rank=info.num_kv_heads,
                                               total_kv_heads=info.num_kv_heads),
            load=common_pb2.NodeLoad(
                outstanding_requests=load.num_unfinished,
                outstanding_tokens=load.prompt_tokens_left + load.output_tokens_left,
                waiting_requests=load.num_waiting, running_requests=load.num_running,
                free_kv_blocks=load.free_blocks, total_kv_blocks=load.total_blocks,
                page_size=info.page_size),
            num_layers=info.num_layers, max_context_length=info.max_model_len,
            fabric_peer=peer_to_bytes(self.transport.peer_descriptor) if self.transport is not None else b"",
        )
        req.decode_node_id = self.config.node_id   # under mTLS, checked against our certificate (S9)
