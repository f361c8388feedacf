"""The load-test harness against a real cluster (L1-L3): `pdserve up`'s default 1 prefill + 1 decode.

Evidence: a run's result adds up (requests sent = completed + failed = the finish reasons counted;
every request's output tokens = what it asked for, since EOS is ignored; the token totals are the
sums of the records); the client's TTFT percentiles fall within a bucket of the router's own
`pdserve:time_to_first_token_seconds` histogram over the same requests; the concurrency and
duration caps hold; the OpenAI HTTP backend's counts add up the same way; the command line writes
the result JSON and the PNG plots; a sweep writes one result per rate and its plot. Also the
compare command's two clusters get the same cores (no cluster started for that).

One small cluster for the whole module (tiny prompts and outputs), so the file stays short.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from support.cluster import cluster_fixture

from pdserve.tools.bench.backends import SendOptions
from pdserve.tools.bench.compare import CompareSettings, cluster_config
from pdserve.tools.bench.datasets import DatasetSpec, LengthRange
from pdserve.tools.bench.prometheus import TTFT
from pdserve.tools.bench.runner import RunConfig
from pdserve.tools.bench.serve import ServeResult, ServeSettings, run_serve
from pdserve.tools.launcher import plan

SMALL = dict(prefill=1, decode=1, port=0, num_blocks=128, threads_per_node=1, startup_timeout_s=150,
             router_health_interval_s=0.5, engine_args=("--max-batch-tokens", "64"))
TINY = DatasetSpec("random", 12, LengthRange(8, 40), LengthRange(2, 6), seed=5)
SEND = SendOptions(timeout_s=120)


def assert_adds_up(result: ServeResult, planned: int) -> None:
    """Counts of a run in which every request was asked to run to max_tokens (EOS ignored)."""
    m, records = result.metrics, result.outcome.records
    failures = {r.index: r.error for r in records if not r.success}
    assert not failures, failures
    assert m.requests_sent == len(records) == planned - result.outcome.not_sent
    assert m.completed + m.failed == m.requests_sent == sum(m.finish_reasons.values())
    assert m.finish_reasons == {"length": m.completed}
    assert all(r.output_tokens == r.max_tokens for r in records)
    assert m.total_output_tokens == sum(r.output_tokens for r in records)
    assert m.total_input_tokens == sum(r.prompt_tokens for r in records)
    assert m.itl.count == sum(len(r.itl_s) for r in records)
    assert m.ttft.count == m.e2e.count == m.completed
    assert all(r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s for r in records)
    assert m.output_token_throughput == pytest.approx(m.total_output_tokens / m.duration_s)
    assert m.duration_s >= max(r.start_s + r.e2e_s for r in records) - 1e-6


cluster = cluster_fixture("bench", scope="class", **SMALL)  # one per test class: started by the first test using it


@pytest.mark.slow
class TestHarnessOnACluster:
    def test_grpc_run_adds_up_and_ttft_agrees_with_the_router_histogram(self, cluster):
        metrics_url = cluster.metrics_urls.get("router")
        assert metrics_url, f"the router has no /metrics: {cluster.metrics_urls}"
        settings = ServeSettings("grpc", cluster.url, TINY, RunConfig(max_concurrency=3, num_warmups=1, send=SEND),
                                 metrics_url=metrics_url)
        result = run_serve(settings, progress=False)
        assert_adds_up(result, planned=12)
        records = result.outcome.records
        assert all(r.prompt_tokens == len(req.prompt) for r, req in zip(records, TINY.build(), strict=False))
        assert all(len(r.itl_s) == r.output_tokens - 1 for r in records)  # one token per streamed message

        # the concurrency cap: at no send time were more than 3 requests in flight
        spans = [(r.start_s, r.start_s + r.e2e_s) for r in records]
        most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
        assert 1 < most <= 3, most

        # the router saw the same 12 requests (the warm-up came before the first scrape)
        assert result.server_histograms_error is None
        hist = result.server_histograms[TTFT]
        assert hist.count == result.metrics.completed == 12
        for q, client in ((0.5, result.metrics.ttft.median), (0.9, result.metrics.ttft.p90),
                          (0.99, result.metrics.ttft.p99)):
            low, high = hist.neighbour_bounds(*hist.quantile_bucket(q))
            assert low < client <= high, (q, client, hist.quantile_bucket(q), hist.bounds, hist.counts)
        # and the sums agree: the client waits a little longer than the router measures
        client_sum = sum(r.ttft_s for r in records)
        assert hist.total <= client_sum + 1e-3 and client_sum - hist.total < 0.05 * client_sum + 0.5

    def test_openai_http_run_adds_up(self, cluster):
        assert cluster.http_url, "the router serves no HTTP API"
        data = replace(TINY, num_prompts=8, seed=6)  # prompts of its own (a prefix cache would serve repeats faster)
        settings = ServeSettings("openai", cluster.http_url, data, RunConfig(max_concurrency=4, send=SEND))
        result = run_serve(settings, progress=False)
        assert_adds_up(result, planned=8)
        records = result.outcome.records
        assert all(r.prompt_tokens == len(req.prompt) for r, req in zip(records, data.build(), strict=False))

    def test_a_repeated_workload_adds_up_again(self, cluster):
        """The same 2 prompts of 3 full pages (+ 1 partial) twice: the second time their prefixes are cached
        (the prefill node must still send the cached pages, or the decode node waits for them in vain)."""
        data = DatasetSpec("fixed", 2, LengthRange(56), LengthRange(3), seed=7)
        for _ in range(2):
            result = run_serve(ServeSettings("grpc", cluster.url, data, RunConfig(send=SEND)), progress=False)
            assert_adds_up(result, planned=2)

    def test_the_duration_cap_stops_sending(self, cluster):
        data = DatasetSpec("fixed", 30, LengthRange(8), LengthRange(2), seed=1)
        run = RunConfig(request_rate=4.0, duration_s=1.0, seed=1, send=SEND)
        result = run_serve(ServeSettings("grpc", cluster.url, data, run), progress=False)
        assert 1 <= result.metrics.requests_sent <= 15 and result.outcome.not_sent >= 15
        assert all(r.start_s < 1.0 for r in result.outcome.records)
        assert_adds_up(result, planned=30)

    def test_serve_command_writes_the_result_and_the_plots(self, cluster, tmp_path, capsys):
        from pdserve.tools.bench.cli import main

        out = tmp_path / "serve.json"
        assert main(["serve", "--url", cluster.url, "--dataset", "prompts", "--num-prompts", "4",
                     "--output-len", "3", "--request-rate", "20", "--burstiness", "0.5", "--goodput", "ttft:60000",
                     "--result-json", str(out), "--plot-dir", str(tmp_path), "--no-progress"]) == 0
        table = capsys.readouterr().out
        assert "Per-user TPS, 1 / mean ITL" in table and "Goodput" in table
        data = json.loads(out.read_text())
        assert data["settings"]["dataset"]["kind"] == "prompts" and data["settings"]["burstiness"] == 0.5
        assert len(data["records"]) == 4 and data["metrics"]["completed"] == 4
        assert data["metrics"]["good_requests"] == 4  # a minute of TTFT is met by every request
        assert all(r["prompt_tokens"] > 5 and r["output_tokens"] == 3 for r in data["records"])  # server's counts
        for name in ("serve_ttft_cdf.png", "serve_itl_cdf.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_sweep_writes_one_result_per_rate_and_the_plot(self, cluster, tmp_path, capsys):
        from pdserve.tools.bench.cli import main

        prefix = tmp_path / "sweep"
        assert main(["sweep", "--url", cluster.url, "--dataset", "fixed", "--input-len", "8", "--output-len", "2",
                     "--num-prompts", "3", "--seed", "20", "--request-rates", "5,inf", "--output-prefix", str(prefix),
                     "--no-progress"]) == 0
        summary = json.loads(Path(f"{prefix}.json").read_text())
        assert summary["rates"] == ["5", "inf"] and [m["completed"] for m in summary["metrics"]] == [3, 3]
        for rate in ("5", "inf"):
            assert len(json.loads(Path(f"{prefix}_rate{rate}.json").read_text())["records"]) == 3
        assert Path(f"{prefix}.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_gives_both_setups_the_same_pinned_cores():
    settings = CompareSettings(dataset=TINY, prefill=1, decode=1, threads_per_node=1)
    col, dis = cluster_config(settings, "colocated"), cluster_config(settings, "disaggregated")
    assert (col.colocated, dis.prefill, dis.decode) == (2, 1, 1)
    for config in (col, dis):
        nodes = [s for s in plan(config, cores=[4, 5]) if s.role != "router"]
        assert sorted(s.cpus for s in nodes) == [(4,), (5,)]  # one core each, disjoint
        assert all(s.argv[s.argv.index("--threads") + 1] == "1" for s in nodes)
    with pytest.raises(ValueError, match="needs 4 cores"):
        plan(cluster_config(CompareSettings(dataset=TINY, threads_per_node=2), "colocated"), cores=[0, 1])
