"""Bad input gets a clear error naming the value, and the engine keeps serving (S6)."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=128, max_model_len=256, num_threads=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1 \(or None\), got 0"),
        ({"max_tokens": -5}, "got -5"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "got 1.5"),
        ({"top_k": -3}, "top_k must be an integer >= -1"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_values_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_while_other_requests_keep_running(llm):
    engine = llm.engine
    good = engine.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens but the model's context is 256"):
        engine.add_request("word " * 400, SamplingParams())
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        engine.add_request([1, 2, 10**9], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("hi", SamplingParams(), request_id=good.request_id)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good.request_id]
    assert done[0].completion.finish_reason == "length" and len(done[0].completion.token_ids) == 8
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_generate_validates_every_prompt_before_running_any(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine prompt", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_path_and_bad_engine_options():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        LLM(model="/no/such/model")
    with pytest.raises(ValueError, match="unknown engine option 'page_sise'"):
        EngineConfig.from_options(page_sise=16)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1, got 0"):
        EngineConfig.from_options(page_size=0)
    with pytest.raises(ValueError, match="scheduler_type must be 'fifo' or 'prefill_first', got 'lifo'"):
        EngineConfig.from_options(scheduler_type="lifo")


def test_abort_frees_blocks(llm):
    engine = llm.engine
    r = engine.add_request("Tell me a long story about " * 5, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.pool.num_used_blocks > 0
    out = engine.abort_request(r.request_id)
    assert out.finished and out.completion.finish_reason == "abort"
    assert engine.pool.num_used_blocks == 0
    engine.check_integrity()
