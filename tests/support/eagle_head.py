"""A seeded random (untrained) eagle draft head for the default model: the tests' proof that
exactness never depends on the head's quality (issue 18)."""

from __future__ import annotations

import json
import pathlib

import torch


def write_random_head(out: pathlib.Path, target_dir: pathlib.Path, seed: int = 0) -> str:
    """Write a head for the checkpoint at `target_dir` into `out` (created); its path as a string."""
    from pdserve.model.eagle_config import EagleConfig, load_target_vocab
    from pdserve.model.eagle_head import EagleHead

    vocab = load_target_vocab(target_dir)
    hf = json.loads((target_dir / "config.json").read_text())
    head = EagleHead(EagleConfig.for_target(hf, vocab.identity), vocab.embed, vocab.lm_head)
    head.reset_parameters(torch.Generator().manual_seed(seed))
    head.save(out)
    return str(out)
