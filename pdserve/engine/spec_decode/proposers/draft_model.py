"""The draft-model proposer (`{"method": "draft_model", "model": PATH}`): a separate, smaller
checkpoint with its own KV pool indexed by the target's block ids (loaded by
pdserve.engine.spec_decode.loader).

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.cache.kv_cache import PagedKVCache
from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler.output import ScheduledChunk
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.proposers.base import Drafted, SlotProposer
from pdserve.engine.spec_decode.proposers.drafting import DraftPicker, draft_tokens


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
    (q one-hot: exact verification by equality, pdserve.engine.spec_decode.speculator). Under tensor parallelism the
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
            drafted = draft_tokens(self.runner, picked, logits, [len(c.draft_token_ids) for c in picked],
                                    self.picker)
            for i, d in zip(ready, drafted, strict=True):
                out[i] = d
                # the draft ran the known tokens and every draft but the last: those that are accepted
                # stay valid (the count is cut to num_computed_tokens before the next use)
                self._progress[chunks[i].request_id].computed += len(d.token_ids) - 1
        return out
