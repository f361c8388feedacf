"""Smoke runs of the cluster benchmarks (bench.cluster.*): each starts its real clusters (router,
prefill and decode node processes, or two colocated nodes) on the tiny checkpoint and sends one
or two short requests; each report is checked for the numbers it promises."""

from __future__ import annotations

import pytest
from bench_smoke import assert_json_stamped, assert_stamped, positive

pytestmark = [pytest.mark.integration, pytest.mark.slow]   # clusters of processes

SMALL_CLUSTER = ("--num-blocks", "64", "--max-batch-tokens", "64", "--startup-timeout-s", "150")


def test_disagg_ttft(bench, tiny_model):
    run = bench("bench.cluster.disagg_ttft", "--lengths", "24", "--repeats", "1", "--model", tiny_model,
                *SMALL_CLUSTER, "--results-dir", "{out}")
    (row,) = run.json("disagg_ttft")["rows"]
    assert row["prompt_tokens"] == 24 and len(row["samples"]) == 1
    for key in ("client_ttft_s", "server_ttft_s", "prefill_compute_s", "first_decode_step_s"):
        assert positive(row[key]), (key, row)
    assert row["queue_s"] >= 0 and row["transfer_tail_s"] >= 0 and row["tail_pct_of_ttft"] >= 0
    assert_json_stamped(run.json("disagg_ttft"), "bench.cluster.disagg_ttft")
    md = run.md("disagg_ttft")
    assert "| 24 |" in md
    assert_stamped(md, "bench.cluster.disagg_ttft")


def test_kv_checksum_ttft(bench, tiny_model):
    run = bench("bench.cluster.kv_checksum_ttft", "--lengths", "24", "--repeats", "1", "--rounds", "1",
                "--model", tiny_model, *SMALL_CLUSTER, "--results-dir", "{out}")
    (row,) = run.json("kv_checksum")["rows"]
    assert row["prompt_tokens"] == 24 and row["samples"] == 1
    for mode in ("off", "on"):
        assert all(positive(v) for v in row[mode].values()), row[mode]
    assert positive(row["hash_ms"]) and positive(row["hash_mb"]) and "paired_server_delta_p50_ms" in row
    assert_stamped(run.md("kv_checksum"), "bench.cluster.kv_checksum_ttft")


def test_prefix_routing(bench, tiny_model):
    run = bench("bench.cluster.prefix_routing", "--families", "2", "--rounds", "2", "--prefix-words", "40",
                "--concurrency", "2", "--max-tokens", "2", "--num-blocks", "64", "--max-batch-tokens", "128",
                "--policies", "prefix", "--seeds", "0", "--model", tiny_model, "--results-dir", "{out}")
    data = run.json("prefix_routing")
    (result,) = data["results"]
    (pooled,) = data["summary"]
    assert result["policy"] == pooled["policy"] == "prefix" and result["requests"] == 4
    assert 0 < result["prefix_cache_hit_rate"] <= 1, result["prefix_cache_hit_rate"]   # round 2 hits round 1
    for key in ("mean_ttft_s", "mean_ttft_warm_rounds_s", "p50_ttft_s", "p90_ttft_s", "wall_s"):
        assert positive(result[key]), (key, result[key])
    assert_json_stamped(data, "bench.cluster.prefix_routing")
