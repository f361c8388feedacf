"""Speculative lookahead (E20) in the scheduler and the cache: exact slots, blocks and rollback.

A decoding sequence with a K-token draft is scheduled as a verification chunk of 1 + K tokens:
the K lookahead slots come out of `max_batch_tokens` and the pool, only from what the step has
left once decodes, running prefills and admissions are scheduled (Scheduler._grant_lookahead); a
draft that does not fit is cut or dropped and the sequence decodes plainly; lookahead never
stalls or preempts a request. After the pass, the engine keeps the KV of the accepted drafts and
gives back the pages past what the request keeps (Speculator._emit -> KVCacheManager.truncate).

Every case uses pages of 4 tokens and a pool whose first block (0) is padding, so a fresh pool
hands out blocks 1, 2, 3, ... in order, and the books must balance after every step
(empty + used + cached == usable). No model is loaded: the engine's own `_update` (with its
speculator's `verify` and `_emit`) runs on a stand-in engine over a made-up pass output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.runner import ModelOutput
from pdserve.engine.sampling.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import FifoScheduler, PrefillFirstScheduler, make_scheduler
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.proposers.base import Drafted, SlotProposer
from pdserve.engine.spec_decode.proposers.ngram import NgramDrafts
from pdserve.engine.spec_decode.speculator import Speculator
from pdserve.engine.tracked import TrackedRequest

PAGE = 4
SCHEDULERS = ("fifo", "prefill_first")


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(100, 100 + n_prompt)),
                   SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), max_total_tokens=10_000)


def _setup(num_blocks: int = 64, scheduler_type: str = "fifo", prefix_caching: bool = False, **kw):
    mgr = KVCacheManager(BlockPool(num_blocks, 1), PAGE, enable_prefix_caching=prefix_caching)
    cfg = SchedulerConfig(**{"max_batch_tokens": 16, "max_requests_per_batch": 8, "safety_margin": 0.0,
                             "scheduler_type": scheduler_type, **kw})
    s = make_scheduler(cfg, mgr)
    assert isinstance(s, FifoScheduler if scheduler_type == "fifo" else PrefillFirstScheduler)
    return s, mgr


def _balanced(mgr: KVCacheManager) -> None:
    """The pool's books: empty + used (counted from reference counts) + cached == usable, the free
    lists hold only unreferenced blocks, and every table entry is one reference."""
    mgr.check_integrity()   # BlockPool.check_integrity, then the tables against the reference counts


def _apply_plain(out) -> None:
    """What the engine's update does to a chunk without drafts: advance, append a token if it samples."""
    for c in out.chunks:
        assert not c.draft_token_ids
        c.request.num_computed_tokens = c.end
        if c.samples:
            c.request.output_token_ids.append(7)
            c.request.status = RequestStatus.DECODING


