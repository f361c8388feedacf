"""The decode node's gRPC server and its transfer orchestration.

Threads and tasks:
- the engine thread (AsyncEngine) runs schedule -> run -> update; the engine hook `on_kv_wait`
  fires there when a request has its pages, and hands a `PrefillTicket` to the asyncio loop;
- the asyncio loop serves gRPC and runs one transfer task per request (the Prefill call, with a
  deadline, retries and safe abandonment);
- the fabric progress thread reports the completed immediate-data count, handed to the engine
  thread, which makes the request schedulable (D4: never before).

Abandonment (S3, S5): when a Prefill call fails, times out, or the client goes away, the pages
are released only once no write can land any more: the prefill node confirmed AbortPrefill, or
its fabric endpoint is gone, or the call never reached a node that was never reachable.

Metrics (pdserve.serving.metrics, R5): TTFT, inter-token gaps, E2E and request_success_total as this node
streams them; request_queue_time_seconds from receipt to admission (pages allocated: the
on_kv_wait hook when disaggregated, the first scheduled chunk when colocated); KV transfer bytes
received and seconds from the Prefill dispatch to the last write landed (side="decode"). The
engine's gauges come from an EngineCollector over `AsyncEngine.last_metrics` (decode_node/__main__).
Logs: every line of a request's handler or transfer task carries its request id.

Usage (R2): cached_prompt_tokens is the engine's prefix-cache hit when colocated; when the prompt
was prefilled remotely, the prefill node's (PrefillResponse.prefill_cached_tokens), since this
node computed none of the prompt but its last token. A locally prefilled fallback reports 0.
The handler waits (briefly, PREFILL_RESPONSE_WAIT_S) for the Prefill response when the request
finishes before it was processed, so that timings and usage never depend on that race.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
from pdserve_api.convert import output_to_pb, peer_to_bytes, sampling_from_pb, ticket_to_pb
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc, node_pb2, node_pb2_grpc, prefill_pb2

from decode_node.prefill_pool import PREFILL_ROUTING, PrefillNode, PrefillPool, PrefixAffinity
from pdserve.engine.engine_thread import AsyncEngine
from pdserve.engine.llm_engine import EngineHooks
from pdserve.serving.logs import bind_request_id
from pdserve.serving.metrics import RequestTimer, node_metrics, request_metrics
from pdserve.engine.request import RequestStatus
from pdserve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# A request whose KV has landed may finish before its Prefill response is processed (a one-token
# answer): its final message waits this long at most for the response's timings and cached count.
PREFILL_RESPONSE_WAIT_S = 10.0


@dataclass(frozen=True)
class _PrefillOutcome:
    """A successful remote prefill, as the final message reports it."""

    call_start: float      # time.monotonic() of the Prefill call
    prefill_s: float       # prefill-side time from receipt to the last layer done
    tail_s: float          # the rest until the write count completed here
    cached_tokens: int     # prompt tokens the prefill node took from its prefix cache (not computed)


@dataclass
class _Transfer:
    request_id: str
    token_ids: list[int]                      # prompt minus its last token
    task: asyncio.Task | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    node: PrefillNode | None = None
    started: float = field(default_factory=time.monotonic)
    ready_time: float = 0.0


@dataclass
class _Stamps:
    """When the engine thread first admitted a request (written there once; read by its handler)."""

    admitted: float = 0.0


class DecodeNode:
    """Engine + receiver + prefill pool. Build it, then `await start()` on the serving loop."""

    def __init__(self, engine_config, node_id: str, colocated: bool, prefill_addresses: list[str],
                 provider: str | None, fabric_node: str | None, prefill_timeout_s: float = 60.0,
                 local_prefill_fallback: bool = False, prefill_routing: str = "least-loaded") -> None:
        if prefill_routing not in PREFILL_ROUTING:
            raise ValueError(f"prefill routing must be one of {PREFILL_ROUTING}, got {prefill_routing!r}")
        self.node_id = node_id
        self.colocated = colocated
        self.prefill_timeout_s = prefill_timeout_s
        self.local_prefill_fallback = local_prefill_fallback
        self.hooks = EngineHooks(on_kv_wait=None if colocated else self._on_kv_wait,
                                 on_schedule=self._on_schedule if colocated else None)
        self.engine = AsyncEngine(engine_config, self.hooks)
        self.llm = self.engine.engine
        self.model_name: str = self.llm.source.name
        self.metrics = node_metrics()
        request_metrics()  # registered now, so that /metrics names every family before the first request
        self.stamps: dict[str, _Stamps] = {}  # request id -> its stamps, while its handler runs
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transfers: dict[str, _Transfer] = {}
        self.prefilled_on: dict[str, str] = {}   # request id -> prefill node address (for timings)
        self.prefill_outcomes: dict[str, _PrefillOutcome] = {}  # request id -> its successful remote prefill
        self.fabric = self.receiver = self.pool = None
        if not colocated:
            from fabric import FabricConfig, TransferEngine
            from kv_messenger import ContextCodec, KvReceiver
            from kv_messenger.wiring import check_transferable, layout_of, register_kv

            try:
                check_transferable(self.llm)  # UnsupportedModelError (a ValueError): sliding-window / hybrid models
            except ValueError:
                self.engine.shutdown()
                raise
            self.fabric = TransferEngine(FabricConfig(provider=provider, node=fabric_node))
            region = register_kv(self.fabric, self.llm.kv_cache)
            self.receiver = KvReceiver(self.fabric, region, layout_of(self.llm.kv_cache),
                                       ContextCodec(self.llm.arch.hidden_size), on_ready=self._on_count_complete)
            affinity = (PrefixAffinity(block_tokens=self.llm.cache_manager.page_size)
                        if prefill_routing == "prefix" else None)
            self.pool = PrefillPool(prefill_addresses, affinity)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.pool is not None:
            await self.pool.refresh()
            self._refresher = asyncio.create_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.pool.refresh()

    async def close(self) -> None:
        for t in list(self.transfers.values()):
            if t.task is not None:
                t.task.cancel()
        self.engine.shutdown()
        if self.pool is not None:
            self._refresher.cancel()
            await self.pool.close()
        if self.fabric is not None:
            self.fabric.close()

    # --- engine thread ----------------------------------------------------------------------------

    def _stamp_admitted(self, rid: str, now: float) -> None:
        stamps = self.stamps.get(rid)
        if stamps is not None and not stamps.admitted:
            stamps.admitted = now

    def _on_schedule(self, sched: SchedulerOutput) -> None:
        """Engine hook (colocated): a request is admitted when first scheduled."""
        now = time.monotonic()
        for c in sched.chunks:
            self._stamp_admitted(c.request_id, now)

    def _on_kv_wait(self, request, block_ids: list[int]) -> None:
        """Engine hook: pages allocated (D3); hand the transfer to the loop."""
        rid = request.request_id
        self._stamp_admitted(rid, time.monotonic())
        try:
            ticket = self.receiver.prepare(rid, request.num_prompt_tokens, block_ids)
        except (ValueError, RuntimeError) as e:
            self.engine.submit(lambda: self._fail_waiting(rid, f"cannot receive KV: {e}"))
            return
        tokens = list(request.prompt_token_ids[:-1])
        self.loop.call_soon_threadsafe(self._start_transfer, rid, tokens, ticket)

    def _on_count_complete(self, rid: str) -> None:
        """Fabric progress thread: every write has landed."""
        self.engine.submit(lambda: self._kv_ready(rid))

    def _kv_ready(self, rid: str) -> None:
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
        self.receiver.abandon(rid)
        r = self.llm.get_request(rid)
        if r is not None and r.status is RequestStatus.WAITING_FOR_KV and locally:
            self.llm.kv_abandoned(rid, prefill_locally=True, error=error)
            return
        self._fail_waiting(rid, error)

    # --- the loop: transfers ---------------------------------------------------------------------

    def _start_transfer(self, rid: str, tokens: list[int], ticket) -> None:
        t = _Transfer(rid, tokens)
        self.transfers[rid] = t
        t.task = asyncio.create_task(self._run_transfer(t, ticket))

    def _mark_ready(self, rid: str) -> None:
        t = self.transfers.get(rid)
        if t is not None:
            t.ready_time = time.monotonic()
            t.ready.set()

    async def _run_transfer(self, t: _Transfer, ticket) -> None:
        bind_request_id(t.request_id)  # this task serves one request's transfer
        tried: set[str] = set()
        errors: list[str] = []
        try:
            while True:
                node = self.pool.choose(exclude=tried, token_ids=t.token_ids)
                if node is None:
                    why = "; ".join(errors) or self.pool.describe_down() or "no prefill node configured"
                    msg = f"no prefill node could prefill request {t.request_id}: {why}"
                    logger.warning(msg)
                    self.engine.submit(lambda: self._abandoned(t.request_id, msg, self.local_prefill_fallback))
                    return
                tried.add(node.address)
                t.node = node
                self.prefilled_on[t.request_id] = node.address
                ok, err = await self._prefill_on(node, t, ticket)
                if ok:
                    return
                errors.append(f"{node.address}: {err}")
                if not await self._abandon_on(node, t):
                    # Writes may still land: the pages stay reserved until the endpoint is gone.
                    msg = f"prefill on {node.address} failed ({err}); its writes may still land"
                    self.engine.submit(lambda: self._hold_until_gone(t.request_id, node, msg))
                    return
                ticket = await self.engine.call(lambda: self._reprepare(t.request_id))
                if ticket is None:
                    return  # the request ended meanwhile (its pages were released)
        except asyncio.CancelledError:
            # The client went away: make sure nothing can still land before the pages are reused.
            if t.node is not None and not t.ready.is_set():
                safe = await asyncio.shield(self._abandon_on(t.node, t))
                if safe:
                    self.engine.submit(lambda: self._release_if_held(t.request_id))
            raise
        finally:
            self.transfers.pop(t.request_id, None)

    async def _prefill_on(self, node: PrefillNode, t: _Transfer, ticket) -> tuple[bool, str]:
        req = ticket_to_pb(ticket, t.token_ids, self.fabric.peer_descriptor, "", self.prefill_timeout_s)
        node.sent_tokens += len(t.token_ids)
        call_start = time.monotonic()
        try:
            resp = await node.prefill.Prefill(req, timeout=self.prefill_timeout_s)
            await asyncio.wait_for(t.ready.wait(), timeout=10.0)  # writes delivered: the count follows
            # Prefill-side time from receipt to the last layer done; the rest until the count
            # completed here is the transfer tail (loopback RPC latency included, ~0.1 ms).
            prefill_s = resp.timings.queue_time_s + resp.timings.compute_time_s
            self.prefill_outcomes[t.request_id] = _PrefillOutcome(call_start, prefill_s,
                                                                  t.ready_time - call_start - prefill_s,
                                                                  resp.prefill_cached_tokens)
            self.metrics.kv_transfer_bytes.labels(model_name=self.model_name, side="decode").inc(resp.bytes_written)
            self.metrics.kv_transfer_seconds.labels(model_name=self.model_name, side="decode").observe(
                t.ready_time - call_start)
            return True, ""
        except grpc.aio.AioRpcError as e:
            if t.ready.is_set():
                return True, ""
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.pool.mark_down(node, e.details() or "unavailable")
            return False, f"{e.code().name}: {e.details()}"
        except asyncio.TimeoutError:
            return False, "Prefill returned but the write count did not complete within 10 s"
        finally:
            node.sent_tokens -= len(t.token_ids)

    async def _abandon_on(self, node: PrefillNode, t: _Transfer) -> bool:
        """True once no write for t can land any more (S5)."""
        try:
            resp = await node.prefill.AbortPrefill(prefill_pb2.AbortPrefillRequest(request_id=t.request_id),
                                                   timeout=10.0)
            if resp.confirmed:
                return True
        except grpc.aio.AioRpcError as e:
            logger.info("AbortPrefill of %s on %s failed: %s", t.request_id, node.address, e.code().name)
        if node.peer is None:
            # We never learned this node's fabric endpoint, so it never answered us: it never got
            # our memory descriptors through a live Prefill either.
            return True
        return await asyncio.to_thread(self.fabric.wait_peer_gone, node.peer, 10.0)

    async def prefill_outcome(self, rid: str) -> _PrefillOutcome | None:
        """Loop: the successful remote prefill of a request that is finishing, if it had one.

        Its KV landed (so it could decode) but the Prefill response may not be processed yet: wait
        for the transfer task, at most PREFILL_RESPONSE_WAIT_S. A transfer whose KV never landed
        (aborted, failed, prefilled locally) is not waited for."""
        t = self.transfers.get(rid)
        if t is not None and t.task is not None and t.ready.is_set() and not t.task.done():
            done, _ = await asyncio.wait({t.task}, timeout=PREFILL_RESPONSE_WAIT_S)
            if not done:
                logger.warning("request %s: no Prefill response %.0f s after its KV landed; timings and "
                               "cached prompt tokens reported as 0", rid, PREFILL_RESPONSE_WAIT_S)
        return self.prefill_outcomes.pop(rid, None)

    def _reprepare(self, rid: str):
        """Engine thread: a fresh tag for a retry on another prefill node (same pages)."""
        self.receiver.abandon(rid)
        r = self.llm.get_request(rid)
        if r is None or r.status is not RequestStatus.WAITING_FOR_KV:
            self._release_if_held(rid)
            return None
        return self.receiver.prepare(rid, r.num_prompt_tokens, self.llm.block_table(rid))

    def _release_if_held(self, rid: str) -> None:
        self.receiver.abandon(rid)
        if self.llm.is_held(rid):
            self.llm.release_blocks(rid)

    def _hold_until_gone(self, rid: str, node: PrefillNode, msg: str) -> None:
        out = self.llm.kv_abandoned(rid, prefill_locally=False, error=msg)  # keeps the pages held
        if out is not None:
            self.engine.deliver(out)

        async def wait_gone() -> None:
            while not await asyncio.to_thread(self.fabric.wait_peer_gone, node.peer, 30.0):
                logger.warning("request %s: pages held until prefill node %s's endpoint is gone", rid, node.address)
            self.engine.submit(lambda: self._release_if_held(rid))

        self.loop.call_soon_threadsafe(lambda: asyncio.create_task(wait_gone()))

    # --- load ---------------------------------------------------------------------------------

    def load_snapshot(self) -> node_pb2.NodeInfo:
        """Engine thread: this node's load for the router."""
        eng = self.llm
        s = eng.scheduler
        outstanding_tokens = 0
        for r in eng.unfinished_requests():
            left = (r.sampling.max_tokens or eng.max_model_len) - len(r.output_token_ids)
            outstanding_tokens += max(0, r.num_tokens - r.num_computed_tokens) + max(0, left)
        role = node_pb2.NODE_ROLE_COLOCATED if self.colocated else node_pb2.NODE_ROLE_DECODE
        from pdserve_api.v1 import common_pb2

        return node_pb2.NodeInfo(
            node_id=self.node_id, role=role, model=eng.source.name,
            sharding=common_pb2.ShardingScheme(tp_size=1, kv_heads_per_rank=eng.arch.num_kv_heads,
                                               total_kv_heads=eng.arch.num_kv_heads),
            load=common_pb2.NodeLoad(
                outstanding_requests=eng.num_unfinished_requests, outstanding_tokens=outstanding_tokens,
                waiting_requests=len(s.waiting) + len(s.waiting_for_kv), running_requests=len(s.running),
                free_kv_blocks=eng.pool.num_free_blocks, total_kv_blocks=eng.pool.num_usable_blocks,
                page_size=eng.cache_manager.page_size),
            num_layers=eng.arch.num_layers, max_context_length=eng.max_model_len,
            fabric_peer=peer_to_bytes(self.fabric.peer_descriptor) if self.fabric is not None else b"",
        )


