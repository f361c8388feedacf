"""Smoke runs of the tensor-parallel benchmarks (bench.tp.*): TP 2 against TP 1 in one process and
the TP-invariant fold A/B on the tiny checkpoint, and the pairs bench's write-count part (pure
arithmetic on the default model's geometry; its cluster part starts one cluster per TP pair and is
left to real runs). Each report is checked for the numbers it promises."""

from __future__ import annotations

import pytest
from bench_smoke import assert_json_stamped, assert_stamped

pytestmark = pytest.mark.integration   # TP 2 worker processes: the integration suite's kind

TINY_PASSES = ("--rounds", "2", "--prefill-tokens", "16", "--batch", "2", "--ctx", "8", "--steps", "2",
               "--threads", "1")


@pytest.mark.slow
def test_tp2_against_tp1(bench, tiny_model):
    run = bench("bench.tp.ab", *TINY_PASSES, "--model", tiny_model, "--results-dir", "{out}")
    md = run.md("tp_ab")
    for phase in ("prefill", "decode"):   # the lines bench.tp.pairs parses
        assert f"\n{phase}: TP1 " in md and "(paired median TP2 - TP1 " in md and "TP2 leader in collectives" in md
    assert "greedy tokens identical: True" in md
    assert_stamped(md, "bench.tp.ab")


def test_tp_invariant_fold(bench, tiny_model):
    run = bench("bench.tp.invariant_ab", *TINY_PASSES, "--loop", "--model", tiny_model, "--results-dir", "{out}")
    md = run.md("tp_invariant_ab")
    for phase in ("prefill", "decode"):
        for mode in ("blocked", "loop"):
            assert f"\n{phase}: {mode} " in md and "same greedy tokens as plain in " in md, (phase, mode)
        assert f"\n{phase}: paired blocked (bmm) - loop median " in md
    assert "blocked == loop tokens in 2/2 rounds" in md
    assert_stamped(md, "bench.tp.invariant_ab")


def test_pairs_write_counts(bench):
    run = bench("bench.tp.pairs", "--parts", "b", "--pairs", "1:1,2:1", "--lengths", "64", "--repeats", "1",
                "--results-dir", "{out}")
    data = run.json("tp_pairs")
    assert data["pairs"] is None and data["tp_ab"] is None
    writes = {w["pair"]: w for w in data["writes"]}
    assert {"P1->D1", "P2->D1"} <= set(writes), sorted(writes)
    for w in writes.values():
        assert w["prompt_tokens"] == 64 and w["hnd_writes"] > 0 and w["nhd_writes"] >= w["hnd_writes"], w
    assert_json_stamped(data, "bench.tp.pairs")
    assert_stamped(run.md("tp_pairs"), "bench.tp.pairs")