def _decoding(s, mgr, *prompts: int) -> list[Request]:
    """Requests "a", "b", ... with these prompt lengths, prefilled in one step: each now decodes."""
    reqs = [_req(chr(ord("a") + i), n) for i, n in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [(c.request_id, c.num_tokens, c.samples) for c in out.chunks] == [(r.request_id, n, True)
                                                                          for r, n in zip(reqs, prompts, strict=True)]
    _apply_plain(out)
    _balanced(mgr)
    return reqs


def _plan(out) -> dict[str, tuple[int, int, tuple[int, ...], bool]]:
    return {c.request_id: (c.start, c.num_tokens, c.draft_token_ids, c.samples) for c in out.chunks}


DRAFT5 = (11, 12, 13, 14, 15)


# --- (a) K lookahead slots and their blocks, inside max_batch_tokens --------------------------------


@pytest.mark.parametrize("scheduler_type", SCHEDULERS)
def test_a_draft_gets_k_slots_and_their_blocks_after_an_admission_inside_the_token_budget(scheduler_type):
    """a (7 prompt tokens + 1 output) decodes position 7, which its 2 blocks cover: a plain decode
    takes no block. With a 5-token draft its chunk is positions 7..12 (6 tokens), which need 2
    more blocks; w's admission (8 tokens) is scheduled first and takes blocks 3, 4, so the
    lookahead's are 5, 6. 6 + 8 = 14 tokens of the budget of 16."""
    s, mgr = _setup(scheduler_type=scheduler_type)
    (a,) = _decoding(s, mgr, 7)
    assert mgr.block_table("a") == [1, 2] and a.num_tokens == 8
    w = _req("w", 8)
    s.add_request(w)
    out = s.schedule({"a": DRAFT5})
    assert _plan(out) == {"a": (7, 6, DRAFT5, True), "w": (0, 8, (), True)}
    assert out.num_batched_tokens == 14 and out.stalled == ()
    assert out.chunks[[c.request_id for c in out.chunks].index("a")].num_sample_rows == 6
    assert mgr.block_table("w") == [3, 4]
    assert mgr.block_table("a") == [1, 2, 5, 6]
    assert mgr.pool.num_free_blocks == 63 - 6
    _balanced(mgr)


def test_a_draft_that_fits_the_current_page_takes_no_block():
    """Prompt 5: position 5 decodes with positions 6, 7 drafted, all in block 2."""
    s, mgr = _setup()
    _decoding(s, mgr, 5)
    out = s.schedule({"a": (11, 12)})
    assert _plan(out) == {"a": (5, 3, (11, 12), True)}
    assert mgr.block_table("a") == [1, 2] and mgr.pool.num_free_blocks == 61
    _balanced(mgr)


def test_drafts_only_extend_sampling_decode_chunks():
    """A prefill chunk (even one that samples) and a request with no draft keep their size; a draft
    for an id that is not scheduled is ignored."""
    s, mgr = _setup(max_batch_tokens=32)
    a, b = _decoding(s, mgr, 7, 7)
    p = _req("p", 9)
    s.add_request(p)
    out = s.schedule({"b": (11, 12), "p": (11, 12), "ghost": (11, 12)})
    assert _plan(out) == {"a": (7, 1, (), True), "b": (7, 3, (11, 12), True), "p": (0, 9, (), True)}
    assert out.num_batched_tokens == 13
    # the decodes first, then the multi-token chunks (the verification among them)
    assert [c.request_id for c in out.chunks] == ["a", "b", "p"]
    _balanced(mgr)


# --- (b) the token budget cuts or drops a draft ---------------------------------------------------


@pytest.mark.parametrize("scheduler_type", SCHEDULERS)
@pytest.mark.parametrize(("max_batch_tokens", "granted", "table"), [
    (16, DRAFT5, [1, 2, 5, 6]),     # 14 tokens: everything fits
    (12, DRAFT5[:3], [1, 2, 5]),    # 1 + 8 leaves 3 of 12: drafts 11..13 (positions 8..10: one block)
    (10, DRAFT5[:1], [1, 2, 5]),    # 1 left: one draft (position 8: one block)
    (9, (), [1, 2]),                # 0 left: dropped, a decodes plainly and takes no block
])
def test_the_budget_left_after_an_admission_cuts_the_draft(scheduler_type, max_batch_tokens, granted, table):
    s, mgr = _setup(scheduler_type=scheduler_type, max_batch_tokens=max_batch_tokens)
    _decoding(s, mgr, 7)
    s.add_request(_req("w", 8))
    out = s.schedule({"a": DRAFT5})
    assert _plan(out) == {"a": (7, 1 + len(granted), granted, True), "w": (0, 8, (), True)}
    assert out.num_batched_tokens == 9 + len(granted) <= max_batch_tokens
    assert mgr.block_table("w") == [3, 4] and mgr.block_table("a") == table
    assert mgr.pool.num_free_blocks == 63 - len(table) - 2
    _balanced(mgr)


def test_sequences_share_the_budget_left_in_chunk_order():
    """Lookahead is granted in chunk order from what is left. Budget 8: the three decodes take 3,
    leaving 5: a's 6-token draft is cut to 5 and b, c get none. Budget 7: 4 left: a takes its 2,
    b 2 of its 3, c none."""
    s, mgr = _setup(max_batch_tokens=8)
    _decoding(s, mgr, 2, 2, 2)
    out = s.schedule({"a": (11, 12, 13, 14, 15, 16), "b": (21, 22), "c": (31,)})
    assert _plan(out) == {"a": (2, 6, (11, 12, 13, 14, 15), True), "b": (2, 1, (), True), "c": (2, 1, (), True)}
    assert out.num_batched_tokens == 8
    # a's positions 2..7 need block 4 after its 1 (b, c hold 2, 3)
    assert mgr.block_table("a") == [1, 4] and mgr.block_table("b") == [2] and mgr.block_table("c") == [3]
    _balanced(mgr)

    s, mgr = _setup(max_batch_tokens=7)
    _decoding(s, mgr, 2, 2, 2)
    out = s.schedule({"a": (11, 12), "b": (21, 22, 23), "c": (31,)})
    assert _plan(out) == {"a": (2, 3, (11, 12), True), "b": (2, 3, (21, 22), True), "c": (2, 1, (), True)}
    assert out.num_batched_tokens == 7
    assert mgr.block_table("a") == [1, 4] and mgr.block_table("b") == [2, 5] and mgr.block_table("c") == [3]
    _balanced(mgr)


# --- (c) the cache cannot give the lookahead blocks -----------------------------------------------


def test_a_full_pool_gives_no_lookahead_and_nobody_is_stalled_or_preempted():
    """4 usable blocks, a and b hold 2 each: both decode position 7 in place; drafts (which would
    need block 3 of each) are dropped, and no request is stalled, requeued or touched."""
    s, mgr = _setup(num_blocks=5)
    a, b = _decoding(s, mgr, 7, 7)
    assert mgr.pool.num_free_blocks == 0
    out = s.schedule({"a": (11, 12, 13), "b": (21, 22, 23)})
    assert _plan(out) == {"a": (7, 1, (), True), "b": (7, 1, (), True)}
    assert out.stalled == () and s.running == [a, b] and not s.waiting
    assert a.num_preemptions == b.num_preemptions == 0
    assert mgr.block_table("a") == [1, 2] and mgr.block_table("b") == [3, 4]
    _balanced(mgr)


def test_one_free_block_cuts_the_first_draft_to_it_and_the_next_decodes_plainly():
    """5 usable blocks, 1 free: a's 5-token draft would need 2 blocks (positions 8..12); the one
    free block covers positions 8..11, so a gets 4 drafts; b gets nothing and decodes plainly."""
    s, mgr = _setup(num_blocks=6)
    a, b = _decoding(s, mgr, 7, 7)
    out = s.schedule({"a": DRAFT5, "b": (21, 22)})
    assert _plan(out) == {"a": (7, 5, DRAFT5[:4], True), "b": (7, 1, (), True)}
    assert out.stalled == () and s.running == [a, b]
    assert mgr.block_table("a") == [1, 2, 5] and mgr.block_table("b") == [3, 4]
    assert mgr.pool.num_free_blocks == 0
    _balanced(mgr)


@pytest.mark.parametrize("scheduler_type", SCHEDULERS)
def test_an_admission_takes_the_blocks_before_lookahead(scheduler_type):
    """5 usable blocks: a holds 2; w's admission (8 tokens) takes 2 of the 3 free, and a's draft is
    cut to the last one (4 drafts), never the other way round."""
    s, mgr = _setup(num_blocks=6, scheduler_type=scheduler_type)
    _decoding(s, mgr, 7)
    s.add_request(_req("w", 8))
    out = s.schedule({"a": DRAFT5})
    assert _plan(out) == {"a": (7, 5, DRAFT5[:4], True), "w": (0, 8, (), True)}
    assert mgr.block_table("w") == [3, 4] and mgr.block_table("a") == [1, 2, 5]
    _balanced(mgr)


def test_a_stalled_request_means_no_lookahead_for_anyone():
    """a (prompt 5) could verify 2 drafts in its own block 2 (no new block), but b (prompt 8)
    needs a block for position 8 and the pool has none: b is stalled, so a decodes plainly."""
    s, mgr = _setup(num_blocks=5)
    a, b = _decoding(s, mgr, 5, 8)
    assert mgr.pool.num_free_blocks == 0
    out = s.schedule({"a": (11, 12)})
    assert _plan(out) == {"a": (5, 1, (), True)}
    assert [st.request_id for st in out.stalled] == ["b"] and out.stalled[0].num_blocks == 1
    assert mgr.block_table("a") == [1, 2]
    _balanced(mgr)
    # without b's stall the same draft is granted in place
    s.remove_request(b)
    out = s.schedule({"a": (11, 12)})
    assert _plan(out) == {"a": (5, 3, (11, 12), True)}
    assert mgr.block_table("a") == [1, 2]
    _balanced(mgr)


# --- (d) the rollback after a verification --------------------------------------------------------


class _NoText:
    """The detokenizer's side of _append_token: no text, no stop string."""

    def push(self, token_id: int):
        return SimpleNamespace(delta_text="", stop_string=None)


class _Engine:
    """The part of LLMEngine a step's update runs on: the engine's own _update (and the _sample,
    _append_token and _generators it calls, and the speculator's verify and _emit) over a real
    cache manager, sampler and speculator; the pass's output is made up (`logits_for`), no model
    is run."""

    _update = LLMEngine._update
    _sample = LLMEngine._sample
    _append_token = LLMEngine._append_token
    _generators = LLMEngine._generators

    def __init__(self, mgr: KVCacheManager, requests: list[Request], proposer=None, k: int = 8) -> None:
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)
        self.cache_manager = mgr
        self.speculator = Speculator(config, proposer or NgramDrafts(config), mgr)
        self.sampler = Sampler(seed=0)
        self._default_generator = torch.Generator().manual_seed(0)
        self._tracked = {r.request_id: TrackedRequest(r, _NoText(), []) for r in requests}
        self.num_steps = self.num_forward_tokens = self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = self.num_first_steps = self.num_first_step_tokens = 0


