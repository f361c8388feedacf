"""Sampling through the engine (E19): seeds, stop strings, stop token ids, logprobs vs transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=256, num_threads=2)


def test_seeded_sampling_is_reproducible_alone_or_in_a_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Once upon a time", p)[0]
    batched = llm.generate(["Hello there", "Once upon a time", "Why is the sky blue?"],
                           [SamplingParams(temperature=1.0, max_tokens=9), p,
                            SamplingParams(temperature=0.7, max_tokens=20)])
    assert batched[1].token_ids == alone.token_ids
    other = llm.generate("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                                            max_tokens=16, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


def test_a_seeded_stream_resumes_exactly_after_rng_skip_tokens(llm):
    """S10: a request resumed after k tokens (prompt + those k, rng_skip_tokens=k) samples the tokens an
    uninterrupted run samples after them, alone or in a batch; without the skip it does not."""
    p = SamplingParams(temperature=0.9, top_k=50, seed=4321, max_tokens=12, ignore_eos=True)
    prompt = list(llm.tokenizer("Once upon a time")["input_ids"])
    full = list(llm.generate([prompt], p)[0].token_ids)
    for k in (1, 5):
        resumed = dataclasses.replace(p, max_tokens=12 - k, rng_skip_tokens=k)
        batch = llm.generate([prompt + full[:k], "Hello there"],
                             [resumed, SamplingParams(temperature=1.0, max_tokens=9)])
        assert list(batch[0].token_ids) == full[k:]
        assert list(llm.generate([prompt + full[:k]], resumed)[0].token_ids) == full[k:]
    fresh = dataclasses.replace(p, max_tokens=7)  # the seed's stream restarted at the seam
    assert list(llm.generate([prompt + full[:5]], fresh)[0].token_ids) != full[5:]
    with pytest.raises(ValueError, match="rng_skip_tokens=3 needs a seed"):
        SamplingParams(temperature=1.0, rng_skip_tokens=3)
    with pytest.raises(ValueError, match="rng_skip_tokens must be an integer >= 0, got -1"):
        SamplingParams(temperature=1.0, seed=1, rng_skip_tokens=-1)


def test_stop_string_ends_generation_and_is_cut_from_the_text(llm):
    full = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20))[0]
    assert "answer" in full.text  # " Paris.\n\nThe answer is: ..."
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20, stop=["answer"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == "answer"
    assert out.text == full.text[: full.text.index("answer")]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_generation(llm):
    full = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_id = full.token_ids[3]
    out = llm.generate("The capital of France is",
                       SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs_match_transformers(llm, hf_default):
    prompt = "The capital of France is"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    ids = llm.tokenizer(prompt)["input_ids"] + list(out.token_ids)
    with torch.inference_mode():
        ref = torch.log_softmax(hf_default(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, V]
    n = len(ids) - len(out.token_ids)
    for i, lp in enumerate(out.logprobs):
        row = ref[n - 1 + i]
        assert lp.sampled.token_id == out.token_ids[i] and lp.sampled.rank == 1
        # Float32 sums in a different order: agreement to 1e-4 nats is far tighter than any
        # difference a wrong position, mask or head mapping would make (those change logprobs by >0.1).
        assert lp.sampled.logprob == pytest.approx(row[out.token_ids[i]].item(), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
