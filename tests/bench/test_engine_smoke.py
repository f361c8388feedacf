"""Smoke runs of the engine benchmarks (bench.engine.*): each module as a real subprocess on its
smallest workload (the tiny checkpoint, a few tokens, one or two rounds), asserting that its report
has every field and number it promises, so the next signature change breaks here first.

The two-tree A/Bs run this checkout against itself (base = head), which still runs both workers."""

from __future__ import annotations

import pytest
from bench_smoke import ROOT, assert_json_stamped, assert_stamped, positive
from support import native

from pdserve.kernels.attention import cpu_kernels
from pdserve.kernels.ops import linear as ops_linear

pytestmark = pytest.mark.integration   # processes, whole models: the integration suite's kind


def test_throughput_pdserve_and_static_generate(bench, tiny_model):
    """The command of issue 30's rot (`--systems pdserve,hf-static`), decode-step part included."""
    run = bench("bench.engine.throughput", "--systems", "pdserve,hf-static", "--model", tiny_model,
                "--num-requests", "3", "--output-len", "4", "--min-prompt", "8", "--max-prompt", "16",
                "--decode-batch", "2", "--decode-steps", "2", "--threads", "1", "--tag", "smoke",
                "--results-dir", "{out}")
    data = run.json("engine_throughput-smoke")
    assert set(data["systems"]) == {"pdserve", "hf-static"}
    for system in data["systems"].values():
        assert system["output_tokens"] == 3 * 4 and positive(system["tokens_per_s"]), system
    step = data["decode_step"]
    for key in ("step_s", "matmul_s", "attention_s", "torch_matmul_s", "step_over_matmul_paired"):
        assert positive(step[key]), (key, step)
    assert step["batch"] == 2 and step["timed_steps"] == 2
    verdicts = {t["target"].split(" >= ")[-1].split(" <= ")[0]: t["verdict"] for t in data["targets"]}
    assert verdicts["5x hf-cb"] == "n/a" and data["targets"][1]["verdict"] in ("PASS", "MISS"), data["targets"]
    assert_json_stamped(data, "bench.engine.throughput")
    md = run.md("engine_throughput-smoke")
    assert "| pdserve |" in md and "| hf-static |" in md and "whole engine.step()" in md
    assert_stamped(md, "bench.engine.throughput")


def test_passes_ab_of_two_trees(bench, tiny_model):
    run = bench("bench.engine.passes_ab", "--old", str(ROOT), "--new", str(ROOT), "--rounds", "2",
                "--prefill-tokens", "16", "--batch", "2", "--ctx", "8", "--steps", "2", "--threads", "1",
                "--model", tiny_model, "--results-dir", "{out}")
    md = run.md("passes_ab")
    for op in ("prefill", "decode"):
        row = next(line for line in md.splitlines() if line.startswith(f"| {op} |"))
        assert row.count("|") == 6 and "of 2 rounds" in row, row
    assert "greedy tokens identical in every round: True" in md
    assert_stamped(md, "bench.engine.passes_ab")


def test_layer_loop_ab_of_two_trees(bench, tiny_model):
    run = bench("bench.engine.layer_loop_ab", "--old", str(ROOT), "--new", str(ROOT), "--rounds", "2",
                "--batch", "2", "--ctx", "8", "--steps", "2", "--threads", "1", "--model", tiny_model,
                "--results-dir", "{out}")
    md = run.md("layer_loop_ab")
    assert "median step: old " in md and "new faster in " in md and "of 2 rounds" in md
    assert "generated tokens identical: True" in md
    assert_stamped(md, "bench.engine.layer_loop_ab")


@native.skip_unless_built(cpu_kernels.available(), "the C attention kernels", cpu_kernels.unavailable_reason())
def test_attention_kernels_quick(bench):
    run = bench("bench.engine.attention_kernels", "--quick", "--threads", "1", "--results-dir", "{out}")
    md = run.md("attention_kernels")
    for section in ("### KV-cache dtype", "### Decode", "### Prefill chunk"):
        assert section in md, section
    assert "| float32 / float32 | 32 | 512 |" in md and "| float32 / float32 | 128 | 512 |" in md
    assert_stamped(md, "bench.engine.attention_kernels")


@native.skip_unless_built(ops_linear.available(), "the C linear kernel", ops_linear.unavailable_reason())
def test_linear_kernels(bench):
    run = bench("bench.engine.linear_kernels", "--layers", "1", "--rows", "1,2", "--repeats", "1", "--record",
                "--tag", "smoke", "--results-dir", "{out}")
    md = run.md("linear_kernels-smoke")
    rows = [line for line in md.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and all(line.count("|") == 7 for line in rows), rows
    assert_stamped(md, "bench.engine.linear_kernels")


def test_prefix_cache(bench, tiny_model):
    run = bench("bench.engine.prefix_cache", "--prefix-tokens", "64", "--requests", "3", "--threads", "1",
                "--model", tiny_model, "--results-dir", "{out}")
    data = run.json("prefix_cache")
    off, on = data["runs"]
    assert not off["allow_block_sharing"] and on["allow_block_sharing"]
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"] and on["hit_rate"] > 0, data
    assert positive(off["seconds"]) and data["requests_timed"] == 2
    assert_json_stamped(data, "bench.engine.prefix_cache")


def test_decode_bandwidth_reports_the_stream_and_the_profile(bench, tiny_model):
    run = bench("bench.engine.decode_bandwidth", "--model", tiny_model, "--batches", "1,2", "--steps", "2",
                "--ctx", "8", "--threads", "1", "--array-mb", "8", "--bw-repeats", "1", "--tag", "smoke",
                "--results-dir", "{out}")
    data = run.json("decode_bandwidth-smoke")
    assert len(data["bandwidth"]) == 3   # before each batch size, and at the end
    for bw in data["bandwidth"]:
        assert positive(bw["read_gbs"]) and positive(bw["triad_gbs"]), bw
    assert positive(data["weight_bytes"]) and data["target_fraction"] == 0.85
    assert [p["batch"] for p in data["points"]] == [1, 2]
    for p in data["points"]:
        for key in ("step_s", "execute_s", "forward_s", "build_batches_s", "attention_s", "kv_write_s", "sample_s",
                    "kernel_matmul_s", "small_ops_s", "matmul_s", "weight_stream_gbs", "fraction_of_read",
                    "kernel_stream_gbs", "kernel_fraction_of_read", "outside_matmul_share"):
            assert positive(p[key]), (key, p)
        assert p["weight_stream_gbs"] == pytest.approx(data["weight_bytes"] / p["step_s"] / 1e9)
        assert p["kernel_matmul_s"] < p["forward_s"] < p["execute_s"] < p["step_s"], p
        assert p["timed_steps"] == 2 and 0 < p["outside_matmul_share"] < 1, p
    assert_json_stamped(data, "bench.engine.decode_bandwidth")
    md = run.md("decode_bandwidth-smoke")
    assert "| 1 |" in md and "| 2 |" in md and "## Where a batch-1 step goes" in md and "Outside the matmuls: " in md
    for label in ("whole engine.step()", "attention backend", "sampler", "build_batches"):
        assert label in md, label
    assert_stamped(md, "bench.engine.decode_bandwidth")