VOCAB = 128


def logits_for(out, argmax: dict[str, list[int]]) -> ModelOutput:
    """A pass's output whose greedy samples are argmax[request id] at its chunk's sample rows."""
    rows, chunk_rows = [], {}
    for c in out.chunks:
        if c.samples:
            chunk_rows[c.request_id] = len(rows)
            assert len(argmax[c.request_id]) == c.num_sample_rows
            rows.extend(argmax[c.request_id])
    logits = torch.zeros(len(rows), VOCAB)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 10.0
    return ModelOutput(logits=logits, hidden=torch.zeros(len(rows), 8), chunk_rows=chunk_rows)


DRAFT8 = (11, 12, 13, 14, 15, 16, 17, 18)


@pytest.mark.parametrize(("accepted", "kept", "freed"), [
    (0, [1, 2], [3, 4]),        # all 8 rejected: keeps positions 0..5 (the next token is at 5)
    (3, [1, 2, 3], [4]),        # 5 rejected: positions 0..8
    (7, [1, 2, 3, 4], []),      # 1 rejected: positions 0..12 (block 4 holds the next token's slot)
    (8, [1, 2, 3, 4], []),      # none rejected, plus the bonus token: positions 0..13
])
def test_a_verification_that_rejects_drafts_gives_back_the_blocks_past_what_the_request_keeps(accepted, kept, freed):
    """a: prompt 4 (block 1), one output token, an 8-token draft: the chunk is positions 4..12, in
    blocks 1..4. The target samples the first `accepted` drafts and then a token of its own (the
    bonus after all 8); the engine emits accepted + 1 tokens, keeps the KV of positions
    < 5 + accepted and the pages of the request's 6 + accepted tokens, and frees the rest (empty,
    not cached: they hold no committed KV). Prefix caching is on, so committed blocks get hashes."""
    s, mgr = _setup(num_blocks=8, prefix_caching=True)
    (a,) = _decoding(s, mgr, 4)
    out = s.schedule({"a": DRAFT8})
    (c,) = out.chunks
    assert (c.start, c.num_tokens, c.draft_token_ids) == (4, 9, DRAFT8)
    assert mgr.block_table("a") == [1, 2, 3, 4] and mgr.pool.num_free_blocks == 3
    _balanced(mgr)

    engine = _Engine(mgr, [a])
    sampled = list(DRAFT8[:accepted]) + [99] + [98] * (8 - accepted)   # the first non-draft sample at `accepted`
    (result,) = engine._update(out, logits_for(out, {"a": sampled}))
    assert result.new_token_ids == (*DRAFT8[:accepted], 99) and not result.finished
    assert engine.speculator.num_accepted_tokens == accepted and engine.speculator.num_draft_tokens == 8
    assert a.num_computed_tokens == 5 + accepted and a.num_tokens == 6 + accepted
    assert mgr.block_table("a") == kept
    for b in freed:
        assert mgr.pool.ref_count(b) == 0 and not mgr.pool.is_cached(b)
    assert mgr.pool.num_free_blocks == 7 - len(kept) and mgr.pool.num_used_blocks == len(kept)
    _balanced(mgr)

    # the next step decodes the emitted token at its position, from the blocks kept (a plain
    # decode needs no new block here), and the books still balance
    out = s.schedule()
    assert _plan(out) == {"a": (5 + accepted, 1, (), True)}
    assert mgr.block_table("a") == kept
    _apply_plain(out)
    _balanced(mgr)
    s.remove_request(a)
    assert mgr.pool.num_used_blocks == 0
    _balanced(mgr)


