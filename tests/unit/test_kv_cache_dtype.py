"""A bfloat16 KV cache under a float32 model (CacheConfig.kv_cache_dtype="bfloat16").

K and V are stored rounded to bfloat16 (half the pool, half the bytes decode attention reads);
every product and sum stays float32. The C kernel and the torch backend must read the same
stored keys (so they agree token for token), and the outputs must stay close to the float32
cache's: bfloat16 keeps 8 significant bits, so each K/V element moves by at most 2^-9 of its
size and a logit by a few hundredths; we compare logprobs of the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]


def test_kv_cache_dtype_is_validated_and_resolved():
    assert EngineConfig().kv_torch_dtype == torch.float32
    assert EngineConfig.from_options(kv_cache_dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert EngineConfig.from_options(dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, got 'fp8'"):
        EngineConfig.from_options(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' with dtype='bfloat16'"):
        EngineConfig.from_options(dtype="bfloat16", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "tiny"))


def test_bfloat16_pool_halves_the_blocks_bytes_and_both_backends_read_it_alike(tiny_llama):
    prompts = [[5 + (i * 7) % 50 for i in range(n)] for n in (3, 40, 70, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(model=tiny_llama, num_blocks=64, attention_backend=backend, kv_cache_dtype="bfloat16",
                  max_batch_tokens=32, num_threads=2)
        kv = llm.engine.kv_cache
        assert kv.buffer.dtype == torch.bfloat16
        assert kv.nbytes == LLM(model=tiny_llama, num_blocks=64, num_threads=1).engine.kv_cache.nbytes // 2
        runs[backend] = llm.generate(prompts, params)
    for c, t in zip(runs["cpu"], runs["torch"], strict=True):
        assert c.token_ids == t.token_ids
        for a, b in zip(c.logprobs, t.logprobs, strict=True):  # float32 summation order only
            assert abs(a.sampled.logprob - b.sampled.logprob) < 1e-4


def test_default_model_with_bfloat16_kv_stays_close_to_the_float32_cache():
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    f32 = LLM(num_blocks=128, num_threads=2).generate(PROMPTS, params)
    llm = LLM(num_blocks=128, num_threads=2, kv_cache_dtype="bfloat16")
    bf16 = llm.generate(PROMPTS, params)
    assert llm.engine.kv_cache.buffer.dtype == torch.bfloat16
    agreeing = 0
    for a, b in zip(f32, bf16, strict=True):
        # up to the first differing token both saw the same context: their logprobs stay close
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=False):
            assert abs(la.sampled.logprob - lb.sampled.logprob) < 0.05, (a.text, b.text)
            if ta != tb:
                break
            agreeing += 1
    # greedy continuations mostly coincide (a near-tie may flip late in a continuation)
    texts = [(a.text, b.text) for a, b in zip(f32, bf16, strict=True)]
    assert agreeing >= 0.75 * sum(len(a.token_ids) for a in f32), texts
