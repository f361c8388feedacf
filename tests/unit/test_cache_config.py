"""Cache configuration and pool sizing (E9): bad values fail at start with a message naming them;
the pool is sized from available memory after weights and activations."""

from __future__ import annotations

import logging

import pytest
import torch
from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sizing import MemoryBudget, activation_bytes, available_memory_bytes, size_pool

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize(("options", "message"), [
    (dict(page_size=12), "page_size must be a power of two, got 12"),
    (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
    (dict(max_memory_percent=0.0), r"max_memory_percent must be in \(0, 1\], got 0.0"),
    (dict(max_memory_percent=1.5), r"max_memory_percent must be in \(0, 1\], got 1.5"),
    (dict(cpu_offload_space=1.5), r"cpu_offload_space as a fraction of the pool must be in \[0, 1\], got 1.5"),
    (dict(cpu_offload_space=-1), "cpu_offload_space in bytes must be >= 0, got -1"),
    (dict(cpu_offload_space=True), "cpu_offload_space must be a fraction"),
    (dict(allow_block_sharing="yes"), "allow_block_sharing must be True or False"),
])
def test_bad_cache_options_fail_when_the_config_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(**options)


def test_swap_pool_size_from_a_fraction_or_bytes():
    assert CacheConfig(cpu_offload_space=0.25).swap_slots(num_blocks=100, block_nbytes=4096) == 25
    assert CacheConfig(cpu_offload_space=10 * 4096 + 1).swap_slots(num_blocks=100, block_nbytes=4096) == 10
    assert CacheConfig(cpu_offload_space=0).swap_slots(num_blocks=100, block_nbytes=4096) == 0
    assert CacheConfig(max_memory_percent=1.0).max_memory_percent == 1.0


def test_pool_size_is_the_memory_share_left_after_weights_and_activations():
    budget = MemoryBudget(available=10 * GiB, weights=1 * GiB, activations=1 * GiB)
    size = size_pool(CacheConfig(max_memory_percent=0.5), MiB, max_useful_blocks=100_000, budget=budget)
    assert size.num_blocks == 3 * 1024 + 1                              # 5 - 1 - 1 GiB of 1 MiB blocks + padding
    assert "10.0 GiB available x 0.5" in size.reason and "weights 1024 MiB" in size.reason
    capped = size_pool(CacheConfig(max_memory_percent=0.5), MiB, max_useful_blocks=100, budget=budget)
    assert capped.num_blocks == 101
    assert size_pool(CacheConfig(num_blocks=7), MiB, 100, None).num_blocks == 7
    with pytest.raises(RuntimeError, match=r"0.50 GiB, minus weights 1.00 GiB and activations 1.00 GiB"):
        size_pool(CacheConfig(max_memory_percent=0.05), MiB, 100, budget)


def test_activation_estimate_grows_with_the_batch_and_memory_probe_names_bad_devices():
    shape = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                 vocab_size=49152, max_requests_per_batch=32, max_model_len=2048, dtype=torch.float32)
    small = activation_bytes(max_batch_tokens=64, **shape)
    large = activation_bytes(max_batch_tokens=512, **shape)
    assert 0 < small < large
    assert available_memory_bytes("cpu") > 0
    with pytest.raises(ValueError, match="device type 'meta'"):
        available_memory_bytes("meta")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_config") / "llama"))


def test_a_pool_too_small_for_one_request_of_max_model_len_fails_at_start(tiny):
    with pytest.raises(ValueError, match=r"10 usable blocks of 16 tokens, but one request of "
                                         r"max_model_len=512 tokens needs 32 blocks"):
        LLM(model=tiny, num_blocks=11, page_size=16, max_model_len=512, num_threads=1)


def test_without_max_model_len_a_small_pool_caps_it_and_a_sized_pool_logs_once(tiny, caplog):
    llm = LLM(model=tiny, num_blocks=11, page_size=16, num_threads=1)
    assert llm.engine.max_model_len == 160                              # 10 blocks x 16 tokens
    with caplog.at_level(logging.INFO, logger="pdserve.engine.builder"):   # the engine builder logs the sizing
        eng = LLM(model=tiny, page_size=16, max_memory_percent=0.05, num_threads=1).engine
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert len(lines) == 1 and "minus weights" in lines[0] and "activations" in lines[0]
    assert eng.max_model_len == 2048
