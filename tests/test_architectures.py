"""Our model code against transformers on tiny random-weight checkpoints of each family.

The checkpoints are built here from transformers configs (tests/tiny_models.py): Llama (tied,
and llama3 RoPE scaling with an untied head), Qwen2 (q/k/v biases), Qwen3 (q/k norm), Mistral.
Greedy ids must equal transformers' `generate`, for prompts that need several chunks and pages,
with both attention backends.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.attention import cpu_kernels
from reference import hf_greedy
from tiny_models import TINY_ARCHS, make_tiny_checkpoint

PROMPTS = ["The capital of France is", "def f(x):\n    return", "Once upon a time " * 30]
BACKENDS = ["torch"] + (["cpu"] if cpu_kernels.available() else [])


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
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == hf_greedy(hf, tok, prompt, 16), f"{arch}/{backend}: {prompt[:20]!r}"
    llm.engine.check_integrity()
