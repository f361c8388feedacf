"""What the engine calls for speculative decoding (E20): drafts before a pass, verdicts after it.

    drafts = speculator.drafts(decoding)            # request id -> proposed tokens (before scheduling)
    sched = scheduler.schedule(drafts)              # each decode chunk may grow by a prefix of its draft
    ...one target pass: logits at the last known position and at every draft position...
    verdict = speculator.verify(chunk, sampled)     # the tokens to emit, the number accepted

Verification samples the target at each of the chunk's 1 + k positions exactly as plain decoding
samples it there (the same filters; a seeded request's token n draws from its generator reseeded
for n, pdserve.engine.sampling.sampler), and accepts drafts while they equal those samples; the
first sample that differs from its draft (or the sample after the last draft, the bonus) is
emitted too. For a deterministic draft (n-gram; q one-hot) this is speculative rejection sampling
(accept draft d with probability min(1, p(d) / q(d)) = p(d); on rejection draw from
norm(max(0, p - q)) = p without d) realised with the draws plain decoding makes: the emitted
tokens are the target's own samples, so greedy output is unchanged, and so is a seeded request's
(up to the float rounding of a multi-token pass; tests/integration/test_spec_decode.py).

Counters (vLLM's meaning, EngineMetrics.spec_*): a draft is one verified proposal of one sequence
in one step; accepted tokens exclude the bonus token; per position i, the drafts whose token i
was accepted.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from pdserve.engine.cache.kv_cache import PagedKVCache
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling.sampler import GREEDY_EPS, filtered_probs, token_seed
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS, SpeculativeConfig
from pdserve.engine.spec_decode.control import SpeculationControl
from pdserve.engine.spec_decode.rejection import rejection_sample
from pdserve.kernels.ops.norm_act import argmax_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What one verified chunk emits: `token_ids` = accepted drafts + the target's next token."""

    token_ids: tuple[int, ...]
    num_accepted: int


def draft_room(request: Request, k: int) -> int:
    """How many draft tokens a decoding request can verify this step (<= k): every emitted token
    must fit its max_tokens and the context (a verification emits up to 1 + drafts tokens)."""
    room = request.max_total_tokens - request.num_tokens - 1
    m = request.sampling.max_tokens
    if m is not None:
        room = min(room, m - len(request.output_token_ids) - 1)
    return max(0, min(k, room))


