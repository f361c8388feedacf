"""The `pdserve` command line, run as a real process (E21: `pdserve simulate` prints the seed's
static vs continuous batching numbers)."""

from __future__ import annotations

import json
import subprocess
import sys

PDSERVE = [sys.executable, "-m", "pdserve.tools.cli"]


def test_simulate_reproduces_the_seed_numbers():
    out = subprocess.run(PDSERVE + ["simulate", "--output-lengths", "5,50,8,12,40,3,30,7", "--slots", "4", "--json"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout) == {
        "static": {"steps": 90, "slot_utilization": 0.43},
        "continuous": {"steps": 50, "slot_utilization": 0.78},
    }
    text = subprocess.run(PDSERVE + ["simulate"], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "90 decode steps, 43%" in text and "50 decode steps, 78%" in text


def test_generate_json_matches_the_python_api(default_source):
    from pdserve import LLM, SamplingParams

    prompts = ["The capital of France is", "def add(a, b):"]
    out = subprocess.run(PDSERVE + ["generate", "--json", "--max-tokens", "10", "--num-blocks", "64", *prompts],
                         capture_output=True, text=True, check=True, timeout=300)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    expected = LLM(num_blocks=64).generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    assert [set(d) for d in lines] == [{"text", "token_ids", "finish_reason"}] * 2
    for d, e in zip(lines, expected, strict=True):
        assert d == {"text": e.text, "token_ids": list(e.token_ids), "finish_reason": e.finish_reason}


def test_generate_streams_text_and_reports_bad_input():
    out = subprocess.run(PDSERVE + ["generate", "--max-tokens", "6", "--num-blocks", "64", "The capital of France is"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Paris" in out.stdout
    bad = subprocess.run(PDSERVE + ["generate", "--max-tokens", "0", "hi"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "max_tokens must be an integer >= 1 (or None), got 0" in bad.stderr


def test_help_says_where_the_model_cache_is():
    out = subprocess.run(PDSERVE + ["generate", "--help"], capture_output=True, text=True, check=True, timeout=60)
    assert "PDSERVE_CACHE_DIR" in out.stdout and "safetensors" in out.stdout


def test_up_help_names_the_http_api_metrics_and_pinning():
    out = subprocess.run(PDSERVE + ["up", "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    for flag in ("--http-port", "/v1/chat/completions", "--node-metrics", "--pin-cores", "--threads-per-node",
                 "--speculative-config"):
        assert flag in out, flag
