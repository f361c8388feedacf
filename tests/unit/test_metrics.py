"""Prometheus metrics (R5): the pieces on their own (RequestTimer, EngineCollector, MetricsServer), then a
real cluster (1 prefill, 1 decode, router) scraped over HTTP after a few requests: every name is there,
and the counts add up (request_success_total and the TTFT count equal the requests sent, at the
router and at the decode node; KV bytes received equal KV bytes sent; the engine's gauges settle).
The cluster's logs name request ids and never the prompt text."""

from __future__ import annotations

import asyncio
import math
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the node packages may postdate the editable install
    sys.path.insert(0, str(ROOT))

from pdserve.serving.metrics import RequestTimer, request_metrics  # noqa: E402
from pdserve.serving.metrics.engine_collector import COUNTERS, GAUGES, EngineCollector  # noqa: E402
from pdserve.serving.metrics.server import MetricsServer  # noqa: E402
from pdserve.engine.stats import EngineMetrics  # noqa: E402

NODES_EXIST = (ROOT / "prefill_node" / "__main__.py").exists() and (ROOT / "decode_node" / "__main__.py").exists()


def snapshot(**overrides) -> EngineMetrics:
    values = dict(num_running=2, num_waiting=3, num_waiting_for_kv=1, num_offloaded=0, total_blocks=100,
                  free_blocks=60, cached_blocks=10, kv_cache_usage=0.3, prefix_cache_queries=200,
                  prefix_cache_hits=50, num_offloads=0, num_soft_resets=4, num_prompt_tokens_computed=150,
                  num_generated_tokens=77, num_steps=12)
    values.update(overrides)
    return EngineMetrics(**values)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name + sorted labels -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name` over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


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


def fetch(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode(), r.headers.get("Content-Type", "")


# ---- a real cluster --------------------------------------------------------------------------------

N_REQUESTS = 6
MAX_TOKENS = 5
SECRET = "zebra-marmalade-quokka"  # in every prompt; must appear in no log line
PROMPTS = [f"{SECRET} {i}: tell me about the number {i} and its friends." for i in range(N_REQUESTS)]

ROUTER_NAMES = ("pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds",
                "pdserve:e2e_request_latency_seconds", "pdserve:request_success")
ENGINE_NAMES = ("pdserve:num_requests_running", "pdserve:num_requests_waiting", "pdserve:kv_cache_usage_perc",
                "pdserve:prefix_cache_hit_rate", "pdserve:request_queue_time_seconds", "pdserve:kv_transfer_bytes",
                "pdserve:kv_transfer_seconds")


def family_names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


@pytest.mark.skipif(not NODES_EXIST, reason="prefill_node/ and decode_node/ are not in this checkout")
@pytest.mark.slow
def test_cluster_metrics_add_up_and_logs_keep_prompts_out(tmp_path):
    from pdserve.tools.client import AsyncClient
    from pdserve.tools.launcher import Cluster
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with Cluster(prefill=1, decode=1, port=0, http_port=0, node_metrics=True, num_blocks=128, threads_per_node=1,
                 startup_timeout_s=150, router_health_interval_s=0.5, log_dir=str(tmp_path)) as cluster:
        urls = cluster.metrics_urls
        assert set(urls) == {"prefill-0", "decode-0", "router"}, urls
        before = {name: parse(fetch(url)[0]) for name, url in urls.items()}

        async def send() -> list[tuple[str, int, int]]:
            async with AsyncClient(cluster.url, timeout=120) as client:
                async def one(i: int) -> tuple[str, int, int]:
                    messages = tokens = 0
                    async for chunk in client.generate(PROMPTS[i], params, request_id=f"metrics-{i}"):
                        messages += bool(chunk.token_ids)
                        tokens += len(chunk.token_ids)
                    return chunk.finish_reason, messages, tokens
                return await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))

        results = asyncio.run(asyncio.wait_for(send(), 150))
        assert [r[0] for r in results] == ["length"] * N_REQUESTS and all(r[2] == MAX_TOKENS for r in results)
        token_messages = sum(r[1] for r in results)

        # The engine gauges come from the snapshot the engine thread takes when idle (at least once a second).
        deadline = time.monotonic() + 15
        while True:
            texts = {name: fetch(url)[0] for name, url in urls.items()}
            after = {name: parse(text) for name, text in texts.items()}
            settled = all(total(after[n], "pdserve:num_requests_running") == 0
                          and total(after[n], "pdserve:kv_cache_usage_perc") == 0 for n in ("prefill-0", "decode-0"))
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert settled, {n: (total(after[n], "pdserve:num_requests_running"),
                             total(after[n], "pdserve:kv_cache_usage_perc")) for n in ("prefill-0", "decode-0")}

        def delta(process: str, name: str, **labels: str) -> float:
            return total(after[process], name, **labels) - total(before[process], name, **labels)

        # every name, where it belongs
        assert set(ROUTER_NAMES) <= family_names(texts["router"])
        assert set(ROUTER_NAMES) | set(ENGINE_NAMES) <= family_names(texts["decode-0"])
        assert set(ENGINE_NAMES) <= family_names(texts["prefill-0"])

        # the client's view through the router, and the decode node's own
        for process in ("router", "decode-0"):
            assert delta(process, "pdserve:request_success_total") == N_REQUESTS, process
            assert delta(process, "pdserve:request_success_total", finished_reason="length") == N_REQUESTS
            assert delta(process, "pdserve:time_to_first_token_seconds_count") == N_REQUESTS, process
            assert delta(process, "pdserve:e2e_request_latency_seconds_count") == N_REQUESTS, process
            assert delta(process, "pdserve:inter_token_latency_seconds_count") == token_messages - N_REQUESTS
            ttft_sum = delta(process, "pdserve:time_to_first_token_seconds_sum")
            e2e_sum = delta(process, "pdserve:e2e_request_latency_seconds_sum")
            assert 0 < ttft_sum < e2e_sum, (process, ttft_sum, e2e_sum)
        model = next(dict(ls)["model_name"] for (n, ls) in after["decode-0"] if n == "pdserve:request_success_total")
        assert delta("router", "pdserve:request_success_total", model_name=model) == N_REQUESTS

        # admission, KV transfer on both sides, prefill outcomes
        assert delta("decode-0", "pdserve:request_queue_time_seconds_count") == N_REQUESTS
        assert delta("prefill-0", "pdserve:request_queue_time_seconds_count") == N_REQUESTS
        assert delta("prefill-0", "pdserve:prefill_requests_total", outcome="ok") == N_REQUESTS
        received = delta("decode-0", "pdserve:kv_transfer_bytes_total", side="decode")
        sent = delta("prefill-0", "pdserve:kv_transfer_bytes_total", side="prefill")
        assert received == sent > 0
        assert delta("decode-0", "pdserve:kv_transfer_seconds_count", side="decode") == N_REQUESTS
        assert delta("prefill-0", "pdserve:kv_transfer_seconds_count", side="prefill") == N_REQUESTS

        # the engines' counters: tokens generated on the decode node, prompts computed on the prefill node
        assert delta("decode-0", "pdserve:generation_tokens_total") == N_REQUESTS * MAX_TOKENS
        assert delta("prefill-0", "pdserve:prompt_tokens_total") > 0
        assert delta("prefill-0", "pdserve:generation_tokens_total") == 0
        for process in ("prefill-0", "decode-0"):
            rate = total(after[process], "pdserve:prefix_cache_hit_rate")
            assert 0.0 <= rate <= 1.0 and not math.isnan(rate)
        assert sum(delta("router", "pdserve:router_requests_routed_total", node="decode-0", reason=r)
                   for r in ("least_loaded", "prefix", "load_cap")) == N_REQUESTS

    logs = {p.name: p.read_text(errors="replace") for p in Path(tmp_path).glob("*.log")}
    assert set(logs) >= {"prefill-0.log", "decode-0.log", "router.log"}
    for name, text in logs.items():
        assert SECRET not in text, f"prompt text in {name}"
    assert all(f"request_id=metrics-{i}" in logs["router.log"] for i in range(N_REQUESTS))