def test_a_verification_beside_a_plain_decode_rolls_back_only_its_own_tail():
    """a verifies 5 drafts (positions 7..12, blocks 1, 2 + 5, 6) and accepts 1; b decodes plainly in
    place. After the update a keeps positions 0..9 (blocks 1, 2, 5), block 6 is free again, b's
    table is untouched."""
    s, mgr = _setup()
    a, b = _decoding(s, mgr, 7, 7)
    out = s.schedule({"a": DRAFT5})
    assert _plan(out) == {"a": (7, 6, DRAFT5, True), "b": (7, 1, (), True)}
    assert mgr.block_table("a") == [1, 2, 5, 6] and mgr.pool.num_free_blocks == 57
    engine = _Engine(mgr, [a, b], k=5)
    results = engine._update(out, logits_for(out, {"a": [11, 42, 0, 0, 0, 0], "b": [43]}))
    assert {r.request_id: r.new_token_ids for r in results} == {"a": (11, 42), "b": (43,)}
    assert (a.num_computed_tokens, a.num_tokens, b.num_computed_tokens, b.num_tokens) == (9, 10, 8, 9)
    assert mgr.block_table("a") == [1, 2, 5] and mgr.block_table("b") == [3, 4]
    assert mgr.pool.num_free_blocks == 58 and mgr.pool.ref_count(6) == 0
    _balanced(mgr)


