"""The speculator: the engine's speculative decoder (E20, the SpeculativeDecoder of
pdserve.engine.spec_decode.decoder) over one proposer (pdserve.engine.spec_decode.proposers).

    drafts = speculator.propose(running)          # request id -> proposed tokens (before scheduling)
    sched = scheduler.schedule(drafts)            # each decode chunk may grow by a prefix of its draft
    ...one target pass: logits at the last known position and at every draft position...
    speculator.verify(chunk, rows, append)        # accept, emit the tokens, give back rejected slots

Verification samples the target at each of the chunk's 1 + k positions exactly as plain decoding
samples it there (the same filters; a seeded request's token n draws from its generator reseeded
for n, pdserve.engine.sampling.sampler), and accepts drafts while they equal those samples; the
first sample that differs from its draft (or the sample after the last draft, the bonus) is
emitted too. For a deterministic draft (n-gram; q one-hot) this is speculative rejection sampling
(accept draft d with probability min(1, p(d) / q(d)) = p(d); on rejection draw from
norm(max(0, p - q)) = p without d) realised with the draws plain decoding makes: the emitted
tokens are the target's own samples, so greedy output is unchanged, and so is a seeded request's
(up to the float rounding of a multi-token pass; tests/integration/test_spec_decode.py). Drafts a
draft model sampled (temperature > 0) are verified by rejection sampling against the draft's
distribution (pdserve.engine.spec_decode.rejection).

The adaptive control (pdserve.engine.spec_decode.control) sees every pass's cost and every
verdict, and cuts each sequence's draft to what it expects to pay off. Counters (vLLM's meaning,
EngineMetrics.spec_*): a draft is one verified proposal of one sequence in one step; accepted
tokens exclude the bonus token; per position i, the drafts whose token i was accepted.
docs/speculative-handoff.md walks through all of it.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
import warnings
from collections.abc import Sequence

import torch

from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.cache.swap import SwapSpace
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling.sampler import SampleLogprobs, compute_logprobs, filtered_probs
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.control import SpeculationControl
from pdserve.engine.spec_decode.decoder import (
    AppendToken,
    DecodedRow,
    Handoff,
    SpecCounters,
    SpeculativeDecoder,
    TargetPass,
    TargetRows,
    Verdict,
)
from pdserve.engine.spec_decode.proposers.base import Proposer
from pdserve.engine.spec_decode.rejection import rejection_sample


def draft_room(request: Request, k: int) -> int:
    """How many draft tokens a decoding request can verify this step (<= k): every emitted token
    must fit its max_tokens and the context (a verification emits up to 1 + drafts tokens)."""
    room = request.max_total_tokens - request.num_tokens - 1
    m = request.sampling.max_tokens
    if m is not None:
        room = min(room, m - len(request.output_token_ids) - 1)
    return max(0, min(k, room))


class Speculator(SpeculativeDecoder):
    """config: the speculative config; proposer: what drafts; cache_manager: the target's (the
    verdict commits and truncates the request's pages in it)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, cache_manager: KVCacheManager) -> None:
        self.config = config
        self.proposer = proposer
        self.cache_manager = cache_manager
        k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self.num_handoff_history_rows = 0
        self.control = SpeculationControl() if config.adaptive else None

    # --- before the pass ------------------------------------------------------------------------

    def propose(self, running: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        return self.drafts([r for r in running if not r.prefill_only and r.num_remaining_tokens == 1])

    def drafts(self, decoding: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """Proposals for requests whose next pass is a decode step (1 token left to feed), cut to
        what the control expects to pay off (`SpeculativeConfig.adaptive`)."""
        k = self.config.num_speculative_tokens
        by_id = {r.request_id: r for r in decoding}
        rooms = {r.request_id: n for r in decoding if (n := draft_room(r, k)) > 0}
        if self.proposer.needs_slots or self.proposer.costly:
            # drafting costs a model step per token: the control chooses how many first. A
            # drafting model reserves its slots (placeholders, replaced by `fill`).
            rooms = self._choose(rooms, by_id)
            if self.proposer.needs_slots:
                return {rid: (0,) * n for rid, n in rooms.items()}
            return self._propose(rooms, by_id)
        out = self._propose(rooms, by_id)
        keep = self._choose({rid: len(d) for rid, d in out.items()}, by_id)
        return {rid: out[rid][:n] for rid, n in keep.items()}

    def _choose(self, lengths: dict[str, int], decoding: dict[str, Request]) -> dict[str, int]:
        """The control's cut of each sequence's draft length (all of it with the control off)."""
        if self.control is None:
            return lengths
        self.control.forget(set(decoding))
        return self.control.choose(lengths, len(decoding))

    def _propose(self, rooms: dict[str, int], requests: dict[str, Request]) -> dict[str, tuple[int, ...]]:
        """A token proposer's drafts for each (request id, room), its time given to the control."""
        if not rooms:
            return {}
        began = time.perf_counter()
        proposed = self.proposer.propose_batch([requests[rid] for rid in rooms], list(rooms.values()))
        if self.control is not None:
            self.control.observe_drafting(sum(rooms.values()), time.perf_counter() - began)
        return {rid: d[:n] for (rid, n), d in zip(rooms.items(), proposed, strict=True) if d}

    def fill(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The scheduled pass with real drafts in the chunks whose slots were granted (a
        `needs_slots` proposer runs here, before the target pass); others pass through. A chunk
        whose proposer drafted fewer tokens than its slots shrinks (the slots it leaves are
        freed after the pass like rejected ones); one with none decodes plainly."""
        if not self.proposer.needs_slots:
            return sched
        idx = [i for i, c in enumerate(sched.chunks) if c.draft_token_ids]
        if not idx:
            return sched
        began = time.perf_counter()
        drafts = self.proposer.draft([sched.chunks[i] for i in idx])
        if self.control is not None:
            self.control.observe_drafting(sum(len(sched.chunks[i].draft_token_ids) for i in idx),
                                          time.perf_counter() - began)
        chunks = list(sched.chunks)
        for i, d in zip(idx, drafts, strict=True):
            c = chunks[i]
            n = len(d.token_ids)
            if n > len(c.draft_token_ids):
                raise RuntimeError(f"{type(self.proposer).__name__} drafted {n} tokens for "
                                   f"{c.request_id!r}, {len(c.draft_token_ids)} slots were granted")
            chunks[i] = dataclasses.replace(c, num_tokens=c.num_known + n, draft_token_ids=d.token_ids,
                                            draft_probs=d.probs if n else None)
        chunks.sort(key=lambda c: c.num_tokens != 1)  # decodes first, as the scheduler orders them
        return dataclasses.replace(sched, chunks=tuple(chunks))

    # --- after the pass -------------------------------------------------------------------------

    @property
    def uses_hidden(self) -> bool:
        return self.proposer.uses_hidden

    @property
    def wants_all_hidden(self) -> bool:
        return self.proposer.wants_all_hidden

    def after_pass(self, target: TargetPass) -> None:
        if self.proposer.wants_all_hidden:   # a draft head writes its rows for what the pass computed
            self.proposer.after_pass(target.chunks, target.all_hidden)
        # what the control weighs drafts against: passes of decodes and verifications only (a
        # prefill chunk's tokens cost on another slope: compute-bound, and its attention)
        # (timed to now: drafting, the pass and the head's row writes)
        if self.control is not None and all(c.samples and c.num_known == 1 for c in target.chunks):
            self.control.observe(target.num_batched_tokens, time.perf_counter() - target.began)

    def note(self, request: Request, hidden: torch.Tensor, position: int) -> None:
        """The target's hidden state at `position` ([H], where the request's latest token was sampled)."""
        self.proposer.note(request, hidden, position)

    def seed_history(self, request: Request, hidden: torch.Tensor, position: int) -> None:
        """Handed-over history rows ([n, H], the positions before `position`; Proposer.seed_history)."""
        self.proposer.seed_history(request, hidden, position)

    def decoded(self, row: DecodedRow) -> None:
        if self.proposer.uses_hidden:
            self.proposer.note(row.request, row.hidden, row.position)
        if not row.finished and self.proposer.needs_slots:
            # a drafting model that filled none of its granted slots (`fill` made the chunk a
            # plain decode): give back the lookahead pages, as a verification does
            self.cache_manager.truncate(row.request, row.request.num_tokens)

    def handoff(self, handoff: Handoff) -> None:
        if not self.proposer.uses_hidden:
            return
        history = handoff.history
        if history is not None and history.shape[0] and self.proposer.wants_all_hidden:
            self.proposer.seed_history(handoff.request, history, handoff.position)
            self.num_handoff_history_rows += history.shape[0]
        self.proposer.note(handoff.request, handoff.hidden, handoff.position)

    # --- verification ---------------------------------------------------------------------------

    def verify(self, chunk: ScheduledChunk, rows: TargetRows, append: AppendToken) -> RequestOutput:
        if chunk.draft_probs is None:
            verdict = self.verify_equal(chunk.request_id, chunk.draft_token_ids, rows.sampled)
            return self._emit(chunk, verdict, rows.logprobs, rows, append)
        # drafts the draft model sampled: speculative rejection sampling of the target's filtered
        # distributions at the chunk's rows against the draft's
        params = [chunk.request.sampling] * chunk.num_sample_rows
        target = filtered_probs(rows.logits, params)                          # [K+1, V]
        verdict = self.verify_sampled(chunk.request_id, chunk.draft_token_ids, target, chunk.draft_probs,
                                      rows.generators)
        n = len(verdict.token_ids)
        lps = compute_logprobs(rows.logits[:n], params[:n], verdict.token_ids)
        return self._emit(chunk, verdict, lps, rows, append)

    def verify_equal(self, request_id: str, draft: tuple[int, ...], sampled: Sequence[int]) -> Verdict:
        """Accept the drafts that equal the target's samples at their positions (len(sampled) =
        1 + len(draft)); record the counters."""
        if len(sampled) != len(draft) + 1:
            raise ValueError(f"verification of {len(draft)} drafts needs {len(draft) + 1} samples, got {len(sampled)}")
        a = 0
        while a < len(draft) and draft[a] == sampled[a]:
            a += 1
        return self.record(request_id, draft, Verdict(token_ids=tuple(sampled[: a + 1]), num_accepted=a))

    def verify_sampled(self, request_id: str, draft: tuple[int, ...], target_probs: torch.Tensor,
                       draft_probs: torch.Tensor, generators: Sequence[torch.Generator]) -> Verdict:
        """Speculative rejection sampling of drafts the draft model sampled (target_probs:
        [K+1, V] filtered as the sampler filters; draft_probs: [K, V]); record the counters."""
        out = rejection_sample(target_probs, draft, draft_probs, generators)
        return self.record(request_id, draft, Verdict(token_ids=out.token_ids, num_accepted=out.num_accepted))

    def record(self, request_id: str, draft: tuple[int, ...], verdict: Verdict) -> Verdict:
        a = verdict.num_accepted
        if draft:
            self.num_drafts += 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += a
            for i in range(a):
                self.accepted_per_pos[i] += 1
            if self.control is not None:
                self.control.verified(request_id, len(draft), a)
        return verdict

    def _emit(self, c: ScheduledChunk, verdict: Verdict, logprobs: Sequence[SampleLogprobs | None],
              rows: TargetRows, append: AppendToken) -> RequestOutput:
        """Emit the verdict's tokens, stopping where the request ends; then give back the pages
        past what it keeps and note the state its latest token was sampled from."""
        r = c.request
        # KV of the known token is valid whatever the verdict: commit up to it first
        r.num_computed_tokens = c.start + c.num_known
        self.cache_manager.commit(r)
        out: RequestOutput | None = None
        new_ids: list[int] = []
        new_lps: list[SampleLogprobs] = []
        delta = ""
        for i, token in enumerate(verdict.token_ids):
            out = append(token, logprobs[i])
            new_ids.extend(out.new_token_ids)
            new_lps.extend(out.new_logprobs)
            delta += out.delta_text
            if out.finished:
                break
        assert out is not None
        if not out.finished:
            # KV is valid through the accepted drafts; the rejected ones' slots are reused
            r.num_computed_tokens = c.start + c.num_known + verdict.num_accepted
            self.cache_manager.commit(r)
            self.cache_manager.truncate(r, r.num_tokens)
            if self.proposer.uses_hidden:   # the row its latest token was sampled from
                self.proposer.note(r, rows.hidden[verdict.num_accepted], r.num_computed_tokens - 1)
        return dataclasses.replace(out, new_token_ids=tuple(new_ids), delta_text=delta, new_logprobs=tuple(new_lps))

    # --- the rest of the interface --------------------------------------------------------------

    def counters(self) -> SpecCounters:
        return SpecCounters(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                            num_accepted_tokens=self.num_accepted_tokens,
                            accepted_per_pos=tuple(self.accepted_per_pos),
                            handoff_history_rows=self.num_handoff_history_rows)

    def share_swap(self, swap: SwapSpace) -> None:
        own = self.proposer.own_pool()
        if own is not None:
            swap.attach(own)   # a draft model's pages are offloaded and restored with the target's
            self.proposer.carry_offloads()


# Deprecated names of this module (issue 30 split it): each moved to the module named here and
# is re-exported lazily (a DeprecationWarning says where), until callers have moved.
_MOVED = {
    "Drafted": "pdserve.engine.spec_decode.proposers.base",
    "Proposer": "pdserve.engine.spec_decode.proposers.base",
    "TokenProposer": "pdserve.engine.spec_decode.proposers.base",
    "SlotProposer": "pdserve.engine.spec_decode.proposers.base",
    "NgramDrafts": "pdserve.engine.spec_decode.proposers.ngram",
    "EagleDrafts": "pdserve.engine.spec_decode.proposers.eagle",
    "EAGLE_IDLE_ROWS": "pdserve.engine.spec_decode.proposers.eagle",
    "SelfDraft": "pdserve.engine.spec_decode.proposers.self_draft",
    "DraftModel": "pdserve.engine.spec_decode.proposers.draft_model",
    "DraftPicker": "pdserve.engine.spec_decode.proposers.drafting",
    "make_speculator": "pdserve.engine.spec_decode.loader",
}


def __getattr__(name: str) -> object:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to {where}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)
