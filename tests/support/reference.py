"""Reference generation with transformers, and the prompts the equivalence tests share."""

from __future__ import annotations

import torch

# Prompts of varied shape: short, code, numbers, non-English, and long ones that need several
# prefill chunks (max_batch_tokens=64 in the tests) and span many 16-token pages.
REFERENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Le chat est sur la table et",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Once upon a time, in a land far away, there lived a dragon who " * 6,
    "import numpy as np\n" + "x = np.arange(10)\nprint(x.sum())\n" * 12,
    "The quick brown fox jumps over the lazy dog. " * 20,
]


def hf_greedy(model, tokenizer, prompt: str | list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """transformers' greedy generate, generated ids only; ignore_eos forces max_new_tokens tokens."""
    ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else 0,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    return out[0, len(ids):].tolist()


def reference_llm():
    """The engine the reference-equality modules share (one per module): batches of up to 16
    sequences, 64-token prefill chunks that cut the long prompts, 16-token pages."""
    from pdserve import LLM

    return LLM(num_blocks=600, page_size=16, max_batch_tokens=64, max_requests_per_batch=16, num_threads=2)


def checked_reference(hf_reference: list[list[int]], max_new: int) -> list[list[int]]:
    """The session's transformers reference ids, checked to be `max_new` tokens each (what a module compares)."""
    assert all(len(r) == max_new for r in hf_reference)
    return hf_reference
