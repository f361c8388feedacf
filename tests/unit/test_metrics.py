"""Prometheus metrics (R5), the pieces on their own: RequestTimer, EngineCollector, MetricsServer.
A real cluster's metrics are in tests/integration/test_cluster_metrics.py."""

from __future__ import annotations

import asyncio
import urllib.error

import pytest
from prometheus_client import CollectorRegistry
from support.prometheus import fetch, parse, total

from pdserve.engine.stats import EngineMetrics
from pdserve.serving.metrics import RequestTimer, request_metrics
from pdserve.serving.metrics.engine_collector import COUNTERS, GAUGES, EngineCollector
from pdserve.serving.metrics.server import MetricsServer


def snapshot(**overrides) -> EngineMetrics:
    values = dict(num_running=2, num_waiting=3, num_waiting_for_kv=1, num_offloaded=0, total_blocks=100,
                  free_blocks=60, cached_blocks=10, kv_cache_usage=0.3, prefix_cache_queries=200,
                  prefix_cache_hits=50, num_offloads=0, num_soft_resets=4, num_prompt_tokens_computed=150,
                  num_generated_tokens=77, num_steps=12)
    values.update(overrides)
    return EngineMetrics(**values)


# ---- the pieces ----------------------------------------------------------------------------------


def test_request_timer_observes_ttft_gaps_and_e2e_once():
    registry = CollectorRegistry()
    m = request_metrics(registry)
    timer = RequestTimer(m, "m", start=100.0)
    timer.tokens(0, now=100.1)          # a message without tokens: nothing
    timer.tokens(1, now=100.5)          # TTFT 0.5
    timer.tokens(2, now=100.75)         # gap 0.25
    timer.tokens(1, now=101.0)          # gap 0.25
    assert timer.finish("length", now=102.0) is True
    assert timer.finish("abort", now=103.0) is False  # once only
    timer.tokens(1, now=104.0)          # after the end: ignored
    get = registry.get_sample_value
    assert get("pdserve:time_to_first_token_seconds_count", {"model_name": "m"}) == 1
    assert get("pdserve:time_to_first_token_seconds_sum", {"model_name": "m"}) == pytest.approx(0.5)
    assert get("pdserve:inter_token_latency_seconds_count", {"model_name": "m"}) == 2
    assert get("pdserve:inter_token_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(0.5)
    assert get("pdserve:e2e_request_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(2.0)
    assert get("pdserve:request_success_total", {"model_name": "m", "finished_reason": "length"}) == 1
    assert get("pdserve:request_success_total", {"model_name": "m", "finished_reason": "abort"}) is None
    assert get("pdserve:time_to_first_token_seconds_bucket", {"model_name": "m", "le": "0.3"}) == 0
    assert get("pdserve:time_to_first_token_seconds_bucket", {"model_name": "m", "le": "0.5"}) == 1
    with pytest.raises(ValueError, match="finished_reason must be one of"):
        RequestTimer(m).finish("prefilled")


def test_engine_collector_exports_the_snapshot_and_nothing_before_it():
    registry = CollectorRegistry()
    current: list[EngineMetrics | None] = [None]
    registry.register(EngineCollector(lambda: current[0], "tiny"))
    get = registry.get_sample_value
    assert get("pdserve:num_requests_running", {"model_name": "tiny"}) is None  # engine still loading
    current[0] = snapshot()
    label = {"model_name": "tiny"}
    assert get("pdserve:num_requests_running", label) == 2
    assert get("pdserve:num_requests_waiting", label) == 3
    assert get("pdserve:num_requests_waiting_for_kv", label) == 1
    assert get("pdserve:kv_cache_usage_perc", label) == pytest.approx(0.3)
    assert get("pdserve:prefix_cache_hit_rate", label) == pytest.approx(0.25)
    assert get("pdserve:prefix_cache_queries_total", label) == 200
    assert get("pdserve:prefix_cache_hits_total", label) == 50
    assert get("pdserve:generation_tokens_total", label) == 77
    assert get("pdserve:num_preemptions_total", label) == 4
    current[0] = snapshot(prefix_cache_queries=0, prefix_cache_hits=0, num_running=0)
    assert get("pdserve:prefix_cache_hit_rate", label) == 0.0
    assert get("pdserve:num_requests_running", label) == 0
    assert len(GAUGES) + len(COUNTERS) == len({n for n, *_ in GAUGES + COUNTERS})  # no name twice


def test_engine_collector_exports_spec_decode_counters_that_the_bench_reads():
    from prometheus_client import generate_latest

    from pdserve.tools.bench.prometheus import SpecDecodeCounters

    registry = CollectorRegistry()
    current: list[EngineMetrics | None] = [snapshot()]
    registry.register(EngineCollector(lambda: current[0], "tiny"))
    get = registry.get_sample_value
    label = {"model_name": "tiny"}
    # an engine that does not speculate: the counters read 0 and there is no position
    assert get("pdserve:spec_decode_num_drafts_total", label) == 0
    assert get("pdserve:spec_decode_num_accepted_tokens_per_pos_total", {**label, "position": "0"}) is None
    current[0] = snapshot(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
                          spec_accepted_per_pos=(9, 7, 5, 4))
    assert get("pdserve:spec_decode_num_drafts_total", label) == 10
    assert get("pdserve:spec_decode_num_draft_tokens_total", label) == 40
    assert get("pdserve:spec_decode_num_accepted_tokens_total", label) == 25
    for pos, count in enumerate((9, 7, 5, 4)):
        assert get("pdserve:spec_decode_num_accepted_tokens_per_pos_total", {**label, "position": str(pos)}) == count
    text = generate_latest(registry).decode()
    assert "# TYPE pdserve:spec_decode_num_drafts_total counter" in text
    counters = SpecDecodeCounters.from_text(text)
    assert counters == SpecDecodeCounters(10, 40, 25, (9, 7, 5, 4))
    assert counters.acceptance_rate == pytest.approx(25 / 40) and counters.mean_acceptance_length == pytest.approx(3.5)


def test_metrics_server_serves_the_registry_and_names_a_taken_port():
    async def go():
        request_metrics().success.labels(model_name="served-check", finished_reason="stop").inc()
        server = MetricsServer("127.0.0.1", 0)
        port = await server.start()
        try:
            body, ctype = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")
            assert ctype.startswith("text/plain")
            assert total(parse(body), "pdserve:request_success_total", model_name="served-check") >= 1
            with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}"):
                await MetricsServer("127.0.0.1", port).start()
            with pytest.raises(urllib.error.HTTPError):
                await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/other")
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(go(), 30))
    with pytest.raises(ValueError, match="metrics port must be in 0..65535"):
        MetricsServer("127.0.0.1", 70000)
