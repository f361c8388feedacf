"""Prefix cache (E12, E13): block hashes, lookups, shared blocks in the manager and the scheduler,
and the engine skipping the prefill of a shared prefix with output equal to a cold run."""

from __future__ import annotations

import pytest
from support.kv_events import EngineEvents
from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.cache.block_hash import hash_block
from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.groups import FULL, AttentionGroup
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.cache.prefix_cache import request_block_hashes
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv_connector import DecodeConnector, KvCacheSpec, KvLanded, KvWait, PrefillConnector, PrefillDone
from pdserve.engine.request import Request, TransferRole
from pdserve.engine.sampling_params import SamplingParams as SP
from pdserve.engine.scheduler import make_scheduler

P = 4


def _req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, list(tokens), SP(max_tokens=100), max_total_tokens=10_000, **kw)


def _mgr(num_blocks: int = 32, groups=(FULL,)) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, 1), P, groups, enable_prefix_caching=True)


def _run_prefill(mgr: KVCacheManager, r: Request) -> None:
    """Admit and compute a request's whole prompt, as scheduler and engine would."""
    hit = mgr.lookup_prefix(r)
    assert mgr.allocate_slots(r, r.num_prompt_tokens - hit.num_tokens, hit) is not None
    r.num_computed_tokens = r.num_prompt_tokens
    mgr.commit(r)


def test_block_hashes_chain_over_the_whole_prefix():
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = _req("b", [0, 2, 3, 4, 5, 6, 7, 8])          # differs in block 0 only
    ha, hb = request_block_hashes(a, 2, P), request_block_hashes(b, 2, P)
    assert ha[0] == hash_block(None, [1, 2, 3, 4]) and ha[1] == hash_block(ha[0], [5, 6, 7, 8])
    assert ha[0] != hb[0] and ha[1] != hb[1]          # same tokens in block 1, different parent
    assert a.block_hashes == ha                       # kept on the request, extended on demand
    with pytest.raises(ValueError, match="fewer than 3 blocks"):
        request_block_hashes(a, 3, P)


def test_second_request_reuses_complete_blocks_and_never_the_block_of_its_last_token():
    mgr = _mgr()
    a = _req("a", list(range(10)))                    # blocks [0..3] [4..7] and a partial one
    _run_prefill(mgr, a)
    assert mgr.block_table("a") == [1, 2, 3]
    assert [mgr.pool.block_hash(b) is not None for b in (1, 2, 3)] == [True, True, False]
    # Same first 8 tokens, longer: both complete blocks are hits.
    b = _req("b", list(range(8)) + [50, 51, 52])
    hit = mgr.lookup_prefix(b)
    assert hit.block_ids == (1, 2) and hit.num_tokens == 8
    assert mgr.allocate_slots(b, 3, hit) == [4]
    assert mgr.block_table("b") == [1, 2, 4]
    assert [mgr.pool.ref_count(x) for x in (1, 2, 3, 4)] == [2, 2, 1, 1]
    # Exactly the 8 cached tokens as a prompt: the block holding its last token is recomputed.
    c = _req("c", list(range(8)))
    assert mgr.lookup_prefix(c).block_ids == (1,)
    # A remote-prefill request looks nothing up (its KV comes from elsewhere).
    assert mgr.lookup_prefix(_req("d", list(range(12)), role=TransferRole.REMOTE_PREFILL)).num_blocks == 0
    mgr.check_integrity()
    assert mgr.prefix_cache.num_queried_tokens == 10 + 11 and mgr.prefix_cache.num_hit_tokens == 8


def test_freed_prefix_stays_cached_until_the_pool_needs_it_and_tail_blocks_go_first():
    mgr = _mgr(num_blocks=6)                          # usable 1..5
    a = _req("a", list(range(13)))                    # 3 complete blocks + 1 partial = 4 blocks
    _run_prefill(mgr, a)
    assert mgr.block_table("a") == [1, 2, 3, 4]
    assert mgr.free(a) == 4
    pool = mgr.pool
    assert (pool.num_empty_blocks, pool.num_cached_blocks) == (2, 3)  # 4 (partial) is empty again
    # Three new blocks: the empty ones (5, then 4) and then the most recently freed cached block,
    # a's tail (3): a's first two blocks stay reusable.
    x = _req("x", [99] * 12)
    assert mgr.allocate_slots(x, 12) == [5, 4, 3]
    assert pool.num_evictions == 1
    b = _req("b", list(range(13)))
    hit = mgr.lookup_prefix(b)
    assert hit.block_ids == (1, 2)
    mgr.check_integrity()


def test_admission_with_a_hit_is_all_or_nothing():
    mgr = _mgr(num_blocks=5)                          # usable 1..4
    a = _req("a", list(range(9)))
    _run_prefill(mgr, a)                              # [1, 2, 3], blocks 1, 2 hashed
    mgr.free(a)                                       # 1, 2 cached; 3, 4 empty
    b = _req("b", list(range(8)) + list(range(100, 112)))   # 2 hit blocks + 12 tokens = 3 new blocks
    hit = mgr.lookup_prefix(b)
    assert hit.block_ids == (1, 2)
    # Taking the 2 cached hits leaves 2 free blocks for 3 new ones: refused, nothing taken.
    assert mgr.allocate_slots(b, 12, hit) is None
    assert not mgr.has("b") and mgr.pool.is_cached(1) and mgr.pool.is_cached(2)
    assert mgr.pool.num_free_blocks == 4 and mgr.prefix_cache.num_queried_tokens == 9
    mgr.check_integrity()


