"""Our model code against transformers on tiny random-weight checkpoints of each family.

The checkpoints are built here from transformers configs (tests/support/tiny_models.py): Llama (tied,
and llama3 RoPE scaling with an untied head), Qwen2 (q/k/v biases), Qwen3 (q/k norm), Mistral.
Greedy ids must equal transformers' `generate`, for prompts that need several chunks and pages,
with both attention backends; also for Mistral with a sliding window shorter than the prompts
(every layer slides). Gemma 3's hybrid layers are tested in tests/integration/test_gemma3.py.
"""

from __future__ import annotations

import pytest
import torch
from support.native import with_cpu
from support.reference import hf_greedy
from support.tiny_models import TINY_ARCHS, make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import cpu_kernels

PROMPTS = ["The capital of France is", "def f(x):\n    return", "Once upon a time " * 30]
BACKENDS = with_cpu(cpu_kernels.available(), cpu_kernels.unavailable_reason())


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run on one thread


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in TINY_ARCHS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_matches_transformers(checkpoints, arch, backend):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=str(path), num_blocks=64, page_size=8, max_batch_tokens=32, attention_backend=backend)
    assert llm.engine.arch.model_type == hf.config.model_type
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(hf, tok, prompt, 16), f"{arch}/{backend}: {prompt[:20]!r}"
    llm.engine.check_integrity()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_sliding_window_matches_transformers(tmp_path, backend):
    # Every layer slides (window 16 < the prompts): the engine gives the cache one "sliding"
    # group, the runner one windowed batch, and the output still equals transformers'.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_checkpoint("mistral", tmp_path / "mistral-sliding", sliding_window=16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(model=str(path), num_blocks=64, page_size=8, max_batch_tokens=32, max_model_len=512,
              attention_backend=backend)
    assert llm.engine.arch.layer_types == ("sliding_attention",) * 2 and llm.engine.max_model_len == 512
    assert llm.engine.cache_manager.group_names == ("sliding",)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert list(out.token_ids) == hf_greedy(hf, tok, prompt, 16), f"{backend}: {prompt[:20]!r}"
    llm.engine.check_integrity()
