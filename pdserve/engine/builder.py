"""Builds everything one engine runs on, from its EngineConfig: `build_engine`.

    model      resolve the checkpoint, read its config and tokenizer, plan tensor parallelism
               (E22), build the model (rank 0's shard under TP) and load its weights
    KV memory  size the paged pool from the memory budget or `num_blocks` (issue 4), fit
               max_model_len to it, allocate it (an anonymous mapping on transparent huge pages,
               pdserve.engine.cache.hostmem), start the TP worker ranks over it, the block pool,
               the cache manager (one table per attention group, E8; the prefix cache, E12) and
               the CPU swap pool (E14)
    the step   the scheduler, the KV connector's registration (it gets the pool before the
               engine exists, KvCacheSpec), the preemptor, the model runner, and the speculative
               decoder (E20, pdserve.engine.spec_decode.loader), sharing the swap pool when it
               has a KV pool of its own

LLMEngine.__init__ calls it once, on the thread that constructs the engine (then the engine
thread); nothing here waits except on disk reads and, under TP, the worker ranks' start-up
(bounded in pdserve.engine.runner.start_tensor_parallel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.groups import AttentionGroup, attention_groups, max_blocks_per_request
from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.cache.swap import SwapSpace
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import AttentionGroupSpec, KvCacheSpec, KvConnector
from pdserve.engine.runner import ModelRunner, start_tensor_parallel, tensor_parallel_plan, tp_shard_pools
from pdserve.engine.scheduler import make_scheduler
from pdserve.engine.scheduler.preemption import Preemptor
from pdserve.engine.scheduler.scheduler import Scheduler
from pdserve.engine.sizing import (
    MemoryBudget,
    activation_bytes,
    available_memory_bytes,
    fit_max_model_len,
    module_nbytes,
    size_pool,
)
from pdserve.engine.spec_decode.decoder import SpeculativeDecoder
from pdserve.engine.spec_decode.loader import make_speculator
from pdserve.kernels.attention import get_backend
from pdserve.model import loader as model_loader
from pdserve.model.arch import ModelArch
from pdserve.model.loader import ModelSource
from pdserve.model.registry import build_model
from pdserve.model.tp import TensorParallelPlan
from pdserve.parallel.group import TensorParallelGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """The checkpoint, loaded: what the KV memory is sized for."""

    source: ModelSource
    arch: ModelArch
    tokenizer: object               # a transformers tokenizer
    eos_token_ids: frozenset[int]
    max_model_len: int              # the config's, capped at the model's positions (before the pool fits it)
    tp_plan: TensorParallelPlan | None   # None at TP 1
    model: torch.nn.Module
    available: int | None           # free memory before the weights loaded (None: num_blocks is given)


@dataclass(frozen=True)
class EngineParts:
    """Everything LLMEngine runs on (its attributes of the same names)."""

    loaded: LoadedModel
    max_model_len: int              # fitted to the pool
    kv_cache: PagedKVCache
    tp: TensorParallelGroup | None  # the running TP worker ranks, None at TP 1
    pool: BlockPool
    cache_manager: KVCacheManager
    swap: SwapSpace | None
    scheduler: Scheduler
    preemptor: Preemptor
    runner: ModelRunner
    speculator: SpeculativeDecoder | None


def build_engine(config: EngineConfig, kv_connector: KvConnector | None) -> EngineParts:
    """The engine's parts; `kv_connector` (if any) is handed the pool (its ValueError propagates)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    m = load_model(config)
    # One block table per attention kind (E8): ("full",), ("sliding",) or both for hybrids.
    groups = attention_groups(m.arch.layer_types, m.arch.sliding_window)
    P, sched = config.cache.page_size, config.scheduler
    kv_dtype = config.kv_torch_dtype   # the model's dtype, or bfloat16 K/V under a float32 model
    block_nbytes = KVCacheShape(m.arch.num_layers, 1, m.arch.num_kv_heads, P, m.arch.head_dim).block_nbytes(kv_dtype)
    budget = None
    if m.available is not None:
        budget = MemoryBudget(available=m.available, weights=module_nbytes(m.model),
                              activations=_activation_bytes(config, m))
    per_request = max_blocks_per_request(groups, P, m.max_model_len, sched.max_batch_tokens)
    size = size_pool(config.cache, block_nbytes, sched.max_requests_per_batch * per_request, budget)
    max_model_len = fit_max_model_len(groups, P, size.num_blocks - config.cache.num_padding_blocks,
                                      m.max_model_len, config.max_model_len is not None, sched.max_batch_tokens)
    sharing = config.cache.allow_block_sharing and all(g.sliding_window is None for g in groups)
    kv_heads = len(m.tp_plan.ranks[0].kv_heads) if m.tp_plan else m.arch.num_kv_heads
    kv_cache = PagedKVCache(KVCacheShape(m.arch.num_layers, size.num_blocks, kv_heads, P, m.arch.head_dim),
                            kv_dtype, prefault=config.cache.kv_prefault)
    tp = None if m.tp_plan is None else start_tensor_parallel(
        m.tp_plan, m.model, kv_cache, str(m.source.path), config.dtype, max_model_len,
        config.small_batch_max_tokens, config.attention_backend, config.cache.kv_prefault,
        config.tp_invariant_active)
    pool = BlockPool(size.num_blocks, config.cache.num_padding_blocks)
    cache_manager = KVCacheManager(pool, P, groups, enable_prefix_caching=sharing)
    # no CPU swap under TP (it would move rank 0's shard only): stalled requests are recomputed
    swap_slots = config.cache.swap_slots(size.num_blocks, block_nbytes) if tp is None else 0
    swap = SwapSpace(kv_cache, cache_manager, swap_slots) if swap_slots > 0 else None
    logger.info("KV cache: %d blocks of %d tokens (%s, %.2f MiB each, %.2f GiB total; %s), groups %s, "
                "prefix cache %s%s, swap pool %d blocks (%.2f GiB), max_model_len %d",
                size.num_blocks, P, str(kv_dtype).removeprefix("torch."), block_nbytes / 2**20,
                size.num_blocks * block_nbytes / 2**30, size.reason, cache_manager.group_names,
                "on" if sharing else "off",
                "" if sharing or not config.cache.allow_block_sharing else " (sliding-window layers)",
                swap_slots, swap_slots * block_nbytes / 2**30, max_model_len)
    scheduler = make_scheduler(config.scheduler, cache_manager)
    if kv_connector is not None:
        kv_connector.register_kv_cache(kv_cache_spec(config, m, groups, kv_cache, tp))
    preemptor = Preemptor(scheduler, cache_manager, swap)
    runner = ModelRunner(m.model, kv_cache, cache_manager, get_backend(config.attention_backend), tp=tp)
    speculator = make_speculator(config.speculative_config, runner, m.tokenizer, max_model_len, config.torch_dtype,
                                 config.small_batch_max_tokens, sched.max_batch_tokens, str(m.source.path))
    if speculator is not None and swap is not None:
        speculator.share_swap(swap)
    return EngineParts(m, max_model_len, kv_cache, tp, pool, cache_manager, swap, scheduler, preemptor, runner,
                       speculator)


