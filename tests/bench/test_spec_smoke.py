"""Smoke runs of the speculative-decoding benchmarks (bench.spec.*) on their smallest workloads:
the tiny checkpoint in one engine (decode, phases, control A/B) and in one 1P+1D cluster
(eagle_handoff), the default model where the shipped head needs it (agreement, history), and the
draft-prompt set writer. Each
report is checked for the fields and numbers it promises, greedy equality with plain included."""

from __future__ import annotations

import importlib.util
import json

import pytest
from bench_smoke import assert_json_stamped, assert_stamped, positive

pytestmark = pytest.mark.integration   # whole models, processes: the integration suite's kind


def test_decode_plain_and_ngram(bench, tiny_model):
    run = bench("bench.spec.decode", "--model", tiny_model, "--configs", "ngram-k2-n1", "--workloads", "repetition",
                "--rounds", "1", "--max-tokens", "4", "--batch", "2", "--batch-max-tokens", "2", "--threads", "1",
                "--update", "--results-dir", "{out}")
    data = run.json("spec_decode")
    assert data["mismatches"] == []
    assert {(r["config"], r["batch"]) for r in data["rows"]} == {(c, b) for c in ("plain", "ngram-k2-n1")
                                                                for b in (1, 2)}
    for r in data["rows"]:
        assert positive(r["tps"]) and r["workload"] == "repetition" and r["mismatches"] == 0, r
        assert r["config"] == "plain" or r["draft_tokens"] >= r["accepted"] >= 0, r
    assert {g["goal"] for g in data["goals"]}, data["goals"]
    assert_json_stamped(data, "bench.spec.decode")
    assert_stamped(run.md("spec_decode"), "bench.spec.decode")


def test_phases(bench, tiny_model, tmp_path):
    out = tmp_path / "spec_phases.md"
    run = bench("bench.spec.phases", "--model", tiny_model, "--workload", "repetition", "--rounds", "1",
                "--tokens", "3", "--batch", "2", "--passes", "--out", str(out))
    md = out.read_text()
    for config in ("plain", "ngram K=2 n=1..4", "ngram K=8 n=1..4"):
        row = next(line for line in md.splitlines() if line.startswith(f"| {config} |"))
        assert row.count("|") == 11, row
    assert "Passes of the last round by query tokens" in md and "batch 2" in md
    assert_stamped(md, "bench.spec.phases")
    assert "MISMATCH" not in run.stdout


def test_control_ab_against_the_same_control(bench, tiny_model):
    spec = importlib.util.find_spec("pdserve.engine.spec_decode.control")
    assert spec is not None and spec.origin is not None
    run = bench("bench.spec.control_ab", "--model", tiny_model, "--old", spec.origin, "--rounds", "1",
                "--tokens", "2", "--batch", "2", "--results-dir", "{out}")
    assert "MISMATCH" not in run.stdout
    md = run.md("spec_control_ab")
    for config in ("plain", "ngram-k2-n1 new", "ngram-k2-n1 old", "self-k4-K2 new", "self-k4-K2 old"):
        assert f"| {config} | " in md, config
    assert_stamped(md, "bench.spec.control_ab")


@pytest.mark.slow
def test_eagle_handoff_one_cluster(bench, tiny_model):
    run = bench("bench.spec.eagle_handoff", "--configs", "none", "--rounds", "1", "--max-tokens", "2",
                "--batch", "2", "--num-blocks", "64", "--model", tiny_model, "--startup-timeout-s", "150",
                "--update", "--results-dir", "{out}")
    data = run.json("eagle_handoff")
    assert data["mismatches"] == [] and {r["batch"] for r in data["rows"]} == {1, 2}
    for r in data["rows"]:
        assert r["config"] == "none" and r["requests"] > 0, r
        assert positive(r["ttft_ms"]["median"]) and positive(r["second_token_ms"]["median"]), r
    assert_json_stamped(data, "bench.spec.eagle_handoff")
    assert_stamped(run.md("eagle_handoff"), "bench.spec.eagle_handoff")


def test_eagle_agreement_of_the_shipped_head(bench):
    from pdserve.model.eagle_config import load_target_vocab, shipped_head_for
    from pdserve.model.loader import resolve_model

    try:
        head = shipped_head_for(load_target_vocab(resolve_model(None).path).identity)
    except ValueError as e:   # no head ships for the default model
        pytest.skip(str(e))
    run = bench("bench.spec.eagle_agreement", str(head), "--max-new-tokens", "4", "--prompts", "1",
                "--results-dir", "{out}")
    data = run.json("eagle_agreement")
    assert {r["workload"] for r in data["rows"]} == {"repetition", "prose"}
    for r in data["rows"]:
        assert r["positions"] > 0 and 0 <= r["agreement"] <= 1, r
    assert_stamped(run.md("eagle_agreement"), "bench.spec.eagle_agreement")


def test_context_history(bench):
    run = bench("bench.spec.context_history", "--repeats", "3", "--update", "--results-dir", "{out}")
    md = run.md("context_history")
    assert md.count("\n| ") >= 3 and "history_kv " in md and "bytes larger than B's" in md
    assert_stamped(md, "bench.spec.context_history")


def test_draft_prompts(bench, tmp_path):
    out = tmp_path / "draft_prompts.jsonl"
    bench("bench.spec.draft_prompts", "--out", str(out))
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) > 48 and len(set(prompts)) == len(prompts) and all(prompts)
