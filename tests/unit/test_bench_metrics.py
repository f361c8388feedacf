"""The harness's arithmetic on hand-made timelines (L1, L2): records, metrics, goodput, arrivals,
datasets, the server-histogram reader and the comparison targets. No server; runs in a second."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from pdserve.tools.bench.arrivals import arrival_offsets
from pdserve.tools.bench.compare import DEFAULT_TARGETS, Target, comparison_rows, format_comparison
from pdserve.tools.bench.datasets import (
    SHIPPED_PROMPTS,
    BenchRequest,
    DatasetSpec,
    LengthRange,
    load_prompt_file,
    prompt_file_requests,
    random_requests,
)
from pdserve.tools.bench.metrics import LatencyStats, Slo, compute_metrics
from pdserve.tools.bench.prometheus import Histogram, SpecDecodeCounters
from pdserve.tools.bench.records import StreamTrace, record_from_trace
from pdserve.tools.bench.report import format_table, load_result, result_dict, spec_decode_rows, write_json

T0 = 10.0  # the benchmark's start on the trace clock


def trace(rid, sent, chunks, end, reason, prompt=None, completion=None, error=None, tokens=None):
    return StreamTrace(rid, sent, tuple(chunks), tuple(tokens or [1] * len(chunks)), end, reason, prompt, completion,
                       error)


def timeline():
    """A: 4 tokens (TTFT 0.5, gaps 0.1 0.2 0.3); B: 2 tokens (TTFT 1.0, gap 0.2); C: failed before any
    token; D: a single token (TTFT 0.3, no TPOT)."""
    return [
        record_from_trace(0, trace("a", 10.0, [10.5, 10.6, 10.8, 11.1], 11.1, "length", 100, 4), T0, 4),
        record_from_trace(1, trace("b", 10.2, [11.2, 11.4], 11.4, "stop", 50, 2), T0, 8),
        record_from_trace(2, trace("c", 10.4, [], 10.5, "error", error="server error: boom"), T0, 8, prompt_len=30),
        record_from_trace(3, trace("d", 10.0, [10.3], 10.3, "length", 10, 1), T0, 1),
    ]


def test_a_record_holds_ttft_itls_e2e_and_tpot():
    a, b, c, d = timeline()
    assert a.ttft_s == pytest.approx(0.5) and a.e2e_s == pytest.approx(1.1)
    assert a.itl_s == pytest.approx((0.1, 0.2, 0.3))
    assert a.tpot_s == pytest.approx((1.1 - 0.5) / 3) and a.output_tokens == 4 and a.prompt_tokens == 100
    assert b.start_s == pytest.approx(0.2) and b.ttft_s == pytest.approx(1.0) and b.tpot_s == pytest.approx(0.2)
    assert not c.success and c.ttft_s is None and c.tpot_s is None and c.error == "server error: boom"
    assert c.prompt_tokens == 30  # the dataset's count when the server sent no usage
    assert d.success and d.tpot_s is None and d.itl_s == ()


def test_usage_missing_falls_back_to_streamed_tokens_and_a_missing_finish_is_an_error():
    r = record_from_trace(0, trace("x", 0.0, [1.0, 2.0], 2.5, "length", tokens=[2, 3]), 0.0, 5, prompt_len=7)
    assert r.output_tokens == 5 and r.prompt_tokens == 7 and r.tpot_s == pytest.approx(1.5 / 4)
    broken = record_from_trace(1, trace("y", 0.0, [1.0], 1.5, None), 0.0, 5, prompt_len=7)
    assert not broken.success and "finish_reason None" in broken.error


def test_a_trace_whose_times_go_backwards_is_rejected():
    with pytest.raises(ValueError, match="times go backwards"):
        trace("z", 5.0, [4.0], 6.0, "stop")
    with pytest.raises(ValueError, match="2 chunk times but 1"):
        StreamTrace("z", 0.0, (1.0, 2.0), (1,), 3.0, "stop")


def test_metrics_of_the_timeline():
    m = compute_metrics(timeline(), duration_s=2.0)
    assert (m.requests_sent, m.completed, m.failed) == (4, 3, 1)
    assert m.finish_reasons == {"error": 1, "length": 2, "stop": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (160, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_token_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(83.5)
    # ITL pooled over A and B: 0.1 0.2 0.3 0.2 -> mean 0.2 s -> 5 tokens/s per user
    assert m.itl.count == 4 and m.itl.mean == pytest.approx(0.2) and m.per_user_tps == pytest.approx(5.0)
    assert m.itl.median == pytest.approx(0.2)
    assert m.itl.p90 == pytest.approx(0.27) and m.itl.p99 == pytest.approx(0.297)  # linear between order stats
    assert m.ttft.count == 3 and m.ttft.mean == pytest.approx(0.6) and m.ttft.median == pytest.approx(0.5)
    assert m.ttft.max == pytest.approx(1.0) and m.ttft.min == pytest.approx(0.3)
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(0.2)  # D has no TPOT, C failed
    assert m.e2e.count == 3 and m.e2e.median == pytest.approx(1.1)
    assert m.goodput is None and m.good_requests is None


@pytest.mark.parametrize("slo, good", [
    (["ttft:600", "tpot:150"], 1),   # A: TPOT 200 ms too slow; B: TTFT 1 s too slow; D: no TPOT, passes
    (["ttft:600"], 2),               # A and D
    (["tpot:250"], 3),               # every completed request
    (["e2el:1150"], 2),              # A (1.1 s) and D (0.3 s); B took 1.2 s
    (["ttft:100"], 0),
])
def test_goodput_counts_completed_requests_meeting_every_slo(slo, good):
    m = compute_metrics(timeline(), duration_s=2.0, slo=Slo.parse(slo))
    assert m.good_requests == good and m.goodput == pytest.approx(good / 2.0)


def test_slo_parsing_names_the_bad_item():
    assert Slo.parse(["ttft:2000", "tpot:50.5"]) == Slo(ttft_ms=2000, tpot_ms=50.5)
    for items, match in ((["ttft"], "KEY:MS"), (["itl:5"], "KEY:MS"), (["ttft:fast"], "'fast' is not a number"),
                         (["ttft:5", "ttft:6"], "given twice"), (["tpot:-1"], "tpot must be")):
        with pytest.raises(ValueError, match=match):
            Slo.parse(items)


def test_metrics_of_nothing_completed_and_bad_durations():
    _, _, c, _ = timeline()
    m = compute_metrics([c], duration_s=1.0)
    assert m.completed == 0 and m.per_user_tps is None and m.ttft == LatencyStats.of([])
    assert m.request_throughput == 0 and m.ttft.mean is None
    with pytest.raises(ValueError, match="duration must be > 0"):
        compute_metrics(timeline(), duration_s=0.0)


def test_arrivals_are_seeded_with_the_asked_mean_and_burstiness():
    a = arrival_offsets(20000, rate=4.0, burstiness=1.0, seed=3)
    assert a == arrival_offsets(20000, rate=4.0, burstiness=1.0, seed=3) and a[0] == 0.0
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert min(gaps) >= 0 and statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    b = arrival_offsets(20000, rate=4.0, burstiness=4.0, seed=3)
    regular = [y - x for x, y in zip(b, b[1:], strict=False)]
    assert statistics.fmean(regular) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(regular) / statistics.fmean(regular) == pytest.approx(0.5, rel=0.05)  # gamma k=4
    assert arrival_offsets(3, rate=math.inf) == [0.0, 0.0, 0.0]
    for kwargs, match in ((dict(rate=0.0), "request rate"), (dict(rate=1.0, burstiness=0.0), "burstiness")):
        with pytest.raises(ValueError, match=match):
            arrival_offsets(3, **kwargs)


def test_random_requests_are_seeded_and_within_their_ranges():
    reqs = random_requests(50, LengthRange(10, 20), LengthRange(3, 5), seed=7)
    assert reqs == random_requests(50, LengthRange(10, 20), LengthRange(3, 5), seed=7)
    assert reqs != random_requests(50, LengthRange(10, 20), LengthRange(3, 5), seed=8)
    assert {len(r.prompt) for r in reqs} <= set(range(10, 21)) and len({len(r.prompt) for r in reqs}) > 5
    assert {r.max_tokens for r in reqs} == {3, 4, 5}
    assert all(r.prompt_len == len(r.prompt) and min(r.prompt) >= 17 for r in reqs)
    fixed = DatasetSpec("fixed", 4, LengthRange(8), LengthRange(2)).build()
    assert [(len(r.prompt), r.max_tokens) for r in fixed] == [(8, 2)] * 4
    assert "ids[8]" in repr(fixed[0]) and str(fixed[0].prompt[0]) not in repr(fixed[0])  # lengths, not tokens


def test_lengths_and_dataset_specs_name_bad_values():
    assert LengthRange.parse("512:2048") == LengthRange(512, 2048) and LengthRange.parse("7").fixed
    for text in ("", "a", "1:2:3", "5:4", "0"):
        with pytest.raises(ValueError):
            LengthRange.parse(text)
    with pytest.raises(ValueError, match="fixed takes single lengths"):
        DatasetSpec("fixed", 2, LengthRange(1, 4), LengthRange(2))
    with pytest.raises(ValueError, match="jsonl needs a file path"):
        DatasetSpec("jsonl", 2)
    with pytest.raises(ValueError, match="dataset must be one of"):
        DatasetSpec("sharegpt", 2)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        BenchRequest(0, "hi", 0, None)


def test_the_shipped_prompt_set_loads_and_is_varied():
    items = load_prompt_file(SHIPPED_PROMPTS)
    assert len(items) >= 40 and len({p for p, _ in items}) == len(items)
    assert all(isinstance(p, str) and m is not None for p, m in items)
    reqs = DatasetSpec("prompts", len(items) + 3, seed=1).build()
    assert {r.prompt for r in reqs[:len(items)]} == {p for p, _ in items}  # every prompt once before repeats
    assert all(r.prompt_len is None for r in reqs)  # text: the server counts its tokens


def test_a_jsonl_file_with_errors_names_its_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [5, 6, 7]}\n')
    reqs = prompt_file_requests(good, 2, LengthRange(9), seed=0)
    assert sorted(r.max_tokens for r in reqs) == [9, 9] and {r.prompt_len for r in reqs} == {None, 3}
    with pytest.raises(ValueError, match='no "max_tokens"'):
        prompt_file_requests(good, 2, None, seed=0)
    for body, match in (('{"prompt": "a"}\nnot json\n', "bad.jsonl:2: not JSON"),
                        ('{"text": "a"}\n', 'bad.jsonl:1: each line must be an object with a "prompt"'),
                        ('{"prompt": ""}\n', "bad.jsonl:1"), ('{"prompt": "a", "max_tokens": 0}\n', "max_tokens"),
                        ("\n", "has no prompts")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(ValueError, match=match):
            load_prompt_file(bad)


EXPOSITION = """# HELP pdserve:time_to_first_token_seconds Seconds from receiving a request to sending its first generated token.
# TYPE pdserve:time_to_first_token_seconds histogram
pdserve:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {a}
pdserve:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {b}
pdserve:time_to_first_token_seconds_bucket{{le="1.0",model_name="m"}} {c}
pdserve:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {d}
pdserve:time_to_first_token_seconds_count{{model_name="m"}} {d}
pdserve:time_to_first_token_seconds_sum{{model_name="m"}} {s}
"""  # noqa: E501 (the HELP line, as the router writes it)


def test_server_histograms_are_read_subtracted_and_located():
    before = Histogram.from_text(EXPOSITION.format(a=1, b=1, c=2, d=2, s=1.0), "pdserve:time_to_first_token_seconds")
    after = Histogram.from_text(EXPOSITION.format(a=3, b=9, c=11, d=12, s=9.0), "pdserve:time_to_first_token_seconds")
    run = after.minus(before)
    assert run.bounds == (0.1, 0.5, 1.0, math.inf) and run.counts == (2, 8, 9, 10) and run.total == pytest.approx(8.0)
    assert run.quantile_bucket(0.2) == (0.0, 0.1)     # rank 2 of 10
    assert run.quantile_bucket(0.5) == (0.1, 0.5)
    assert run.quantile_bucket(0.9) == (0.5, 1.0)
    assert run.quantile_bucket(0.99) == (1.0, math.inf)
    assert run.neighbour_bounds(0.1, 0.5) == (0.0, 1.0) and run.neighbour_bounds(0.5, 1.0) == (0.1, math.inf)
    with pytest.raises(ValueError, match="no histogram 'nope'"):
        Histogram.from_text(EXPOSITION.format(a=1, b=1, c=1, d=1, s=0), "nope")


SPEC_EXPOSITION = """# HELP pdserve:spec_decode_num_drafts_total Speculative drafts verified.
# TYPE pdserve:spec_decode_num_drafts_total counter
pdserve:spec_decode_num_drafts_total{{model_name="m"}} {drafts}
# TYPE pdserve:spec_decode_num_draft_tokens_total counter
pdserve:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}
pdserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}
# TYPE pdserve:spec_decode_num_accepted_tokens_per_pos counter
{per_pos}"""  # TYPE lines as the node writes them, one missing, one spelt without _total: all read alike


def spec_text(drafts, tokens, accepted, per_pos):
    lines = "".join(f'pdserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {c}\n'
                    for i, c in enumerate(per_pos))
    return SPEC_EXPOSITION.format(drafts=drafts, tokens=tokens, accepted=accepted, per_pos=lines)


def test_spec_decode_counters_are_read_subtracted_and_reported():
    before = SpecDecodeCounters.from_text(spec_text(5, 20, 10, (4, 3, 2, 1)))
    after = SpecDecodeCounters.from_text(spec_text(25, 100, 70, (20, 19, 17, 14)))
    run = after.minus(before)
    assert run == SpecDecodeCounters(20, 80, 60, (16, 16, 15, 13))
    assert run.acceptance_rate == pytest.approx(0.75)          # accepted / draft tokens
    assert run.mean_acceptance_length == pytest.approx(4.0)    # 1 + accepted / drafts
    assert run.per_position_rate == pytest.approx((0.8, 0.8, 0.75, 0.65))
    # positions first counted between the scrapes, and a first scrape that had no counters at all
    assert SpecDecodeCounters.from_text(spec_text(1, 2, 1, (1, 0))).minus(
        SpecDecodeCounters.from_text(spec_text(0, 0, 0, ()))) == SpecDecodeCounters(1, 2, 1, (1, 0))
    assert after.minus(None) == after
    rows = dict(spec_decode_rows(run))
    assert rows["Spec decode acceptance rate (accepted / drafted)"] == "0.750"
    assert rows["Spec decode mean acceptance length (1+acc/drafts)"] == "4.000"
    assert rows["Spec decode acceptance rate by position"] == "0.800 0.800 0.750 0.650"
    table = format_table(compute_metrics(timeline(), 2.0), "t", footer=spec_decode_rows(run))
    assert "Spec decode acceptance rate (accepted / drafted)" in table and "0.750" in table
    assert run.to_json()["acceptance_rate"] == pytest.approx(0.75)
    # a server without the counters (the router), or a run with no draft: nothing to report
    router = EXPOSITION.format(a=1, b=1, c=2, d=2, s=1.0)
    assert SpecDecodeCounters.from_text(router) is None
    assert spec_decode_rows(None) == [] and spec_decode_rows(after.minus(after)) == []
    assert "Spec decode" not in format_table(compute_metrics(timeline(), 2.0), "t")
    zero = after.minus(after)
    assert zero.acceptance_rate is None and zero.mean_acceptance_length is None and zero.per_position_rate == ()


def test_spec_decode_counters_are_summed_over_the_scraped_endpoints():
    """Two nodes' /metrics on loopback (and the router's, without counters) add up; each URL once."""
    import http.server
    import threading

    from pdserve.tools.bench.serve import ServeSettings, _scrape_spec

    pages = {"/a": spec_text(4, 16, 8, (3, 2, 2, 1)), "/b": spec_text(6, 12, 9, (5, 4, 0)),
             "/router": EXPOSITION.format(a=1, b=1, c=2, d=2, s=1.0)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages[self.path].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        nodes = (f"{base}/a", f"{base}/b", f"{base}/a")
        settings = ServeSettings("grpc", "x:1", DatasetSpec("random", 1, LengthRange(4), LengthRange(2)),
                                 metrics_url=f"{base}/router", spec_metrics_urls=nodes)
        assert settings.spec_urls == (f"{base}/router", f"{base}/a", f"{base}/b")
        assert _scrape_spec(settings.spec_urls) == SpecDecodeCounters(10, 28, 17, (8, 6, 2, 1))
        assert _scrape_spec((f"{base}/router",)) is None
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_table_and_the_result_json_round_trip(tmp_path):
    records = timeline()
    m = compute_metrics(records, 2.0, Slo(ttft_ms=600))
    table = format_table(m, "t")
    for label in ("Output token throughput, system TPS", "Per-user TPS, 1 / mean ITL", "Goodput", "TTFT", "ITL"):
        assert label in table
    assert "3.50" in table and "5.00" in table  # system TPS and per-user TPS
    path = write_json(tmp_path / "r.json", result_dict("serve", {"x": 1}, m, records, machine={"nproc": 2}))
    data, back = load_result(path)
    assert back == records and data["metrics"]["per_user_tps"] == pytest.approx(5.0)
    assert data["metrics"]["finish_reasons"] == {"error": 1, "length": 2, "stop": 1}
    (tmp_path / "other.json").write_text(json.dumps({"schema": "x"}))
    with pytest.raises(ValueError, match="not a pdserve-bench/1 result"):
        load_result(tmp_path / "other.json")


def test_comparison_ratios_and_target_margins():
    col = compute_metrics(timeline(), 2.0)
    faster = [record_from_trace(0, trace("a", 10.0, [10.6, 10.65, 10.7, 10.75], 10.75, "length", 100, 4), T0, 4)]
    dis = compute_metrics(faster, 1.0)
    rows = comparison_rows(col, dis)
    assert rows["per-user TPS"] == (pytest.approx(5.0), pytest.approx(20.0), pytest.approx(4.0))
    assert rows["ITL p99"][2] == pytest.approx(0.05 / 0.297)
    assert rows["TTFT p50"][2] == pytest.approx(0.6 / 0.5)
    checks = [t.check(rows[t.metric][2]) for t in DEFAULT_TARGETS]
    assert [c["met"] for c in checks] == [True, True, True]
    assert checks[0]["margin"] == "met with 2.50x the bound"
    missed = Target("TTFT p50", 1.0, at_least=False).check(1.2)
    assert not missed["met"] and missed["margin"].startswith("missed by a factor 1.20")
    assert not Target("per-user TPS", 1.6, True).check(None)["met"]
    text = format_comparison(rows, checks)
    assert "per-user TPS" in text and "4.000x" in text and "MET" in text


def test_a_comparison_of_hand_made_runs_renders_as_json_and_markdown():
    from pdserve.tools.bench.cli import compare_markdown
    from pdserve.tools.bench.compare import CompareResult, CompareSettings
    from pdserve.tools.bench.runner import RunConfig, RunOutcome
    from pdserve.tools.bench.serve import ServeResult, ServeSettings

    spec = DatasetSpec("random", 4, LengthRange(512, 2048), LengthRange(128, 256))
    settings = CompareSettings(dataset=spec, run=RunConfig(request_rate=0.05, duration_s=180))
    machine = {"load_average": [0.5, 0.6, 0.7], "nproc": 2, "cpu": "cpu", "commit": "abc", "date": "today"}
    results = {}
    for name, duration in (("colocated", 2.0), ("disaggregated", 4.0)):
        records = tuple(timeline())
        results[name] = ServeResult(ServeSettings("grpc", "x:1", spec, settings.run),
                                    RunOutcome(records, duration, 4, 0), compute_metrics(records, duration),
                                    machine, machine)
    rows = comparison_rows(results["colocated"].metrics, results["disaggregated"].metrics)
    targets = [t.check(rows[t.metric][2]) for t in settings.targets]
    result = CompareResult(settings, results, {"colocated": ["a"], "disaggregated": ["b", "c"]}, targets)
    data = json.loads(json.dumps(result.to_json()))
    side = {row["metric"]: row for row in data["side_by_side"]}
    assert side["request throughput"]["ratio"] == pytest.approx(0.5)  # same requests in twice the time
    assert side["per-user TPS"]["ratio"] == pytest.approx(1.0)
    assert [t["met"] for t in data["targets"]] == [False, False, True]
    assert len(data["runs"]["disaggregated"]["records"]) == 4
    md = compare_markdown(result, format_comparison(rows, targets), "pdserve bench compare")
    assert "prompts 512:2048 tokens, outputs 128:256 tokens" in md and "0.05 req/s" in md
    assert "[0.5, 0.6, 0.7] before" in md and "  - `c`" in md and "MISSED" in md