def load_model(config: EngineConfig) -> LoadedModel:
    """The checkpoint's model with its weights (rank 0's shard under TP), tokenizer and limits."""
    source = model_loader.resolve_model(config.model)
    hf_config = model_loader.load_config(source)
    arch = ModelArch.from_hf_config(hf_config)
    tokenizer = model_loader.load_tokenizer(source)
    eos_token_ids = frozenset(model_loader.load_generation_eos(source))
    model_max = arch.max_position_embeddings
    max_model_len = min(config.max_model_len or model_max, model_max)
    available = available_memory_bytes(torch.device("cpu")) if config.cache.num_blocks is None else None
    # Tensor parallelism (E22): the split, refused here when it cannot be made; rank 0's shard is ours.
    tp_plan = tensor_parallel_plan(config.tensor_parallel_size, arch)
    model = build_model(arch, hf_config, config.torch_dtype, max_model_len,
                        small_batch_max_tokens=config.small_batch_max_tokens,
                        shard=tp_plan.ranks[0] if tp_plan else None,
                        tp_invariant=config.tp_invariant_active)
    logger.info("row-parallel sums: %s (tp_invariant=%s, tensor_parallel_size=%d)",
                "TP-invariant fold blocks" if config.tp_invariant_active else "plain (one block per rank)",
                "auto" if config.tp_invariant is None else config.tp_invariant, config.tensor_parallel_size)
    logger.info("layer loop: C ops bound to the weights for passes of at most %d float32 tokens "
                "(small_batch_max_tokens; 0: never), where the model has them", config.small_batch_max_tokens)
    model.load_weights(model_loader.iter_weights(source))
    model.eval()
    return LoadedModel(source=source, arch=arch, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                       max_model_len=max_model_len, tp_plan=tp_plan, model=model, available=available)


def kv_cache_spec(config: EngineConfig, m: LoadedModel, groups: tuple[AttentionGroup, ...],
                  kv_cache: PagedKVCache, tp: TensorParallelGroup | None) -> KvCacheSpec:
    """What a KV connector learns of the pool (register_kv_cache)."""
    layer_types = tuple(m.arch.layer_types)
    specs = []
    for g in groups:
        kind = "full_attention" if g.sliding_window is None else "sliding_attention"
        specs.append(AttentionGroupSpec(g.name, tuple(i for i, t in enumerate(layer_types) if t == kind),
                                        g.sliding_window))
    return KvCacheSpec(buffer=kv_cache.buffer, shape=kv_cache.shape, dtype=kv_cache.dtype,
                       groups=tuple(specs), hidden_size=m.arch.hidden_size, model_name=m.source.name,
                       shards=tp_shard_pools(tp, kv_cache), context_history_rows=config.context_history_rows)


def _activation_bytes(config: EngineConfig, m: LoadedModel) -> int:
    a, s = m.arch, config.scheduler
    return activation_bytes(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
        max_batch_tokens=s.max_batch_tokens, max_requests_per_batch=s.max_requests_per_batch,
        max_model_len=m.max_model_len, dtype=config.torch_dtype,
    )
