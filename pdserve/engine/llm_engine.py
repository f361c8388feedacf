"""The engine every pdserve node runs: one step = schedule -> run -> update.

    sched = scheduler.schedule(drafts)    # which tokens of which requests (E2-E6, E10, E11)
    out = runner.execute(sched)           # one forward pass over all of them
    return self._update(sched, out)       # sample, append, detokenize, stop, free

Speculative decoding (E20) plugs in as one SpeculativeDecoder (pdserve.engine.spec_decode.decoder;
docs/speculative-handoff.md), and the engine knows it only as "is there one": it proposes the
drafts the scheduler grants, fills a drafting model's slots, sees each pass, and verifies, emits
and rolls back each chunk that carries drafts; its counters are EngineMetrics.spec_*. A prefill
node keeps each prefill-only request's last hidden states for its context record
(spec_decode.handoff.ContextTails, EngineConfig.context_history_rows).

Memory (issue 4): the cache manager keeps one block table per attention group (E8) and the prefix
cache (E12, E13); `_update` publishes newly complete blocks after each pass. Around the three
calls, the `Preemptor` brings offloaded requests back before scheduling and, when the scheduler
reports stalled requests, offloads or soft-resets others after the pass (E14, E15); when nothing
could be scheduled at all it does so at once and the step schedules again.

A KV transfer plugs in through one connector (pdserve.engine.kv_connector), given at
construction: a PrefillConnector sees each pass before it runs (D6), each finished layer (D7) and
each finished prefill's hidden state and logits (D12); a DecodeConnector learns which requests
wait for KV in which pages (D3). The engine owns its KV memory (built by pdserve.engine.builder)
and hands the connector the pool once it exists (`register_kv_cache`).

Threading: an engine is driven by one thread (the caller of `step`); `EngineThread` runs that
thread for servers. Nothing here waits (a TP pass waits on its ranks, bounded in the runner).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Sequence

import torch

from pdserve.engine import snapshots
from pdserve.engine.builder import build_engine
from pdserve.engine.completions import KvCompletions
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import DecodeConnector, KvConnector, KvWait, PrefillConnector, PrefillDone
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import FinishReason, Request, RequestStatus, TransferRole
from pdserve.engine.runner import ModelOutput
from pdserve.engine.sampling.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling.sampler import SampleLogprobs, Sampler, SamplerOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.engine.spec_decode.decoder import (
    DecodedRow,
    SpeculativeDecoder,
    TargetPass,
    TargetRows,
)
from pdserve.engine.spec_decode.handoff import ContextTails
from pdserve.engine.spec_decode.rejection import row_generators
from pdserve.engine.stats import EngineInfo, EngineLoad, EngineMetrics
from pdserve.engine.tracked import TrackedRequest

logger = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, kv_connector: KvConnector | None = None) -> None:
        """Load the model and build the KV pool (pdserve.engine.builder); `kv_connector` (a
        PrefillConnector or a DecodeConnector) is handed the pool before this returns (its
        ValueError propagates)."""
        self.config = config = config or EngineConfig()
        if kv_connector is not None and not isinstance(kv_connector, (PrefillConnector, DecodeConnector)):
            raise TypeError(f"kv_connector must be a PrefillConnector or a DecodeConnector, "
                            f"got {type(kv_connector).__name__}")
        self._prefill_conn = kv_connector if isinstance(kv_connector, PrefillConnector) else None
        self._decode_conn = kv_connector if isinstance(kv_connector, DecodeConnector) else None
        parts = build_engine(config, kv_connector)
        m = parts.loaded
        self.source, self.arch, self.tokenizer, self.eos_token_ids = m.source, m.arch, m.tokenizer, m.eos_token_ids
        self.tp_plan, self.model, self.max_model_len = m.tp_plan, m.model, parts.max_model_len
        self.kv_cache, self.tp, self.pool, self.swap = parts.kv_cache, parts.tp, parts.pool, parts.swap
        self.cache_manager, self.scheduler, self.preemptor = parts.cache_manager, parts.scheduler, parts.preemptor
        self.runner = parts.runner
        # the speculative decoder (E20, pdserve.engine.spec_decode.decoder), None: none; tests and
        # benchmarks may install another on an idle engine
        self.speculator: SpeculativeDecoder | None = parts.speculator
        self.sampler = Sampler()
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self._tracked: dict[str, TrackedRequest] = {}
        # a prefill node's last hidden states per prefill-only request, for its context record (D17/D19)
        self._tails = ContextTails(config.context_history_rows) if config.context_history_rows else None
        # the connector's events, applied (landed, failed, quarantined, released) and the PREFILL
        # requests whose pages are held when they end
        self.completions = KvCompletions(self.scheduler, self.cache_manager, self._fail)
        self._ids = itertools.count()
        # The load as of the last scheduled pass (or `load()` call by the driving thread): a frozen
        # snapshot other threads may read at any time (EngineThread.last_load).
        self.last_load: EngineLoad | None = None
        self.num_steps = 0
        self.num_forward_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_first_steps = 0          # passes that sampled a request's first output token(s)
        self.num_first_step_tokens = 0    # tokens those passes emitted (> 1 each: drafts accepted)

    # --- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        ids = list(prompt)
        vocab = self.arch.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        role: TransferRole = TransferRole.LOCAL,
    ) -> Request:
        """Validate and queue a request; raises ValueError (nothing queued) for bad input.

        role: what the request is to a KV transfer (pdserve.engine.request.TransferRole): LOCAL,
        PREFILL (prefill nodes: compute every given token's KV, sample nothing; with a prefill
        connector its pages are held when it ends, until a KvReleased) or REMOTE_PREFILL (decode
        nodes: admission allocates its pages and parks it in WAITING_FOR_KV until its KvLanded).
        """
        if not isinstance(role, TransferRole):
            raise ValueError(f"role must be a TransferRole, got {role!r}")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked or self.cache_manager.holds.holds_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} tokens "
                f"(at least one must be left to generate)"
            )
        need = self.cache_manager.max_blocks_per_request(len(ids) + 1, self.config.scheduler.max_batch_tokens)
        if need > self.pool.num_usable_blocks:
            raise ValueError(
                f"prompt of {len(ids)} tokens needs {need} KV blocks but the cache has only "
                f"{self.pool.num_usable_blocks}"
            )
        request = Request(request_id=request_id, prompt_token_ids=ids, sampling=params,
                          max_total_tokens=self.max_model_len, eos_token_ids=self.eos_token_ids, role=role)
        if role is TransferRole.PREFILL and self._prefill_conn is not None:
            self.completions.hold_on_finish.add(request_id)   # the sender reads its pages until the transfer ends (D11)
        self._tracked[request_id] = TrackedRequest(request, IncrementalDetokenizer(self.tokenizer, ids, params), [])
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a request now (ABORT, or ERROR when `error` is given); None if it is not running."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        reason = FinishReason.ERROR if error is not None else FinishReason.ABORT
        return self._finish(tracked, reason, new_ids=(), delta="", error=error)

    # --- the transfer's completions (pdserve.engine.kv_connector's events) -------------------------

    def apply_kv_events(self) -> list[RequestOutput]:
        """Apply the connector's queued events (engine thread; step() does at its start, EngineThread
        at every idle tick); returns the outputs of the requests they ended."""
        conn = self._prefill_conn or self._decode_conn
        if conn is None:
            return []
        outputs = []
        for event in conn.kv_events():
            tracked = self._tracked.get(event.request_id) if event.request_id is not None else None
            out = self.completions.apply(event, tracked, self.speculator)
            if out is not None:
                outputs.append(out)
        return outputs

    def quarantined_blocks(self, hold_id: str) -> int | None:
        """Blocks in the quarantine `hold_id` (a KvQuarantined's), None if it made none or was released."""
        return self.cache_manager.holds.quarantined_blocks(hold_id)

    def holds_pages(self, request_id: str) -> bool:
        """True while a finished request's pages are held for a transfer (until its KvReleased)."""
        return self.cache_manager.holds.holds_request(request_id)

    @property
    def num_quarantines(self) -> int:
        return self.cache_manager.holds.num_quarantines

    @property
    def num_quarantined_blocks(self) -> int:
        return self.cache_manager.holds.num_quarantined_blocks

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        tracked = self._tracked.get(request_id)
        return tracked.request if tracked is not None else None

    def unfinished_requests(self) -> list[Request]:
        return [t.request for t in self._tracked.values()]

    def block_table(self, request_id: str) -> list[int]:
        return list(self.cache_manager.block_table(request_id))

    def _group_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Every attention group's table of a request, in KvCacheSpec.groups order."""
        m = self.cache_manager
        return tuple(tuple(m.block_table(request_id, g)) for g in m.group_names)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def has_schedulable_work(self) -> bool:
        """True when step() can make progress (requests waiting for KV cannot)."""
        return self.scheduler.has_work()

    @property
    def num_held_requests(self) -> int:
        return self.cache_manager.holds.num_requests

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        ended = self.apply_kv_events()   # the transfer's completions (kv_connector's events)
        self.preemptor.restore()
        sched = self._schedule()
        if sched.is_empty:
            return ended + self._stalled()
        began = time.perf_counter()
        if self.speculator is not None:
            sched = self.speculator.fill(sched)   # a draft model drafts into its granted slots
        self.last_load = self.load()   # what runs now holds its pages: routing reads this during the pass
        out = self._run(sched)
        if self.speculator is not None:
            self.speculator.after_pass(TargetPass(sched.chunks, sched.num_batched_tokens, out.all_hidden, began))
        results = self._update(sched, out)
        if sched.stalled:
            self.preemptor.relieve(sched.stalled)  # they run next step
        return ended + results

    def _schedule(self) -> SchedulerOutput:
        """This step's pass; when nothing could run, room is made and it is scheduled again (E15).
        The decode connector learns of every request admitted to wait for its KV (D3)."""
        drafts = self._drafts()
        sched = self.scheduler.schedule(drafts)
        kv_waits = list(sched.kv_waits)
        if sched.is_empty and sched.stalled and not self.preemptor.relieve(sched.stalled).is_empty:
            sched = self.scheduler.schedule(drafts)
            kv_waits += sched.kv_waits
        if self._decode_conn is not None:
            for r in kv_waits:
                self._decode_conn.on_kv_wait(KvWait(r.request_id, tuple(r.prompt_token_ids),
                                                    tuple(self.block_table(r.request_id)),
                                                    self._group_tables(r.request_id)))
        return sched

    def _drafts(self) -> dict[str, tuple[int, ...]] | None:
        """Speculative proposals (E20) for the running requests whose next pass decodes."""
        return None if self.speculator is None else self.speculator.propose(self.scheduler.running)

    def _run(self, sched: SchedulerOutput) -> ModelOutput:
        """The forward pass, with the prefill connector's hooks (D6, D7) and the hidden states of
        every fed token when a draft head or a prefill node's context tails want them."""
        conn = self._prefill_conn
        if conn is not None:
            conn.on_schedule(sched, {c.request_id: self._group_tables(c.request_id) for c in sched.chunks})
        heads = self.speculator is not None and self.speculator.wants_all_hidden
        tails = self._tails is not None and conn is not None and any(c.request.prefill_only for c in sched.chunks)
        out = self.runner.execute(sched, conn.on_layer_done if conn is not None else None, all_hidden=heads or tails)
        if tails:
            self._tails.keep(sched.chunks, out.all_hidden)
        return out

    def _update(self, sched: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        self.num_steps += 1
        self.num_forward_tokens += sched.num_batched_tokens
        self.num_prompt_tokens_computed += sum(
            max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in sched.chunks)
        sampled = self._sample(sched, out)
        results: list[RequestOutput] = []
        # the passes that sample a request's first output: on a decode node its first step after
        # the transfer, which emits more than one token when drafts from the shipped hidden state
        # (D17) are accepted
        firsts = [c.request for c in sched.chunks if c.samples and not c.request.prefill_only
                  and not c.request.output_token_ids]
        k = 0
        for c in sched.chunks:
            r = c.request
            tracked = self._tracked[r.request_id]
            if c.draft_token_ids:
                first = out.chunk_rows[r.request_id]
                n = c.num_sample_rows
                rows = out.logits[first:first + n], out.hidden[first:first + n]     # [K+1, V], [K+1, H]
                if c.draft_probs is None:   # verified by equality with the batched samples
                    target = TargetRows(*rows, sampled=tuple(sampled.token_ids[k:k + n]),
                                        logprobs=tuple(sampled.logprobs[k:k + n]))
                    k += n
                else:                       # verified by rejection sampling against the draft's distribution
                    target = TargetRows(*rows, generators=tuple(self._generators(c)))
                results.append(self.speculator.verify(c, target, functools.partial(self._append_token, tracked)))
                continue
            r.num_computed_tokens = c.end
            self.cache_manager.commit(r)  # its newly complete blocks join the prefix cache
            if r.prefill_only and c.end == r.target_computed_tokens:
                results.append(self._prefilled(tracked, c, out))
                continue
            if not c.samples:
                continue
            done = self._append_token(tracked, sampled.token_ids[k], sampled.logprobs[k])
            k += 1
            results.append(done)
            if self.speculator is not None:
                row = out.chunk_rows[r.request_id]
                self.speculator.decoded(DecodedRow(r, out.hidden[row], c.end - 1, done.finished))
        self.num_first_steps += len(firsts)
        self.num_first_step_tokens += sum(len(r.output_token_ids) for r in firsts)
        return results

    def _sample(self, sched: SchedulerOutput, out: ModelOutput) -> SamplerOutput | None:
        """Every sampling row at once, except those of chunks whose drafts were sampled from a
        draft distribution (the speculator verifies them by rejection sampling)."""
        sampling_chunks = [c for c in sched.chunks if c.samples and c.draft_probs is None]
        if not sampling_chunks:
            return None
        rows: list[int] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator] = []
        for c in sampling_chunks:
            first = out.chunk_rows[c.request_id]
            rows.extend(range(first, first + c.num_sample_rows))
            params.extend([c.request.sampling] * c.num_sample_rows)
            generators.extend(self._generators(c))
        # logits: [R, V]; a decode step samples every row in order: no 6 MB gather copy then
        logits = out.logits if rows == list(range(out.logits.shape[0])) else out.logits[torch.tensor(rows)]
        return self.sampler.sample(logits, params, generators)

    def _prefilled(self, tracked: TrackedRequest, c: ScheduledChunk, out: ModelOutput) -> RequestOutput:
        """A prefill-only request computed its last token: hand the connector its pages, hidden
        state(s) and logits (D12), and finish it."""
        r = c.request
        row = out.chunk_rows[r.request_id]
        if self._prefill_conn is not None:
            hidden = self._tails.take(r, c.end) if self._tails is not None else out.hidden[row]
            self._prefill_conn.on_prefill_done(PrefillDone(r.request_id, tuple(self.block_table(r.request_id)),
                                                           hidden, out.logits[row]))
        return self._finish(tracked, FinishReason.PREFILLED, new_ids=(), delta="")

    def _generators(self, c: ScheduledChunk) -> list[torch.Generator]:
        """One generator per sampled row of a chunk (spec_decode.rejection.row_generators)."""
        return row_generators(c.request, c.num_sample_rows, self._default_generator)

    def _append_token(self, tracked: TrackedRequest, token: int, lp: SampleLogprobs | None) -> RequestOutput:
        """Emit one sampled token of a request: detokenize it and check every stop condition."""
        self.num_generated_tokens += 1
        reason, delta = tracked.push(token, lp)
        new_lp = (lp,) if lp is not None else ()
        if reason is not None:
            return self._finish(tracked, reason, new_ids=(token,), delta=delta, new_logprobs=new_lp)
        return tracked.running_output((token,), delta, new_lp)

    def _finish(
        self,
        tracked: TrackedRequest,
        reason: FinishReason,
        new_ids: tuple[int, ...],
        delta: str,
        new_logprobs: tuple[SampleLogprobs, ...] = (),
        error: str | None = None,
    ) -> RequestOutput:
        r = tracked.request
        # A request still waiting for its KV may have writes in flight into its pages (S5), and a
        # PREFILL request's pages are still read by its transfer (D11): they are held until the
        # connector's KvReleased (or KvQuarantined, KvLanded, KvFailed) names them.
        hold = self.completions.holds_at_finish(r)
        self.scheduler.detach(r)
        if hold:
            self.cache_manager.hold(r)
        else:
            self.cache_manager.free(r)
        self.preemptor.forget(r)
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        del self._tracked[r.request_id]
        if self._tails is not None:
            self._tails.forget(r.request_id)
        return tracked.finished_output(reason, new_ids, delta, new_logprobs, error)

    def _fail(self, tracked: TrackedRequest, error: str) -> RequestOutput:
        return self._finish(tracked, FinishReason.ERROR, new_ids=(), delta="", error=error)

    def _stalled(self) -> list[RequestOutput]:
        """Nothing could be scheduled. If requests wait that can never fit, fail them explicitly."""
        s = self.scheduler
        if s.running or s.waiting_for_kv or s.offloaded or not self.cache_manager.holds.empty or not s.waiting:
            return []
        # Nothing runs or holds pages, so the whole pool is free: a head that cannot start never will.
        head = self.scheduler.waiting[0]
        tracked = self._tracked[head.request_id]
        msg = (f"request {head.request_id} needs {self.cache_manager.num_blocks_for(head.num_tokens)} KV blocks "
               f"but only {self.pool.num_free_blocks} exist")
        logger.error(msg)
        return [self._finish(tracked, FinishReason.ERROR, new_ids=(), delta="", error=msg)]

    @property
    def num_soft_resets(self) -> int:
        return self.preemptor.num_soft_resets

    @property
    def num_offloads(self) -> int:
        return self.preemptor.num_offloads

    def info(self) -> EngineInfo:
        return snapshots.engine_info(self)

    def load(self) -> EngineLoad:
        """How busy the engine is now (engine thread; from another thread, a snapshot that may
        straddle one step)."""
        return snapshots.engine_load(self)

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's gauges and counters (call from the engine thread, or accept
        a snapshot that may straddle one step when called from another thread)."""
        return snapshots.engine_metrics(self)

    def check_integrity(self) -> None:
        """The pool balances (empty + used + cached == total; held and quarantined pages count as
        used), every block's reference count matches the tables that hold it (the holds' included),
        the swap pool balances, and only requests running or waiting for KV have tables
        (CacheIntegrityError otherwise)."""
        snapshots.check_engine_integrity(self)
