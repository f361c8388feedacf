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
