"""Input limits (S6) and the resume seam (S10), in process: pdserve.serving.convert's caps and context
check, pdserve.serving.node_request's prepared requests, and ResumeSeam against the default model's
real tokenizer (a request cut at every token and resumed gives the text of an uninterrupted run)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.convert import (
    INPUT_LIMITS,
    FieldError,
    InputLimits,
    check_sampling_limits,
    fit_context,
    sampling_from_pb,
)
from pdserve.serving.node_request import prepare_generate
from pdserve_api.v1 import generate_pb2
from router.http_api.server import json_depth
from router.limits import RequestLimits, check_request


def _refused(options: generate_pb2.SamplingOptions, limits: InputLimits = INPUT_LIMITS) -> FieldError:
    with pytest.raises(FieldError) as err:
        check_sampling_limits(options, limits)
    return err.value


def test_each_cap_names_the_value_and_the_cap():
    limits = InputLimits(max_stop_strings=2, max_stop_chars=5, max_stop_token_ids=3, max_logprobs=4)
    e = _refused(generate_pb2.SamplingOptions(stop=["a", "b", "c"]), limits)
    assert e.field == "stop" and str(e) == "stop has 3 strings; at most 2 are allowed"
    e = _refused(generate_pb2.SamplingOptions(stop=["ok", "toolong"]), limits)
    assert e.field == "stop" and str(e).startswith("stop[1] is 7 characters long; at most 5 are allowed")
    e = _refused(generate_pb2.SamplingOptions(stop_token_ids=[1, 2, 3, 4]), limits)
    assert e.field == "stop_token_ids" and str(e) == "stop_token_ids has 4 ids; at most 3 are allowed"
    e = _refused(generate_pb2.SamplingOptions(logprobs=5), limits)
    assert e.field == "logprobs" and "logprobs must be an integer in [0, 4], got 5" in str(e)
    check_sampling_limits(generate_pb2.SamplingOptions(stop=["a", "b"], stop_token_ids=[1, 2, 3], logprobs=4),
                          limits)  # at the caps: accepted


def test_the_default_caps_apply_to_every_conversion():
    with pytest.raises(ValueError, match="stop has 17 strings; at most 16 are allowed"):
        sampling_from_pb(generate_pb2.SamplingOptions(stop=[f"s{i}" for i in range(17)]))
    with pytest.raises(ValueError, match="stop_token_ids has 257 ids; at most 256"):
        sampling_from_pb(generate_pb2.SamplingOptions(stop_token_ids=list(range(257))))
    assert sampling_from_pb(generate_pb2.SamplingOptions(stop=["x" * 256])).stop == ("x" * 256,)
    with pytest.raises(ValueError, match="max_stop_chars must be an integer >= 0, got -1"):
        InputLimits(max_stop_chars=-1)


def test_max_tokens_over_the_context_left_is_refused_naming_both_numbers():
    with pytest.raises(FieldError) as err:
        fit_context(SamplingParams(max_tokens=1_000_000_000), 30, 2048)
    assert err.value.field == "max_tokens"
    message = str(err.value)
    assert "context is 2048 tokens" in message and "1000000030" in message and "30 in the prompt" in message
    assert "max_tokens=1000000000" in message and "at most 2018 tokens are left" in message
    assert fit_context(SamplingParams(max_tokens=2018), 30, 2048).max_tokens == 2018      # exactly fits
    assert fit_context(SamplingParams(max_tokens=5000), 30, 2048, clamp=True).max_tokens == 2018
    assert fit_context(SamplingParams(max_tokens=None), 30, 2048).max_tokens is None     # until the context is full
    with pytest.raises(ValueError, match="prompt has 2048 tokens but the model's context is 2048 tokens"):
        fit_context(SamplingParams(max_tokens=1), 2048, 2048, clamp=True)


def test_the_router_checks_token_id_prompts_against_a_known_context():
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * 60),
                                           sampling=generate_pb2.SamplingOptions(max_tokens=5))
    check_request(request, RequestLimits())                         # no context known yet: the node checks
    with pytest.raises(FieldError, match="context is 64 tokens, but the request needs 65"):
        check_request(request, RequestLimits(), context_length=64)
    request.sampling.clamp_max_tokens = True
    check_request(request, RequestLimits(), context_length=64)
    unset = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * 60))
    check_request(unset, RequestLimits(), context_length=64)        # the server's default max_tokens is lowered


def test_json_depth_counts_nesting_of_lists_and_objects():
    assert json_depth({"prompt": "x"}, 32) == 1
    assert json_depth({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, 32) == 5
    deep: list = []
    inner = deep
    for _ in range(100):
        inner.append([])
        inner = inner[0]
    assert json_depth({"prompt": deep}, 32) == 33     # counting stops past the limit


# --- node-side preparation and the resume seam, with the default model's tokenizer ----------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from pdserve.model.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def test_prepare_tokenizes_like_the_engine_and_checks_the_context(tokenizer):
    text = "The capital of France is"
    request = generate_pb2.GenerateRequest(text=text, sampling=generate_pb2.SamplingOptions(max_tokens=4))
    prepared = asyncio.run(prepare_generate(request, tokenizer, 2048))
    assert prepared.prompt_ids == list(tokenizer(text)["input_ids"]) and prepared.params.max_tokens == 4
    assert prepared.seam is None
    n = len(prepared.prompt_ids)
    request.sampling.max_tokens = 2048
    with pytest.raises(FieldError, match=f"context is 2048 tokens, but the request needs {2048 + n}"):
        asyncio.run(prepare_generate(request, tokenizer, 2048))
    request.sampling.clamp_max_tokens = True
    assert asyncio.run(prepare_generate(request, tokenizer, 2048)).params.max_tokens == 2048 - n


def test_a_resumed_request_continues_after_the_streamed_tokens(tokenizer):
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                                           sampling=generate_pb2.SamplingOptions(max_tokens=6, seed=7, stop=["x"]))
    request.resume.token_ids.extend([4, 5])
    prepared = asyncio.run(prepare_generate(request, tokenizer, 2048))
    assert prepared.prompt_ids == [1, 2, 3, 4, 5] and prepared.seam is not None
    assert prepared.params.stop == () and prepared.params.seed == 7 and prepared.params.rng_skip_tokens == 2
    request.resume.ClearField("token_ids")
    with pytest.raises(ValueError, match="resume.token_ids is empty"):
        asyncio.run(prepare_generate(request, tokenizer, 2048))


def _engine_outputs(ids: Sequence[int], prompt_len: int, finish: str, per_message: int = 2
                    ) -> list[RequestOutput]:
    """What an engine streams for `ids` (text unused by the seam), `per_message` tokens a message."""
    outs = []
    for i in range(0, len(ids), per_message):
        chunk = tuple(ids[i:i + per_message])
        last = i + per_message >= len(ids)
        outs.append(RequestOutput(
            request_id="r", new_token_ids=chunk, delta_text="(engine)", finished=last,
            num_prompt_tokens=prompt_len, num_output_tokens=i + len(chunk),
            completion=CompletionOutput("(engine)", tuple(ids), finish) if last else None))
    return outs


async def _aiter(items: Sequence[RequestOutput]) -> AsyncIterator[RequestOutput]:
    for item in items:
        yield item


def _uninterrupted(tokenizer, prompt: list[int], ids: Sequence[int], params: SamplingParams
                   ) -> tuple[list[str], str | None]:
    det = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas = []
    for t in ids:
        step = det.push(t)
        deltas.append(step.delta_text)
        if step.stop_string is not None:
            return deltas, step.stop_string
    deltas.append(det.finish())
    return deltas, None


@pytest.mark.parametrize("stop", [(), ("🇫🇷 and",)])
def test_the_seam_gives_the_text_of_an_uninterrupted_run_at_every_cut(tokenizer, stop):
    prompt = list(tokenizer("Say something:")["input_ids"])
    ids = list(tokenizer("Hello 😀 world 世界, 🇫🇷 and ñandú — done.", add_special_tokens=False)["input_ids"])
    params = SamplingParams(max_tokens=len(ids), stop=stop)
    full_deltas, full_stop = _uninterrupted(tokenizer, prompt, ids, params)
    expected = "".join(full_deltas)
    assert (full_stop is not None) == bool(stop)
    for cut in range(1, len(ids) - 1):
        before, before_stop = _uninterrupted(tokenizer, prompt, ids[:cut], SamplingParams(stop=stop))
        if before_stop is not None:
            break  # the request ended before this cut
        sent = "".join(before[:-1])  # what a node streamed before failing (its final flush never happened)
        request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling=generate_pb2.
                                               SamplingOptions(max_tokens=len(ids) - cut, stop=list(stop)))
        request.resume.token_ids.extend(ids[:cut])
        request.resume.text_chars = len(sent)
        prepared = asyncio.run(prepare_generate(request, tokenizer, 2048))

        async def collect(prepared=prepared, cut=cut) -> list[RequestOutput]:
            engine = _engine_outputs(ids[cut:], len(prompt) + cut, "length")
            return [o async for o in prepared.outputs(_aiter(engine))]

        outs = asyncio.run(collect())
        text = sent + "".join(o.delta_text for o in outs)
        assert text == expected, (cut, sent)
        last = outs[-1]
        assert last.finished and last.num_prompt_tokens == len(prompt)
        if stop:
            assert last.finish_reason == "stop" and last.completion.stop_reason == stop[0]
        else:
            assert last.finish_reason == "length" and last.num_output_tokens == len(ids)
            assert [t for o in outs for t in o.new_token_ids] == ids[cut:]


def test_the_routers_resumed_request_carries_the_streamed_tokens_and_what_is_left():
    from router.service import Progress, resume_request

    request = generate_pb2.GenerateRequest(request_id="r", text="hi", sampling=generate_pb2.SamplingOptions(
        max_tokens=10, seed=3))
    progress = Progress()
    for ids, text in (([5, 6], "ab"), ([7], "ç")):
        progress.add(generate_pb2.GenerateResponse(token_ids=ids, text=text))
    resumed = resume_request(request, progress, default_max_tokens=16)
    assert list(resumed.resume.token_ids) == [5, 6, 7] and resumed.resume.text_chars == 3
    assert resumed.sampling.max_tokens == 7 and resumed.text == "hi" and resumed.sampling.seed == 3
    assert not resumed.sampling.clamp_max_tokens
    unset = generate_pb2.GenerateRequest(text="hi")   # the server's default max_tokens: still lowered to fit
    resumed = resume_request(unset, progress, default_max_tokens=16)
    assert resumed.sampling.max_tokens == 13 and resumed.sampling.clamp_max_tokens
    request.sampling.max_tokens = 3                    # everything was streamed: nothing to resume
    assert resume_request(request, progress, default_max_tokens=16) is None
