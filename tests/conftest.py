"""Shared fixtures: the default model, ours and transformers'."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def one_thread():
    """torch (and with it the C kernels) on one thread: a tiny model's ops are too small to split,
    and a second OpenMP thread only spins (several times slower on a loaded 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_source():
    from pdserve.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_default(default_source):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(default_source.path, dtype=torch.float32).eval()