class Proposer(abc.ABC):
    """Drafts tokens for sequences that decode. Two kinds: a TokenProposer drafts before
    scheduling, from what it knows of each sequence; a SlotProposer (`needs_slots`) drafts after
    it, because a draft model writes its KV into the slots the scheduler granted."""

    needs_slots: ClassVar[bool]
    uses_hidden: ClassVar[bool] = False   # wants the target's hidden state of each sampled position (`note`)
    wants_all_hidden: ClassVar[bool] = False  # wants every computed position's (`after_pass`)
    # drafting costs per token (a model step), so the control chooses how many before drafting
    costly: ClassVar[bool] = False

    def note(self, request: Request, hidden: torch.Tensor, position: int) -> None:  # noqa: B027
        """The target's final-norm hidden state at `position` of `request` ([hidden]), the one its
        latest token was sampled from; kept by proposers that draft from it, ignored by others."""

    def after_pass(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:  # noqa: B027
        """After a target pass over `chunks` (before its verdicts): the final-norm hidden state of
        every token it fed ([T, hidden], the chunks' tokens in order); for `wants_all_hidden`."""

    def seed_history(self, request: Request, hidden: torch.Tensor, position: int) -> None:  # noqa: B027
        """A decode node's handed-over history: the target's hidden states of the positions
        position - n .. position - 1 ([n, hidden], before the one `note` gets); for `wants_all_hidden`."""

    def own_pool(self) -> PagedKVCache | None:
        """A KV pool of the proposer's own indexed by the target's block ids (a draft model's), for
        the engine's swap pool to move with the target's (`carry_offloads`); None: it has none."""
        return None

    def carry_offloads(self) -> None:  # noqa: B027
        """The swap pool now moves `own_pool()` with the target's pages: an offload and restore
        keeps the proposer's KV valid."""


class TokenProposer(Proposer):
    needs_slots = False

    @abc.abstractmethod
    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[tuple[int, ...]]:
        """At most ks[i] tokens to follow requests[i]'s tokens; () for none."""


class SlotProposer(Proposer):
    needs_slots = True

    @abc.abstractmethod
    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[Drafted]:
        """At most len(c.draft_token_ids) tokens for each granted chunk (its drafts are placeholders)."""


# A sequence the control stopped drafting for keeps its head history this many plain decode steps
# (a draft cut by the step's token budget, a probe's wait), then stops writing rows (EagleDrafts).
EAGLE_IDLE_ROWS = 8


@dataclass
class _HeadHistory:
    """Which head rows of one request its pool holds: rows [start, end), row j being the head's
    K/V for (x_j, the target's h_{j-1}) at position j."""

    request: Request
    start: int
    end: int
    epoch: tuple[int, int]     # (num_preemptions, num_offloads or 0) when written: a change moved the pages
    plain: int = 0             # plain decode steps since the request last verified drafts


class EagleDrafts(TokenProposer):
    """A draft head (`{"method": "eagle", "model": DIR}`; pdserve.engine.spec_decode.eagle) drafts
    from the target's hidden state at the position before the token the next pass feeds: the
    one noted after the last sampled position (or, on a decode node, the prefill node's context
    record, D17), and that token. Drafts are the head's argmax (q one-hot: exact verification by
    equality). A request with no hidden state for its position (after a soft reset, before its
    first sample) drafts nothing that step.

    The head's own KV: a one-layer pool with the target's page count and page size, indexed by the
    target's block ids (as a separate draft model's, DraftModel), so the target's allocation,
    freeing, truncation and preemption are the head's too. After every pass (`after_pass`) the
    head writes its row for each position the pass computed in a prefill chunk or a
    verification, teacher-forced from the target's hidden states there (EagleHead.history_kv; one
    batched product, no attention); a draft then attends over the request's last
    EAGLE_HISTORY_ROWS rows before its own draft rows. Plain decode steps (the control drafted
    nothing for the sequence) write rows for EAGLE_IDLE_ROWS steps, then none, so the history
    restarts where drafting does: at batch 16, where the control cuts the head's drafts on prose,
    writing every step's rows cost 3.6% of the pass (1.65 of 46 ms on a 2-core EPYC). Rows a
    later verdict rejects are overwritten by the next pass, never read (the history is cut to
    the request's num_computed_tokens). Where no target hidden state exists for a position the
    history starts after it: the first prompt token, a prefix-cache hit (those blocks' head rows
    are not trusted: another request, or a KV transfer, may have filled them), the prompt of a
    decode node's remote prefill before the rows its context record hands over (`seed_history`,
    EngineConfig.context_history_rows; none by default), a preemption's recompute, an offload
    unless the swap pool carries the head's pool (`carry_offloads`)."""

    uses_hidden = True
    wants_all_hidden = True
    costly = True

    def __init__(self, head: object, runner: ModelRunner) -> None:
        from pdserve.engine.cache.kv_cache import KVCacheShape

        self.head = head
        self._hidden: dict[str, tuple[Request, int, torch.Tensor]] = {}   # rid -> (request, position, h)
        self._history: dict[str, _HeadHistory] = {}
        self._offloads_carried = False
        s, c = runner.kv.shape, head.config  # type: ignore[attr-defined]
        # pool: [1, 2, pages, head kv heads, page_size, head_dim], the head's dtype
        self.pool = PagedKVCache(KVCacheShape(1, s.num_pages, c.num_kv_heads, s.page_size, c.head_dim), c.torch_dtype)
        self._cache_manager = runner.cache_manager
        self._page_size = s.page_size
        logger.info("eagle head KV: a pool of %d pages (%.1f MiB) indexed by the target's block ids",
                    s.num_pages, self.pool.nbytes / 2**20)

    def own_pool(self) -> PagedKVCache | None:
        return self.pool

    def carry_offloads(self) -> None:
        self._offloads_carried = True

    def note(self, request: Request, hidden: torch.Tensor, position: int) -> None:
        self._hidden[request.request_id] = (request, position, hidden.detach().float().clone())

    def _epoch(self, r: Request) -> tuple[int, int]:
        return (r.num_preemptions, 0 if self._offloads_carried else r.num_offloads)

    def _history_of(self, r: Request) -> _HeadHistory | None:
        """r's history record if its rows are still where they were written (same request, same epoch)."""
        h = self._history.get(r.request_id)
        return h if h is not None and h.request is r and h.epoch == self._epoch(r) else None

    def _put(self, pages: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows k, v ([N, Hkv, D]) at positions [N] of pages [N] (pool: [pages, Hkv, page_size, D])."""
        offs = positions % self._page_size
        self.pool.k[0][pages, :, offs] = k.to(self.pool.dtype)
        self.pool.v[0][pages, :, offs] = v.to(self.pool.dtype)

    def after_pass(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Write the head's rows for the positions a target pass computed. hidden: [T, H] the
        pass's final-norm hidden states, row order = the chunks' tokens in order (drafts included)."""
        toks: list[int] = []
        pos: list[int] = []
        pages: list[int] = []
        src: list[int] = []                     # row of `hidden` (or -1 - i: prev[i]) for each history row
        prev: list[torch.Tensor] = []
        P = self._page_size
        q = 0
        for c in chunks:
            r = c.request
            base, q = q, q + c.num_tokens
            rid = r.request_id
            h = self._history_of(r)
            if h is None:
                h = self._history[rid] = _HeadHistory(r, c.start, c.start, self._epoch(r))
            if c.samples and c.num_known == 1 and not c.draft_token_ids:   # a plain decode step
                h.plain += 1
                if h.plain > EAGLE_IDLE_ROWS:
                    continue                    # not drafting for a while: no rows (class docstring)
            else:
                h.plain = 0
            h.end = min(h.end, c.start)         # rows from c.start on are written now
            e = self._hidden.get(rid)
            first = c.start
            if e is not None and e[0] is r and e[1] == c.start - 1:
                prev.append(e[2])
                src.append(-len(prev))
            else:
                first += 1                      # no target state before c.start: no row there
            if h.end != c.start or first != c.start:
                h.start = first                 # a gap: the history restarts here
            ids = list(r.token_slice(c.start, c.start + c.num_known)) + list(c.draft_token_ids)  # x_j, j in chunk
            table = self._cache_manager.block_table(rid)
            for j in range(first, c.end):
                toks.append(ids[j - c.start])
                pos.append(j)
                pages.append(table[j // P])
                if j > c.start:
                    src.append(base + j - 1 - c.start)
            h.end = max(c.end, h.start)
            self._hidden[rid] = (r, c.end - 1, hidden[base + c.num_tokens - 1].detach().float().clone())
        if not toks:
            return
        idx = torch.tensor(src, dtype=torch.long)                                  # [N]
        rows = hidden.index_select(0, idx.clamp(min=0))                             # [N, H]
        if prev:
            own = idx < 0
            rows[own] = torch.stack(prev).to(rows.dtype)[(-1 - idx[own])]
        pos_t = torch.tensor(pos, dtype=torch.long)                                 # [N]
        k, v = self.head.history_kv(torch.tensor(toks), rows, pos_t)               # [N, Hkv, D] each
        self._put(torch.tensor(pages, dtype=torch.long), pos_t, k, v)

    def seed_history(self, request: Request, hidden: torch.Tensor, position: int) -> None:
        """The prompt's last rows on a decode node (kv_messenger.context history): the head's rows
        for positions position - n + 1 .. position, from the target's states at position - n ..
        position - 1 (`hidden`, [n, H]) and the prompt's tokens there."""
        n = hidden.shape[0]
        if n == 0:
            return
        if n > position:
            raise ValueError(f"{request!r}: {n} history rows before position {position}")
        P = self._page_size
        pos = torch.arange(position - n + 1, position + 1)                          # [n]
        toks = torch.tensor(request.token_slice(position - n + 1, position + 1))    # [n] x_j
        k, v = self.head.history_kv(toks, hidden.float(), pos)                       # [n, Hkv, D] each
        table = torch.tensor(self._cache_manager.block_table(request.request_id), dtype=torch.long)
        self._put(table[pos // P], pos, k, v)
        self._history[request.request_id] = _HeadHistory(request, position - n + 1, position + 1, self._epoch(request))

    def _past(self, requests: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The history K/V each request drafts over: (k, v [B, Hkv, L, D], valid [B, L]), None if none has any."""
        P = self._page_size
        spans: list[range] = []
        for r in requests:
            h = self._history_of(r)
            nc = r.num_computed_tokens
            if h is None or min(h.end, nc) != nc:
                spans.append(range(0))
                continue
            spans.append(range(max(h.start, nc - EAGLE_HISTORY_ROWS), nc))
        L = max(len(s) for s in spans)
        if L == 0:
            return None
        pages = torch.zeros(len(requests), L, dtype=torch.long)                    # [B, L]
        offs = torch.zeros(len(requests), L, dtype=torch.long)
        valid = torch.zeros(len(requests), L, dtype=torch.bool)
        for b, (r, span) in enumerate(zip(requests, spans, strict=True)):
            if not span:
                continue
            table = self._cache_manager.block_table(r.request_id)
            p = torch.tensor(span, dtype=torch.long)
            n = len(span)
            pages[b, :n] = torch.tensor(table, dtype=torch.long)[p // P]
            offs[b, :n] = p % P
            valid[b, :n] = True
        k = self.pool.k[0][pages, :, offs].transpose(1, 2)                         # [B, Hkv, L, D]
        v = self.pool.v[0][pages, :, offs].transpose(1, 2)
        return k, v, valid

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[tuple[int, ...]]:
        self._hidden = {rid: e for rid, e in self._hidden.items() if not e[0].finished}
        self._history = {rid: h for rid, h in self._history.items() if not h.request.finished}
        out: list[tuple[int, ...]] = [() for _ in requests]
        use = []
        for i, r in enumerate(requests):
            e = self._hidden.get(r.request_id)
            if e is not None and e[0] is r and e[1] == r.num_computed_tokens - 1 and ks[i] > 0:
                use.append(i)
        if not use:
            return out
        h = torch.stack([self._hidden[requests[i].request_id][2] for i in use])             # [B, H]
        nc = [requests[i].num_computed_tokens for i in use]
        nxt = torch.tensor([requests[i].token_slice(n, n + 1)[0] for i, n in zip(use, nc, strict=True)])  # [B]
        past = self._past([requests[i] for i in use])
        drafts = self.head.draft_batch(h, nxt, max(ks[i] for i in use), torch.tensor(nc), past).tolist()  # [B, K]
        for j, i in enumerate(use):
            out[i] = tuple(drafts[j][: ks[i]])
        return out


class NgramDrafts(TokenProposer):
    """Prompt lookup over the request's prompt and output so far (pdserve.engine.spec_decode.ngram)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        from pdserve.engine.spec_decode.ngram import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self._ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(self._ngram.propose(r.prompt_token_ids + r.output_token_ids, k))
                for r, k in zip(requests, ks, strict=True)]


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self.control = SpeculationControl() if config.adaptive else None

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

    @property
    def uses_hidden(self) -> bool:
        return self.proposer.uses_hidden

    def note(self, request: Request, hidden: torch.Tensor, position: int) -> None:
        """The target's hidden state at `position` (where the request's latest token was sampled)."""
        self.proposer.note(request, hidden, position)

    @property
    def wants_all_hidden(self) -> bool:
        return self.proposer.wants_all_hidden

    def after_pass(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        self.proposer.after_pass(chunks, hidden)

    def seed_history(self, request: Request, hidden: torch.Tensor, position: int) -> None:
        self.proposer.seed_history(request, hidden, position)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A pass of `num_tokens` query tokens took `seconds`, drafting included (the control's cost fit)."""
        if self.control is not None:
            self.control.observe(num_tokens, seconds)

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

    def verify(self, request_id: str, draft: tuple[int, ...], sampled: Sequence[int]) -> Verdict:
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


_DRAFT_SEED_SALT = 0x5D5A_17E9_D12A_F7B3   # a seeded request's draft draws: a stream apart from its own


@dataclass(frozen=True)
class Drafted:
    """One sequence's drafts: tokens, and the draft's distribution of each when it was sampled
    ([len(token_ids), V]; None when every token was the draft's argmax: a greedy request)."""

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None


class DraftPicker:
    """How a draft model picks each draft token: the argmax for a greedy request (q one-hot:
    verified by equality); for a sampled one, a draw from the draft's distribution under the
    request's own filters (temperature, top-k, top-p, min-p), verified by rejection sampling
    against the target's (pdserve.engine.spec_decode.rejection), which keeps the target's
    distribution whatever the draft's. A seeded request's draw for its output token n comes
    from a generator seeded by (seed, n) in a stream of its own, so it is reproducible."""

    def __init__(self) -> None:
        self._gen = torch.Generator().manual_seed(0x5EED)

    def pick(self, logits: torch.Tensor, requests: Sequence[Request], offsets: Sequence[int]
             ) -> tuple[list[int], list[torch.Tensor | None]]:
        """logits: [A, V] the draft's, row a for requests[a]'s draft token number offsets[a]."""
        tokens = argmax_rows(logits).tolist()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        for a, r in enumerate(requests):
            params = r.sampling
            if params.temperature < GREEDY_EPS:
                continue
            q = filtered_probs(logits[a:a + 1], [params])[0]                          # [V]
            if params.seed is None:
                gen = self._gen
            else:
                index = params.rng_skip_tokens + len(r.output_token_ids) + offsets[a]
                gen = torch.Generator().manual_seed(token_seed(params.seed ^ _DRAFT_SEED_SALT, index))
            noise = torch.empty_like(q).exponential_(generator=gen).clamp_(min=torch.finfo(q.dtype).tiny)
            tokens[a] = int((q / noise).argmax())
            probs[a] = q
        return tokens, probs


def _draft_tokens(runner: ModelRunner, chunks: Sequence[ScheduledChunk], first: torch.Tensor,
                  want: Sequence[int], picker: DraftPicker, num_layers: int | None = None) -> list[Drafted]:
    """chunks[i] gets want[i] draft tokens: the first picked from first[i] ([N, V]: the draft's
    logits after the chunk's last known token), each next one from a single-token pass of the
    draft over the one before it (all sequences batched, one pass per draft position)."""
    toks: list[list[int]] = [[] for _ in chunks]
    qs: list[list[torch.Tensor | None]] = [[] for _ in chunks]
    active = [i for i in range(len(chunks)) if want[i] > 0]
    logits = first[torch.tensor(active, dtype=torch.long)] if len(active) != len(chunks) else first  # [A, V]
    pos = {i: chunks[i].start + chunks[i].num_known for i in active}     # where each next token goes
    while active:
        picked, probs = picker.pick(logits, [chunks[i].request for i in active], [len(toks[i]) for i in active])
        for j, i in enumerate(active):
            toks[i].append(picked[j])
            qs[i].append(probs[j])
        active = [i for i in active if len(toks[i]) < want[i]]
        if not active:
            break
        step = [ScheduledChunk(request=chunks[i].request, start=pos[i], num_tokens=1, samples=False,
                               draft_token_ids=(toks[i][-1],)) for i in active]
        for i in active:
            pos[i] += 1
        logits = runner.forward_chunks(step, range(len(step)), num_layers)                  # [A, V]
    out = []
    for t, q in zip(toks, qs, strict=True):
        sampled = [x for x in q if x is not None]
        out.append(Drafted(tuple(t), torch.stack(sampled) if sampled and len(sampled) == len(q) else None))
    return out


class SelfDraft(SlotProposer):
    """The target's first k decoder layers, its final norm and lm_head as the draft model
    (`{"method": "draft_model", "self_draft_layers": k}`): K greedy single-token passes over the
    granted chunks (one pass per draft position, all sequences batched).

    Its KV is the target's own for layers < k: for every accepted token the target computed those
    layers' K/V from the same inputs, so the draft needs no pool of its own and is kept in step
    with the target's (allocated, freed, preempted, offloaded together) by construction. Its
    passes write layers < k at the positions it drafts (the last known token and the drafts but
    the last), which lie in the lookahead slots the scheduler granted; the verification pass then
    writes every layer there, and rejected slots are truncated or overwritten, never read as
    computed. Drafts are the draft's argmax (q one-hot), so verification by equality is exact
    for greedy and sampled requests alike (module docstring). Under tensor parallelism every rank
    runs its shard of those k layers (the runner's StepMessage carries num_layers)."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        layers = runner.model.arch.num_layers
        k = config.self_draft_layers
        assert k is not None
        if not 1 <= k <= layers:
            raise ValueError(f"speculative config: self_draft_layers={k} but the model has {layers} layers")
        if not hasattr(runner.model, "_run_layers") or len(runner.batch_keys) != 1:
            raise ValueError(f"speculative config: a self-draft runs Llama-family models with one attention "
                             f"group, not {runner.model.arch.family!r} with {len(runner.batch_keys)}")
        self.num_layers = k
        self.runner = runner
        self.picker = DraftPicker()

    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[Drafted]:
        # pass 1 feeds each sequence's last known token at its position (the target will
        # recompute it in the verification pass; the draft's layers get the same K/V)
        first = [ScheduledChunk(request=c.request, start=c.start, num_tokens=1, samples=False,
                                draft_token_ids=tuple(c.request.token_slice(c.start, c.start + 1))) for c in chunks]
        logits = self.runner.forward_chunks(first, range(len(first)), self.num_layers)      # [N, V]
        return _draft_tokens(self.runner, chunks, logits, [len(c.draft_token_ids) for c in chunks],
                             self.picker, self.num_layers)


@dataclass
class _DraftProgress:
    """How far a separate draft model's KV of one request is valid."""

    request: Request
    computed: int              # positions [0, computed) hold the draft's K/V of the request's tokens
    epoch: tuple[int, int]     # (num_preemptions, num_offloads or 0) when it was valid: a change moved the pages


class DraftModel(SlotProposer):
    """A separate, smaller checkpoint that shares the target's tokenizer drafts K greedy tokens
    (`{"method": "draft_model", "model": PATH}`).

    Its own KV pool has the target's page count and page size and is indexed by the target's
    block ids: a request's draft K/V lives in the same block numbers as its target K/V, so the
    target's allocation, freeing, preemption and truncation are the draft's too, and no second
    allocator can disagree with the first. What the draft's pages hold is tracked per request
    (`_DraftProgress.computed`): before drafting, a request catches up on the tokens its draft has
    not run (the whole prompt the first time, e.g. after a remote prefill on a decode node; the
    accepted tokens after each step), at most `catch_up_tokens` per step over all requests (a
    request still behind drafts nothing that step). A soft reset restarts the count at 0, and so
    does an offload and restore unless the engine's swap pool carries the draft's pool with the
    target's (`carry_offloads`: the engine attaches it whenever it has a swap pool, so the draft's
    pages come back into the request's new blocks and nothing is recomputed); a prefix-cache hit
    reads blocks whose draft K/V another request wrote from the same tokens, and is recomputed
    anyway (the count starts at 0), so a stale page is never trusted. Drafts are the draft's argmax
    (q one-hot: exact verification by equality, module docstring). Under tensor parallelism the
    draft runs on the leader alone, unsharded (its pool is the leader's)."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, draft_runner: ModelRunner,
                 catch_up_tokens: int) -> None:
        self.config = config
        self.target = runner
        self.runner = draft_runner
        self.catch_up_tokens = catch_up_tokens
        self.picker = DraftPicker()
        self._progress: dict[str, _DraftProgress] = {}
        self._offloads_carried = False
        self.num_restarts = 0          # requests whose draft KV was given up (their pages moved) and recomputed

    def own_pool(self) -> PagedKVCache:
        return self.runner.kv

    def carry_offloads(self) -> None:
        self._offloads_carried = True

    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[Drafted]:
        self._progress = {rid: p for rid, p in self._progress.items() if not p.request.finished}
        budget = self.catch_up_tokens
        catch: list[ScheduledChunk] = []     # the draft's pass 1: what each sequence has not run yet
        ready: list[int] = []                # chunks whose draft reaches their last known token
        which: list[int] = []                # the catch-up chunk of each ready one
        for i, c in enumerate(chunks):
            r = c.request
            epoch = (r.num_preemptions, 0 if self._offloads_carried else r.num_offloads)
            p = self._progress.get(r.request_id)
            if p is None or p.epoch != epoch or p.request is not r:
                if p is not None and p.computed > 0:
                    self.num_restarts += 1
                p = self._progress[r.request_id] = _DraftProgress(r, 0, epoch)
            p.computed = min(p.computed, r.num_computed_tokens)
            end = c.start + c.num_known                   # through the last known token
            n = min(end - p.computed, budget)
            if n < 1:
                continue
            catch.append(ScheduledChunk(request=r, start=p.computed, num_tokens=n, samples=False))
            budget -= n
            p.computed += n
            if p.computed == end:
                ready.append(i)
                which.append(len(catch) - 1)
        out = [Drafted(()) for _ in chunks]
        if not catch:
            return out
        logits = self.runner.forward_chunks(catch, which)                          # [len(ready), V]
        if ready:
            picked = [chunks[i] for i in ready]
            drafted = _draft_tokens(self.runner, picked, logits, [len(c.draft_token_ids) for c in picked],
                                    self.picker)
            for i, d in zip(ready, drafted, strict=True):
                out[i] = d
                # the draft ran the known tokens and every draft but the last: those that are accepted
                # stay valid (the count is cut to num_computed_tokens before the next use)
                self._progress[chunks[i].request_id].computed += len(d.token_ids) - 1
        return out


def _load_draft(config: SpeculativeConfig, runner: ModelRunner, tokenizer, max_model_len: int,
                dtype: torch.dtype, small_batch_max_tokens: int) -> ModelRunner:
    """The draft checkpoint with its KV pool (the target's page count and page size), or
    ValueError naming what differs from the target."""
    from pdserve.engine.cache.kv_cache import KVCacheShape
    from pdserve.model.arch import ModelArch
    from pdserve.model.loader import iter_weights, load_config, load_tokenizer, resolve_model
    from pdserve.model.registry import build_model

    source = resolve_model(config.model)
    hf_config = load_config(source)
    arch = ModelArch.from_hf_config(hf_config)
    target = runner.model.arch
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"speculative config: draft model {config.model!r} has a vocabulary of {arch.vocab_size} "
                         f"tokens, the target {target.vocab_size}; a draft must share the target's tokenizer")
    theirs = load_tokenizer(source).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise ValueError(f"speculative config: draft model {config.model!r} has a different tokenizer than the "
                         f"target ({len(theirs)} vs {len(ours)} tokens; e.g. {differ}); a draft must share it")
    if any(t != target.layer_types[0] for t in arch.layer_types) or arch.sliding_window is not None:
        raise ValueError(f"speculative config: draft model {config.model!r} has sliding-window layers; a draft "
                         f"model must use full attention only")
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative config: draft model {config.model!r} takes {arch.max_position_embeddings} "
                         f"positions, the target serves max_model_len {max_model_len}")
    model = build_model(arch, hf_config, dtype, max_model_len, small_batch_max_tokens=small_batch_max_tokens)
    model.load_weights(iter_weights(source))
    model.eval()
    s = runner.kv.shape
    kv = PagedKVCache(KVCacheShape(arch.num_layers, s.num_pages, arch.num_kv_heads, s.page_size, arch.head_dim),
                      runner.kv.dtype)
    logger.info("draft model %s: %d layers, KV pool of %d pages (%.2f GiB) indexed by the target's block ids",
                source.name, arch.num_layers, s.num_pages, kv.buffer.numel() * kv.buffer.element_size() / 2**30)
    return ModelRunner(model, kv, runner.cache_manager, runner.backend, padding_block=runner.padding_block)


def make_speculator(config: SpeculativeConfig | None, runner: ModelRunner, tokenizer=None, max_model_len: int = 0,
                    dtype: torch.dtype = torch.float32, small_batch_max_tokens: int = 0,
                    catch_up_tokens: int = 512, target_path: str | None = None) -> Speculator | None:
    """The engine's speculator (None: off); ValueError naming what does not fit the model.
    A separate draft model (config.model) is loaded here: `tokenizer` (the target's, to compare),
    `max_model_len`, `dtype` and `small_batch_max_tokens` are the engine's; `catch_up_tokens`
    bounds the draft's catch-up per step (the engine passes max_batch_tokens)."""
    if config is None:
        return None
    if config.method == "ngram":
        return Speculator(config, NgramDrafts(config))
    if config.method == "eagle":
        from pdserve.engine.spec_decode.eagle import EagleHead, load_target_vocab, shipped_head_for

        if target_path is None:
            raise ValueError("speculative config: an eagle head needs the target checkpoint's path to check it")
        vocab = load_target_vocab(target_path)
        path = config.model if config.model is not None else shipped_head_for(vocab.identity)
        head = EagleHead.load(path, vocab)
        head.eval()
        logger.info("eagle draft head %s: %d parameters", path, head.num_parameters())
        return Speculator(config, EagleDrafts(head, runner))
    if config.self_draft_layers is not None:
        return Speculator(config, SelfDraft(config, runner))
    if tokenizer is None:
        raise ValueError("speculative config: a draft model needs the target's tokenizer to compare with")
    draft_runner = _load_draft(config, runner, tokenizer, max_model_len, dtype, small_batch_max_tokens)
    return Speculator(config, DraftModel(config, runner, draft_runner, catch_up_tokens))