def test_scheduler_starts_a_hit_request_at_its_first_uncached_token():
    mgr = _mgr()
    s = make_scheduler(SchedulerConfig(max_batch_tokens=64, max_requests_per_batch=8, safety_margin=0.0), mgr)
    a = _req("a", list(range(12)))
    _run_prefill(mgr, a)
    mgr.free(a)
    b = _req("b", list(range(12)) + [7, 7])
    s.add_request(b)
    out = s.schedule()
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("b", 12, 2)]
    assert b.num_prefix_hit_tokens == 12 and b.num_computed_tokens == 12


def test_prefix_caching_is_off_with_a_sliding_group():
    mgr = _mgr(groups=(FULL, AttentionGroup("sliding", 8)))
    assert mgr.prefix_cache is None
    a = _req("a", list(range(12)))
    _run_prefill(mgr, a)
    assert all(mgr.pool.block_hash(b) is None for b in mgr.block_table("a"))


# --- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_prefix") / "llama"))


PREFIX = [(i * 37) % 4000 + 100 for i in range(160)]    # 10 pages of 16 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _llm(tiny: str, **kw) -> LLM:
    return LLM(model=tiny, num_blocks=128, page_size=16, max_batch_tokens=64, max_model_len=512,
               num_threads=1, **kw)


class _ChunkStarts(PrefillConnector):
    """Records where each pass's chunks of one request start (the engine's on_schedule event)."""

    def __init__(self, rid: str) -> None:
        self.rid, self.starts = rid, []

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        pass

    def on_schedule(self, sched, block_ids) -> None:
        self.starts.extend(c.start for c in sched.chunks if c.request_id == self.rid)

    def on_layer_done(self, layer: int) -> None:
        pass

    def on_prefill_done(self, done: PrefillDone) -> None:
        pass


class _Waits(EngineEvents, DecodeConnector):
    """Records the pages of each request that waits for its KV."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: dict[str, list[int]] = {}

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        pass

    def on_kv_wait(self, wait: KvWait) -> None:
        self.waits[wait.request_id] = list(wait.block_ids)


def test_second_request_with_a_shared_ten_page_prefix_computes_only_its_suffix(tiny):
    first, second = PREFIX + [11, 12, 13], PREFIX + [21, 22, 23, 24, 25]
    cold = _llm(tiny, allow_block_sharing=False).generate([second], GREEDY)[0]
    recorder = _ChunkStarts("b")
    llm = _llm(tiny, kv_connector=recorder)
    eng = llm.engine
    llm.generate([first], GREEDY)
    tokens0, prompt0 = eng.num_forward_tokens, eng.num_prompt_tokens_computed
    starts = recorder.starts
    r = eng.add_request(second, GREEDY, request_id="b")
    done = None
    while eng.has_unfinished_requests():
        done = [o for o in eng.step() if o.finished] or done
    assert done[0].completion.token_ids == cold.token_ids
    assert r.num_prefix_hit_tokens == 160 and starts[0] == 160
    assert eng.num_prompt_tokens_computed - prompt0 == 5          # the suffix only
    assert eng.num_forward_tokens - tokens0 == 5 + GREEDY.max_tokens - 1
    m = eng.metrics()
    assert m.prefix_cache_hits == 160 and m.prefix_cache_queries == len(first) + len(second)
    assert m.prefix_cache_hit_rate == pytest.approx(160 / (len(first) + len(second)))
    assert m.cached_blocks > 0 and m.free_blocks + m.cached_blocks == m.total_blocks
    eng.check_integrity()


def test_a_repeated_prompt_recomputes_only_its_last_block(tiny):
    prompt = PREFIX[:64]                               # exactly 4 pages
    llm = _llm(tiny)
    a, = llm.generate([prompt], GREEDY)
    computed = llm.engine.num_prompt_tokens_computed
    b, = llm.generate([prompt], GREEDY)
    assert b.token_ids == a.token_ids
    assert llm.engine.num_prompt_tokens_computed - computed == 16  # the page of the last token


def test_remote_prefill_blocks_join_the_cache_only_when_their_kv_has_landed(tiny):
    recorder = _Waits()
    eng = _llm(tiny, kv_connector=recorder).engine
    waits = recorder.waits
    remote = eng.add_request(PREFIX, GREEDY, request_id="remote", role=TransferRole.REMOTE_PREFILL)
    eng.step()
    assert len(waits["remote"]) == 10                  # 159 tokens: 10 pages
    assert all(eng.pool.block_hash(b) is None for b in waits["remote"])
    probe = _req("probe", PREFIX + [5])
    assert eng.cache_manager.lookup_prefix(probe).num_blocks == 0   # nothing to hit while KV is in flight
    recorder.apply(eng, KvLanded("remote"))
    hashed = [eng.pool.block_hash(b) is not None for b in waits["remote"]]
    assert hashed == [True] * 9 + [False]              # complete prompt blocks (the 10th is partial)
    assert remote.num_computed_tokens == 159
    assert eng.cache_manager.lookup_prefix(probe).block_ids == tuple(waits["remote"][:9])
    eng.abort_request("remote")
    eng.check_integrity()


def test_block_hash_old_path_still_importable():
    # BlockHash / hash_block moved to the leaf block_hash (issue 30); prefix_cache keeps the old names
    from pdserve.engine.cache import block_hash, prefix_cache
    assert prefix_cache.hash_block is block_hash.hash_block and prefix_cache.BlockHash is block_hash.BlockHash
