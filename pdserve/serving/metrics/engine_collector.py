"""EngineCollector: a node engine's gauges and counters (pdserve/engine/stats.py EngineMetrics) at scrape time.

    REGISTRY.register(EngineCollector(lambda: async_engine.last_metrics, model_name="SmolLM2-135M"))

`snapshot` must not block and must be safe from the scraping thread: EngineThread.last_metrics is the
snapshot its engine thread took after its last step (or idle tick), so a scrape never waits for a
forward pass and never reads engine state mid-step. While it returns None (the engine is still
loading) the collector yields the families without samples.

Exported (all labelled model_name):
    pdserve:num_requests_running, pdserve:num_requests_waiting, pdserve:num_requests_waiting_for_kv,
    pdserve:num_requests_offloaded, pdserve:kv_cache_usage_perc (a fraction in [0, 1], as in vLLM),
    pdserve:kv_cache_free_blocks, pdserve:kv_cache_cached_blocks, pdserve:kv_cache_total_blocks,
    pdserve:prefix_cache_hit_rate (hit tokens / queried tokens since start),
    pdserve:prefix_cache_queries_total, pdserve:prefix_cache_hits_total (tokens),
    pdserve:prompt_tokens_total (prompt tokens computed), pdserve:generation_tokens_total,
    pdserve:num_preemptions_total (soft resets), pdserve:num_offloads_total, pdserve:engine_steps_total,
    pdserve:first_steps_total and pdserve:first_step_tokens_total (the pass that sampled each request's
    first output, and the tokens it emitted: on a decode node its first step after the transfer, more
    than 1 token on average when the eagle head's drafts from the shipped hidden state are accepted),
    speculative decoding (E20) with vLLM's names and meaning: pdserve:spec_decode_num_drafts_total (verified
    proposals, one per speculating sequence per step), pdserve:spec_decode_num_draft_tokens_total,
    pdserve:spec_decode_num_accepted_tokens_total (bonus tokens excluded) and
    pdserve:spec_decode_num_accepted_tokens_per_pos_total{position="i"} (drafts whose token i, from 0, was
    accepted; one sample per position the engine counts). They read 0 on an engine that does not speculate.
    Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.stats import EngineMetrics

# (name, help, value of a snapshot)
GAUGES: tuple[tuple[str, str, Callable[[EngineMetrics], float]], ...] = (
    ("pdserve:num_requests_running", "Requests in the engine's running set (prefilling or decoding).",
     lambda m: m.num_running),
    ("pdserve:num_requests_waiting", "Requests queued for admission.", lambda m: m.num_waiting),
    ("pdserve:num_requests_waiting_for_kv", "Admitted requests whose prompt KV is still arriving from a "
     "prefill node.", lambda m: m.num_waiting_for_kv),
    ("pdserve:num_requests_offloaded", "Requests whose KV sits in the CPU swap pool.", lambda m: m.num_offloaded),
    ("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use, in [0, 1].", lambda m: m.kv_cache_usage),
    ("pdserve:kv_cache_free_blocks", "KV blocks never used or evicted.", lambda m: m.free_blocks),
    ("pdserve:kv_cache_cached_blocks", "Freed KV blocks that keep their content for the prefix cache.",
     lambda m: m.cached_blocks),
    ("pdserve:kv_cache_total_blocks", "Usable KV blocks of the pool.", lambda m: m.total_blocks),
    ("pdserve:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up, "
     "since the engine started (0 before any lookup).", lambda m: m.prefix_cache_hit_rate),
)
COUNTERS: tuple[tuple[str, str, Callable[[EngineMetrics], float]], ...] = (
    ("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda m: m.prefix_cache_queries),
    ("pdserve:prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied.", lambda m: m.prefix_cache_hits),
    ("pdserve:prompt_tokens", "Prompt tokens run through forward passes.", lambda m: m.num_prompt_tokens_computed),
    ("pdserve:generation_tokens", "Tokens sampled.", lambda m: m.num_generated_tokens),
    ("pdserve:num_preemptions", "Requests preempted by freeing their blocks (recomputed later).",
     lambda m: m.num_soft_resets),
    ("pdserve:num_offloads", "Requests moved to the CPU swap pool.", lambda m: m.num_offloads),
    ("pdserve:engine_steps", "Forward passes run.", lambda m: m.num_steps),
    ("pdserve:first_steps", "Passes that sampled a request's first output token(s).", lambda m: m.num_first_steps),
    ("pdserve:first_step_tokens", "Tokens those passes emitted: more than one each when drafts (on a decode "
     "node, from the prefill node's hidden state) were accepted at once.", lambda m: m.num_first_step_tokens),
    ("pdserve:spec_decode_handoff_history_rows", "Rows of the draft head's history a decode node wrote from "
     "context records (hidden states of the prompt's last positions the prefill node handed over).",
     lambda m: m.spec_handoff_history_rows),
    ("pdserve:spec_decode_num_drafts", "Speculative drafts verified (one per speculating sequence per step).",
     lambda m: m.spec_num_drafts),
    ("pdserve:spec_decode_num_draft_tokens", "Draft tokens verified.", lambda m: m.spec_num_draft_tokens),
    ("pdserve:spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus tokens excluded).",
     lambda m: m.spec_num_accepted_tokens),
)
SPEC_PER_POS = "pdserve:spec_decode_num_accepted_tokens_per_pos"  # labels model_name, position (0-based)


class EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineMetrics | None], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._snapshot())

    def _families(self, m: EngineMetrics | None) -> Iterator[Metric]:
        labels = [self._model_name]
        for name, doc, value in GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            if m is not None:
                family.add_metric(labels, float(value(m)))
            yield family
        for name, doc, value in COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            if m is not None:
                family.add_metric(labels, float(value(m)))
            yield family
        per_pos = CounterMetricFamily(SPEC_PER_POS, "Drafts whose token at this position was accepted.",
                                      labels=["model_name", "position"])
        if m is not None:
            for pos, count in enumerate(m.spec_accepted_per_pos):
                per_pos.add_metric([self._model_name, str(pos)], float(count))
        yield per_pos
