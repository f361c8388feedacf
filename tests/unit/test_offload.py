"""Memory pressure (E14, E15): victim choice, the CPU swap pool's copies, and 64 requests through a
pool that holds about 4 of them, with outputs equal to an unconstrained run."""

from __future__ import annotations

import random

import pytest
import torch
from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.groups import FULL, PADDING_BLOCK, AttentionGroup
from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.cache.swap import SwapSpace
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams as SP
from pdserve.engine.scheduler import StalledRequest, make_scheduler
from pdserve.engine.scheduler.preemption import Preemptor, VictimCandidate, choose_victims


def _req(rid: str, n: int, t: float = 0.0) -> Request:
    return Request(rid, list(range(n)), SP(max_tokens=100), max_total_tokens=10_000, arrival_time=t)


def _names(victims: list[VictimCandidate]) -> list[str]:
    return [v.request.request_id for v in victims]


def test_choose_victims_takes_the_fewest_that_cover_the_demand_newest_first():
    c, b, a = (VictimCandidate(_req("c", 1), 1), VictimCandidate(_req("b", 1), 6),
               VictimCandidate(_req("a", 1), 2, need=1))           # newest first; a is stalled itself
    assert _names(choose_victims([c, b, a], demand=5, max_victims=2)) == ["b"]   # one covers it
    assert _names(choose_victims([c, b, a], demand=1, max_victims=2)) == ["c"]   # newest that covers
    assert _names(choose_victims([c, b, a], demand=7, max_victims=2)) == ["c", "b"]
    assert _names(choose_victims([c, b, a], demand=9, max_victims=2)) == ["b", "a"]  # a frees 2, needs 1
    assert _names(choose_victims([c, b, a], demand=50, max_victims=2)) == ["c", "b"]  # cannot: newest 2
    assert choose_victims([c, b, a], demand=0, max_victims=2) == []
    assert choose_victims([c, b, a], demand=3, max_victims=0) == []


def _filled_cache(num_blocks: int, num_layers: int = 2, kv_heads: int = 2, seed: int = 0) -> PagedKVCache:
    kv = PagedKVCache(KVCacheShape(num_layers=num_layers, num_pages=num_blocks, kv_heads=kv_heads, page_size=4,
                                   head_dim=8), torch.float32)
    g = torch.Generator().manual_seed(seed)
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=g))
    return kv


def test_swap_pool_moves_kv_out_in_one_call_and_back_into_new_blocks_unchanged():
    """The cache's pages and an attached pool's (a draft model's: other layers and heads, the
    same block ids) go out together and come back together into the new blocks."""
    kv = _filled_cache(24)
    draft = _filled_cache(24, num_layers=1, kv_heads=1, seed=1)
    mgr = KVCacheManager(BlockPool(24, 1), 4, (FULL, AttentionGroup("sliding", 5)))
    swap = SwapSpace(kv, mgr, num_slots=8)
    swap.attach(draft)
    with pytest.raises(ValueError, match="must have the cache's 24 pages of 4 tokens, not 12 of 4"):
        swap.attach(_filled_cache(12))
    a, b = _req("a", 14), _req("b", 18)
    assert mgr.allocate_slots(a, 14) is not None and mgr.allocate_slots(b, 18) is not None
    a.num_computed_tokens = 14
    assert mgr.allocate_slots(a, 1) is not None        # the sliding table recycles pages 0, 1
    layout = mgr.export_tables("a")
    assert layout.tables[1][:2] == (PADDING_BLOCK, PADDING_BLOCK)
    # buffer: [layers, 2, pages, kv_heads, page_size, head_dim]
    before = kv.buffer[:, :, layout.real_blocks].clone()
    before_draft = draft.buffer[:, :, layout.real_blocks].clone()
    # a holds 4 + 2 real blocks and fits in 8 slots; b (5 + 5) does not fit in what is left.
    assert swap.offload([a, b]) == [b]
    assert not mgr.has("a") and mgr.has("b") and swap.num_free_slots == 2
    kv.buffer[:, :, layout.real_blocks] = 0.0          # the pool reuses a's blocks meanwhile
    draft.buffer[:, :, layout.real_blocks] = 0.0
    mgr.free(b)
    blocker = _req("x", 4 * 8)
    mgr.allocate_slots(blocker, 4 * 8)                  # take the low ids so a comes back elsewhere
    assert swap.restore(a)
    back = mgr.export_tables("a")
    assert back.tables[1][:2] == (PADDING_BLOCK, PADDING_BLOCK)          # same layout ...
    assert set(back.real_blocks).isdisjoint(mgr.block_table("x"))       # ... in new blocks
    assert torch.equal(kv.buffer[:, :, back.real_blocks], before)       # with the same KV
    assert torch.equal(draft.buffer[:, :, back.real_blocks], before_draft)   # and the draft's
    assert swap.num_free_slots == 8 and swap.num_offloaded == 0
    swap.check_integrity()
    mgr.check_integrity()


