"""Snapshots of one engine, read on its thread (or from another, accepting one that straddles a
step): what it is (EngineInfo), how busy (EngineLoad), its counters (EngineMetrics), and the cache
invariant checked at idle (free + used + cached == total, reference counts, holders). Functions of
the engine's own fields, kept out of llm_engine.py so that it reads as the step; LLMEngine's
`info`, `load`, `metrics` and `check_integrity` call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.cache.block_pool import CacheIntegrityError
from pdserve.engine.spec_decode.decoder import SpecCounters
from pdserve.engine.stats import EngineInfo, EngineLoad, EngineMetrics

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


def engine_info(engine: LLMEngine) -> EngineInfo:
    a = engine.arch
    return EngineInfo(model_name=engine.source.name, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                      num_layers=a.num_layers, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                      page_size=engine.cache_manager.page_size, max_model_len=engine.max_model_len,
                      num_blocks=engine.pool.num_usable_blocks)


def engine_load(engine: LLMEngine) -> EngineLoad:
    """How busy the engine is now (engine thread; from another thread, a snapshot that may
    straddle one step)."""
    s = engine.scheduler
    prompt_left = output_left = 0
    requests = engine.unfinished_requests()
    for r in requests:
        prompt_left += max(0, r.target_computed_tokens - r.num_computed_tokens)
        if not r.prefill_only:
            output_left += max(0, (r.sampling.max_tokens or engine.max_model_len) - len(r.output_token_ids))
    return EngineLoad(num_unfinished=len(requests), num_waiting=len(s.waiting) + len(s.waiting_for_kv),
                      num_running=len(s.running), prompt_tokens_left=prompt_left, output_tokens_left=output_left,
                      free_blocks=engine.pool.num_free_blocks, total_blocks=engine.pool.num_usable_blocks)


def engine_metrics(engine: LLMEngine) -> EngineMetrics:
    """A snapshot of the engine's gauges and counters (call from the engine thread, or accept
    a snapshot that may straddle one step when called from another thread)."""
    s = engine.scheduler
    pc = engine.cache_manager.prefix_cache
    sc = engine.speculator.counters() if engine.speculator is not None else SpecCounters()
    return EngineMetrics(
        num_running=len(s.running),
        num_waiting=len(s.waiting),
        num_waiting_for_kv=len(s.waiting_for_kv),
        num_offloaded=len(s.offloaded),
        total_blocks=engine.pool.num_usable_blocks,
        free_blocks=engine.pool.num_empty_blocks,
        cached_blocks=engine.pool.num_cached_blocks,
        kv_cache_usage=engine.pool.usage,
        prefix_cache_queries=pc.num_queried_tokens if pc is not None else 0,
        prefix_cache_hits=pc.num_hit_tokens if pc is not None else 0,
        num_offloads=engine.preemptor.num_offloads,
        num_soft_resets=engine.preemptor.num_soft_resets,
        num_prompt_tokens_computed=engine.num_prompt_tokens_computed,
        num_generated_tokens=engine.num_generated_tokens,
        num_steps=engine.num_steps,
        num_first_steps=engine.num_first_steps,
        num_first_step_tokens=engine.num_first_step_tokens,
        spec_handoff_history_rows=sc.handoff_history_rows,
        spec_num_drafts=sc.num_drafts,
        spec_num_draft_tokens=sc.num_draft_tokens,
        spec_num_accepted_tokens=sc.num_accepted_tokens,
        spec_accepted_per_pos=sc.accepted_per_pos,
    )


def check_engine_integrity(engine: LLMEngine) -> None:
    """The pool balances (empty + used + cached == total; held and quarantined pages count as
    used), every block's reference count matches the tables that hold it (the holds' included),
    the swap pool balances, and only requests running or waiting for KV have tables."""
    engine.cache_manager.check_integrity()
    if engine.swap is not None:
        engine.swap.check_integrity()
    s = engine.scheduler
    may_hold = {r.request_id for r in s.running} | set(s.waiting_for_kv)
    holders = {rid for g in engine.cache_manager.groups for rid in g.tables}
    if not holders <= may_hold:
        raise CacheIntegrityError(f"requests hold blocks but are neither running nor waiting for KV: "
                                  f"{sorted(holders - may_hold)[:10]}")
    swapped = engine.swap.num_offloaded if engine.swap is not None else 0
    if swapped != len(s.offloaded):
        raise CacheIntegrityError(f"the swap pool holds {swapped} requests but {len(s.offloaded)} are offloaded")