_REASONS = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length",
            generate_pb2.FINISH_REASON_ABORT: "abort"}


def msg_reason(msg: generate_pb2.GenerateResponse) -> str:
    """A final message's finish reason as request_success_total labels it (anything else: error)."""
    return _REASONS.get(msg.finish_reason, "error")


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def Generate(self, request, context):
        node = self.node
        rid = request.request_id or f"{node.node_id}-{uuid.uuid4().hex[:12]}"
        if request.model and request.model != node.llm.source.name:
            raise LookupError(f"unknown model {request.model!r}; this node serves {node.llm.source.name!r}")
        params = sampling_from_pb(request.sampling)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            prompt = request.text
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        elif kind == "messages":
            msgs = [{"role": m.role, "content": m.content} for m in request.messages.messages]
            prompt = list(node.llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))
        else:
            raise ValueError("the request has no prompt (text, token_ids or messages)")
        t0 = time.monotonic()
        bind_request_id(rid)  # this handler task serves one request: every line it logs names it
        timer = RequestTimer(request_metrics(), node.model_name, start=t0)
        stamps = _Stamps()
        node.stamps.setdefault(rid, stamps)  # a duplicate id is refused by the engine; keep the first's
        first = None
        gen = node.engine.generate(prompt, params, rid, remote_prefill=not node.colocated)
        try:
            async for out in gen:
                msg = output_to_pb(out, node.llm.tokenizer)
                if first is None and out.new_token_ids:
                    first = time.monotonic()
                timer.tokens(len(out.new_token_ids))
                if out.finished:
                    now = time.monotonic()
                    remote = await node.prefill_outcome(rid)
                    call_start, prefill_s, tail_s = (t0, 0.0, 0.0) if remote is None else (
                        remote.call_start, remote.prefill_s, remote.tail_s)
                    if remote is not None:  # the prompt was computed (or taken from its cache) there
                        msg.usage.cached_prompt_tokens = remote.cached_tokens
                    if node.colocated and stamps.admitted:  # prefilled here: from admission to the first token
                        call_start, prefill_s = stamps.admitted, (first or now) - stamps.admitted
                    msg.timings.CopyFrom(generate_pb2.ServerTimings(
                        queue_time_s=call_start - t0, prefill_time_s=prefill_s + tail_s, kv_transfer_time_s=tail_s,
                        time_to_first_token_s=(first or now) - t0, e2e_time_s=now - t0,
                        decode_node=node.node_id,
                        prefill_node=node.prefilled_on.pop(rid, ""),
                    ))
                    timer.finish(msg_reason(msg), now)
                yield msg
        except (asyncio.CancelledError, GeneratorExit):
            timer.finish("abort")  # the client went away (a no-op once finished)
            raise
        finally:
            if stamps.admitted:
                node.metrics.queue_time.labels(model_name=node.model_name).observe(stamps.admitted - t0)
            if node.stamps.get(rid) is stamps:
                del node.stamps[rid]
            await gen.aclose()
            node.prefilled_on.pop(rid, None)
            node.prefill_outcomes.pop(rid, None)
            t = node.transfers.get(rid)
            if t is not None and t.task is not None and not t.task.done() and not t.ready.is_set():
                t.task.cancel()

    async def Abort(self, request, context):
        return generate_pb2.AbortResponse(aborted=await self.node.engine.abort(request.request_id))

    async def ListModels(self, request, context):
        eng = self.node.llm
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelInfo(id=eng.source.name, max_context_length=eng.max_model_len)])


class NodeServicer(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, node: DecodeNode) -> None:
        self.node = node

    async def GetNodeInfo(self, request, context):
        return await self.node.engine.call(self.node.load_snapshot)