def test_preemptor_offloads_newest_first_falls_back_to_soft_reset_and_restores_oldest_first():
    kv = _filled_cache(13)                              # 12 usable blocks of 4 tokens
    mgr = KVCacheManager(BlockPool(13, 1), 4)
    sched = make_scheduler(SchedulerConfig(max_batch_tokens=64, max_requests_per_batch=8, safety_margin=0.0), mgr)
    swap = SwapSpace(kv, mgr, num_slots=3)
    pre = Preemptor(sched, mgr, swap)
    reqs = [_req(n, 16, t) for t, n in enumerate("abc")]  # 4 blocks each: the pool is full
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    for c in out.chunks:
        c.request.num_computed_tokens = c.end
        c.request.output_token_ids.append(1)
        c.request.status = RequestStatus.DECODING
    out = sched.schedule()
    assert out.is_empty and [s.request_id for s in out.stalled] == ["a", "b", "c"]
    # 3 blocks short: moving c (newest) covers it (it frees 4 and no longer needs 1). c's 4
    # blocks do not fit in 3 slots, so it is soft-reset.
    relief = pre.relieve(out.stalled)
    assert [r.request_id for r in relief.soft_reset] == ["c"] and relief.offloaded == ()
    assert sched.waiting[0] is reqs[2] and reqs[2].num_computed_tokens == 0
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    # The same shortage with a larger swap pool: the newest running request (b) is offloaded.
    pre.swap = swap2 = SwapSpace(kv, mgr, num_slots=8)
    for c in out.chunks:
        c.request.num_computed_tokens = c.end
    relief = pre.relieve([StalledRequest(reqs[0], 5)])  # a wants 5 more blocks; 2 are free
    assert [r.request_id for r in relief.offloaded] == ["b"] and relief.soft_reset == ()
    assert sched.running == [reqs[0]] and "b" in sched.offloaded and swap2.num_offloaded == 1
    # Never the last running request: a alone stalls, and nothing moves.
    assert pre.relieve([StalledRequest(reqs[0], 50)]).is_empty
    # b returns only with room for itself plus one block of headroom per running request.
    assert mgr.pool.num_free_blocks == 7
    assert pre.restore() == [reqs[1]]
    assert sched.running == [reqs[0], reqs[1]] and not sched.offloaded
    assert (pre.num_offloads, pre.num_soft_resets, pre.num_restores) == (1, 1, 1)
    mgr.check_integrity()
    swap2.check_integrity()


# --- 64 requests through a small pool ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_offload") / "llama"))


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(6, 33))] for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(8, 25), ignore_eos=True) for _ in prompts]
    return prompts, params


