"""The draft-head proposer (`{"method": "eagle"}`): drafts from the target's hidden states with an
EAGLE-style head (pdserve.model.eagle_head) over a paged history of the head's own K/V.

How the head's history is written, and how a decode node's head starts from the rows a prefill
node hands over (D17/D19): docs/speculative-handoff.md.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler.output import ScheduledChunk
from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS
from pdserve.engine.spec_decode.proposers.base import TokenProposer
from pdserve.model.eagle_head import EagleHead

logger = logging.getLogger(__name__)


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
    """A draft head (`{"method": "eagle", "model": DIR}`; pdserve.model.eagle_head) drafts
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

    def __init__(self, head: EagleHead, runner: ModelRunner) -> None:
        self.head = head
        self._hidden: dict[str, tuple[Request, int, torch.Tensor]] = {}   # rid -> (request, position, h)
        self._history: dict[str, _HeadHistory] = {}
        self._offloads_carried = False
        s, c = runner.kv.shape, head.config
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
