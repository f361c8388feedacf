"""Prometheus metrics (R5) of a real cluster (1 prefill, 1 decode, router) scraped over HTTP after a
few requests: every name is there, and the counts add up (request_success_total and the TTFT count
equal the requests sent, at the router and at the decode node; KV bytes received equal KV bytes sent;
the engine's gauges settle). The cluster's logs name request ids and never the prompt text.
The pieces on their own are in tests/unit/test_metrics.py."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.prometheus import Samples, family_names, fetch, parse, total
from support.wait import wait_until

N_REQUESTS = 6
MAX_TOKENS = 5
SECRET = "zebra-marmalade-quokka"  # in every prompt; must appear in no log line
PROMPTS = [f"{SECRET} {i}: tell me about the number {i} and its friends." for i in range(N_REQUESTS)]

ROUTER_NAMES = ("pdserve:time_to_first_token_seconds", "pdserve:inter_token_latency_seconds",
                "pdserve:e2e_request_latency_seconds", "pdserve:request_success")
ENGINE_NAMES = ("pdserve:num_requests_running", "pdserve:num_requests_waiting", "pdserve:kv_cache_usage_perc",
                "pdserve:prefix_cache_hit_rate", "pdserve:request_queue_time_seconds", "pdserve:kv_transfer_bytes",
                "pdserve:kv_transfer_seconds")


@dataclass(frozen=True)
class Scrape:
    """Every process's /metrics page at one moment; true once no engine runs a request or holds KV."""

    texts: dict[str, str]
    samples: dict[str, Samples]

    @property
    def busy(self) -> dict[str, tuple[float, float]]:
        """Engine process -> (requests running, KV cache usage), where either is not 0."""
        gauges = {n: (total(self.samples[n], "pdserve:num_requests_running"),
                      total(self.samples[n], "pdserve:kv_cache_usage_perc")) for n in ("prefill-0", "decode-0")}
        return {n: g for n, g in gauges.items() if any(g)}

    def __bool__(self) -> bool:
        return not self.busy

    def __repr__(self) -> str:
        return f"Scrape(busy={self.busy})"


def scrape(urls: dict[str, str]) -> Scrape:
    texts = {name: fetch(url)[0] for name, url in urls.items()}
    return Scrape(texts, {name: parse(text) for name, text in texts.items()})


@pytest.mark.slow
def test_cluster_metrics_add_up_and_logs_keep_prompts_out(tmp_path):
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.tools.client import AsyncClient
    from pdserve.tools.launcher import Cluster

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
        settled = wait_until(lambda: scrape(urls), 15, "the engines' running-request and KV-usage gauges at 0",
                             interval=0.3)
        texts, after = settled.texts, settled.samples

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
        # no speculation: each request's first step after its transfer emits exactly one token
        assert delta("decode-0", "pdserve:first_steps_total") == N_REQUESTS
        assert delta("decode-0", "pdserve:first_step_tokens_total") == N_REQUESTS
        assert delta("prefill-0", "pdserve:first_steps_total") == 0
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