class _DraftsFewer(SlotProposer):
    """A drafting model that fills only n of its granted slots this step (a draft model still
    catching up on a long prompt under its catch-up budget drafts none: DraftModel.draft)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def draft(self, chunks):
        return [Drafted(tuple(range(21, 21 + self.n))) for _ in chunks]


@pytest.mark.parametrize("drafted", [4, 1, 0])
def test_slots_a_drafting_model_leaves_unused_are_freed_after_the_pass(drafted):
    """Speculator.fill: "A chunk whose proposer drafted fewer tokens than its slots shrinks (the
    slots it leaves are freed after the pass like rejected ones); one with none decodes plainly";
    _grant_lookahead: "Blocks it takes past the accepted tokens are freed after the pass".
    a (prompt 7) is granted 5 slots (positions 7..12: blocks 3, 4 beyond its 1, 2); its proposer
    drafts `drafted` tokens, the target rejects them all (or a decodes plainly when there are
    none): after the update a holds 9 tokens (positions 0..8, blocks 1..3), so block 4 (positions
    12..15) must be free again whatever the proposer drafted.

    Fails for drafted=0 (found while writing these tests): a chunk left with no drafts goes
    through _update's plain path, which never truncates, so the request keeps the lookahead
    blocks until its own tokens reach them (they are not leaked: freed when it finishes)."""
    s, mgr = _setup()
    (a,) = _decoding(s, mgr, 7)
    engine = _Engine(mgr, [a], proposer=_DraftsFewer(drafted), k=5)
    drafts = engine.speculator.drafts([a])
    assert drafts == {"a": (0,) * 5}                        # placeholders for the slots
    out = s.schedule(drafts)
    assert mgr.block_table("a") == [1, 2, 3, 4]
    out = engine.speculator.fill(out)
    assert _plan(out) == {"a": (7, 1 + drafted, tuple(range(21, 21 + drafted)), True)}
    (result,) = engine._update(out, logits_for(out, {"a": [42] + [0] * drafted}))
    assert result.new_token_ids == (42,) and (a.num_computed_tokens, a.num_tokens) == (8, 9)
    _balanced(mgr)
    assert mgr.block_table("a") == [1, 2, 3], "the unused lookahead block is still held after the pass"
    assert mgr.pool.num_free_blocks == 60


def test_truncate_keeps_the_pages_of_the_tokens_asked_for_and_refuses_to_cut_computed_kv():
    s, mgr = _setup()
    (a,) = _decoding(s, mgr, 4)
    s.schedule({"a": DRAFT8})
    assert mgr.block_table("a") == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="below its computed tokens"):
        mgr.truncate(a, 3)
    assert mgr.truncate(a, 9) == 1 and mgr.block_table("a") == [1, 2, 3]
    assert mgr.truncate(a, 9) == 0
    assert mgr.truncate(a, 5) == 1 and mgr.block_table("a") == [1, 2]
    assert mgr.pool.num_free_blocks == 61
    _balanced(mgr)
