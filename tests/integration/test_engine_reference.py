"""The engine against transformers on the default model (SmolLM2-135M-Instruct, float32, greedy).

Every prompt must give the same generated ids as transformers' `generate`, alone and inside a
batch of 16 mixed-length prompts, with chunked prefill (max_batch_tokens=64 cuts the long
prompts into several chunks that attend to pages written by earlier chunks). Requirements: E2
(every scheduled token of every sequence in one forward pass, attention per sequence over its own
pages), E3 (chunked prefill), E18 (the Llama-family model against its reference).
"""

from __future__ import annotations

import pytest
from support.reference import REFERENCE_PROMPTS, checked_reference, hf_greedy, reference_llm

from pdserve import SamplingParams

MAX_NEW = 24


@pytest.fixture(scope="module")
def llm():
    return reference_llm()


@pytest.fixture(scope="module")
def reference(hf_reference):
    return checked_reference(hf_reference, MAX_NEW)


def test_long_prompts_really_are_chunked_and_paged(llm):
    lens = [len(llm.tokenizer(p)["input_ids"]) for p in REFERENCE_PROMPTS]
    assert max(lens) > 3 * 64, lens      # several prefill chunks
    assert max(lens) > 10 * 16, lens     # many pages


@pytest.mark.parametrize("i", range(len(REFERENCE_PROMPTS)))
def test_each_prompt_alone_matches_transformers(llm, reference, i):
    out = llm.generate(REFERENCE_PROMPTS[i], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert list(out[0].token_ids) == reference[i]
    assert out[0].finish_reason == "length"


def test_batch_of_16_mixed_prompts_matches_transformers(llm, reference):
    prompts = REFERENCE_PROMPTS + REFERENCE_PROMPTS[::-1]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    expected = reference + reference[::-1]
    for i, (o, ref) in enumerate(zip(outs, expected, strict=True)):
        assert list(o.token_ids) == ref, f"prompt {i} differs inside the batch"
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


def test_text_equals_tokenizer_decode(llm, reference):
    out = llm.generate(REFERENCE_PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.text == llm.tokenizer.decode(reference[0], skip_special_tokens=True)


def test_eos_stops_and_is_reported(llm, hf_default):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = llm.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in out.text
    ref = hf_greedy(hf_default, llm.tokenizer, list(prompt), 64, ignore_eos=False)
    assert list(out.token_ids) == ref