def _run(tiny: str, **options) -> tuple[list[tuple[int, ...]], object]:
    llm = LLM(model=tiny, page_size=8, max_batch_tokens=64, max_requests_per_batch=16, max_model_len=128,
              num_threads=1, **options)
    eng = llm.engine
    prompts, params = _workload()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(p, sp, request_id=f"r{i}")
    done: dict[str, tuple[int, ...]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                assert o.error is None, o.error
                done[o.request_id] = o.completion.token_ids
        steps += 1
        if steps % 8 == 0:
            eng.check_integrity()
        assert steps < 5000, "the engine stopped making progress"
    eng.check_integrity()
    return [done[f"r{i}"] for i in range(len(prompts))], eng


def test_sixty_four_requests_through_a_pool_that_holds_four_match_an_unconstrained_run(tiny):
    expected, _ = _run(tiny, num_blocks=1024)
    block_nbytes = 2 * 2 * 2 * 8 * 16 * 4               # layers x (K, V) x kv_heads x page x head_dim x fp32
    # 20 usable blocks of 8 tokens; a request ends with 14..56 tokens (2..7 blocks, 4.4 on average).
    for swap_bytes, offloads, resets in ((4 * block_nbytes, True, True), (0, False, True)):
        outs, eng = _run(tiny, num_blocks=21, cpu_offload_space=swap_bytes)
        assert outs == expected
        m = eng.metrics()
        assert (m.num_offloads > 0) == offloads and (m.num_soft_resets > 0) == resets, m
        assert m.num_offloaded == 0 and m.num_running == 0 and m.num_waiting == 0
        pool = eng.pool
        assert pool.num_empty_blocks + pool.num_used_blocks + pool.num_cached_blocks == pool.num_usable_blocks
        assert pool.num_used_blocks == 0 and m.free_blocks + m.cached_blocks == m.total_blocks
        if eng.swap is not None:
            assert eng.swap.num_free_slots == eng.swap.num_slots == 4


def test_aborting_an_offloaded_request_frees_its_swap_slots(tiny):
    llm = LLM(model=tiny, page_size=8, max_batch_tokens=64, max_requests_per_batch=16, max_model_len=128,
              num_threads=1, num_blocks=21, cpu_offload_space=0.5)
    eng = llm.engine
    prompts, params = _workload()
    for i, (p, sp) in enumerate(zip(prompts[:12], params, strict=False)):
        eng.add_request(p, sp, request_id=f"r{i}")
    for _ in range(200):
        eng.step()
        if eng.scheduler.offloaded:
            break
    rid = next(iter(eng.scheduler.offloaded))
    assert eng.swap.holds(rid) and eng.swap.num_free_slots < eng.swap.num_slots
    out = eng.abort_request(rid)
    assert out.finished and out.finish_reason == "abort"
    assert not eng.swap.holds(rid) and rid not in eng.scheduler.offloaded
    eng.check_integrity()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.swap.num_free_slots == eng.swap.num_slots and eng.pool.num_used_blocks == 0
    eng.check_integrity()


def test_when_nothing_can_run_the_step_offloads_and_schedules_again(tiny):
    llm = LLM(model=tiny, page_size=8, max_batch_tokens=64, max_model_len=32, num_threads=1,
              num_blocks=5, cpu_offload_space=0.5)          # 4 usable blocks, 2 swap slots
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = _workload()[0]
    a = eng.add_request((prompts[0] * 3)[:16], params, request_id="a")
    b = eng.add_request((prompts[1] * 3)[:16], params, request_id="b")
    assert len(eng.step()) == 2                             # both prefills: 2 blocks each, pool full
    steps = eng.num_steps
    outs = eng.step()                                       # both decodes need a third block
    assert [o.request_id for o in outs] == ["a"] and eng.num_steps == steps + 1
    assert list(eng.scheduler.offloaded) == ["b"] and eng.metrics().num_offloads == 1
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.completion.token_ids for o in eng.step() if o.finished})
    expected = LLM(model=tiny, page_size=8, num_blocks=64, num_threads=1).generate(
        [a.prompt_token_ids, b.prompt_token_ids], params)
    assert [done["a"], done["b"]] == [e.token_ids for e in expected]
    assert eng.metrics().num_soft_resets == 0
    eng.check_integrity()


def test_a_draft_models_kv_is_offloaded_and_restored_with_the_targets(tiny):
    """A separate draft model's pool moves with the target's pages (SwapSpace.attach): a decoding
    request that has drafted is offloaded, comes back into new blocks, and drafts on from the
    draft KV that came back with it (no restart) to plain decoding's tokens."""
    spec = {"method": "draft_model", "model": tiny, "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(model=tiny, page_size=8, max_batch_tokens=64, max_model_len=32, num_threads=1,
              num_blocks=5, cpu_offload_space=0.5, speculative_config=spec)   # 4 usable blocks, 2 swap slots
    eng = llm.engine
    draft = eng.speculator.proposer
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = _workload()[0]
    a = eng.add_request((prompts[0] * 3)[:12], params, request_id="a")
    b = eng.add_request((prompts[1] * 3)[:12], params, request_id="b")
    done, drafted_before_offload = {}, 0
    while eng.has_unfinished_requests():
        progress = draft._progress.get("b")
        before = progress.computed if progress is not None else 0
        done.update({o.request_id: o.completion.token_ids for o in eng.step() if o.finished})
        if "b" in eng.scheduler.offloaded and not drafted_before_offload:
            drafted_before_offload = before
    assert eng.metrics().num_offloads >= 1 and eng.metrics().num_soft_resets == 0
    assert drafted_before_offload > 0          # b's draft had run when its pages went to the swap pool
    assert draft.num_restarts == 0             # ... and was not recomputed after the restore
    expected = LLM(model=tiny, page_size=8, num_blocks=64, num_threads=1).generate(
        [a.prompt_token_ids, b.prompt_token_ids], params)
    assert [done["a"], done["b"]] == [e.token_ids for e in expected]
    eng.check_integrity()
