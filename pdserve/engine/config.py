"""Engine configuration: one frozen, validated dataclass per component.

Names follow Hugging Face's ContinuousBatchingConfig where a setting exists there
(page_size, num_blocks, max_batch_tokens, max_requests_per_batch, max_memory_percent,
scheduler_type, safety_margin). Every invalid value raises ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.kernels.ops.linear import MAX_ROWS as _SMALL_LINEAR_MAX_ROWS

SchedulerType = Literal["fifo", "prefill_first"]
SCHEDULER_TYPES = ("fifo", "prefill_first")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_DTYPES = ("float32", "bfloat16")   # what the CLI offers (float16: no CPU kernels)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache (E7-E9, E12, E15).

    page_size: tokens per page (a page is one layer's K or V for page_size tokens); a power of two.
    num_blocks: blocks in the pool (a block is one page per layer); None sizes the pool from
        available memory x max_memory_percent after weights and activations (E9).
    max_memory_percent: fraction of available memory (system memory on CPU, free device memory
        on GPU, measured before the weights load) that weights, activations and the KV pool may
        take together when num_blocks is None.
    num_padding_blocks: blocks reserved for padding that requests never get (block ids 0..n-1).
    allow_block_sharing: the prefix cache (E12): requests reuse complete blocks of a prefix that
        is already in the cache. Switched off automatically for sliding-window and hybrid models.
    cpu_offload_space: the CPU swap pool for offloaded requests (E15): a float is a fraction of
        the device pool's blocks (0.0 to 1.0), an int a size in bytes; 0 turns offloading off
        (stalled requests are soft-reset instead, E14).
    kv_cache_dtype: how K and V are stored: "auto" (the model's dtype) or "bfloat16" (a float32
        model keeps its K/V rounded to bfloat16: half the pool memory and half the bytes decode
        attention reads, all math still float32; outputs then differ slightly from the float32
        reference, so it is opt-in). A prefill node and its decode nodes must use the same one.
    kv_prefault: fault the whole KV pool in at startup (MADV_POPULATE_WRITE) instead of page by
        page as blocks are first used. The pool hands out never-used blocks first, so without it
        every block's first use in a fresh process takes a page fault (a 2 MiB huge page zeroed
        for ~170 blocks), which decode steps pay until the pool has been cycled once.
        Costs startup time in proportion to the pool's size (much more where the hypervisor
        backs the memory for the first time; commit 332da6a) and commits the memory now.
    """

    page_size: int = field(default=16, metadata={"help": "tokens per KV page (a power of two)"})
    num_blocks: int | None = field(default=None, metadata={
        "help": "KV blocks in the pool (default: sized from available memory x --max-memory-percent)"})
    max_memory_percent: float = field(default=0.3, metadata={
        "help": "fraction of available memory for weights, activations and the KV pool when --num-blocks is unset"})
    num_padding_blocks: int = 1
    allow_block_sharing: bool = field(default=True, metadata={
        "help": "reuse the KV of complete blocks shared with earlier prompts (prefix cache; off automatically "
                "for sliding-window models)"})
    cpu_offload_space: float | int = field(default=0.1, metadata={
        "help": "CPU swap pool for requests preempted under memory pressure: a fraction of the KV pool (e.g. 0.1) "
                "or a byte count (e.g. 268435456); 0: recompute instead"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache storage: auto = --dtype; bfloat16 under a float32 model halves the pool and the bytes "
                "decode attention reads (math stays float32; outputs differ slightly from the float32 reference). "
                "Prefill and decode nodes must agree"})
    kv_prefault: bool = field(default=False, metadata={
        "help": "fault the whole KV pool in at startup (slower start, memory committed now) so that no step pays "
                "first-touch page faults while the pool is cycled the first time"})

    def __post_init__(self) -> None:
        _positive_int("page_size", self.page_size)
        if not isinstance(self.kv_prefault, bool):
            raise ValueError(f"kv_prefault must be True or False, got {self.kv_prefault!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks)
            if self.num_blocks <= self.num_padding_blocks:
                raise ValueError(
                    f"num_blocks={self.num_blocks} must exceed num_padding_blocks={self.num_padding_blocks}"
                )
        m = self.max_memory_percent
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 < m <= 1.0):
            raise ValueError(f"max_memory_percent must be in (0, 1], got {m!r}")
        _positive_int("num_padding_blocks", self.num_padding_blocks)
        if not isinstance(self.allow_block_sharing, bool):
            raise ValueError(f"allow_block_sharing must be True or False, got {self.allow_block_sharing!r}")
        c = self.cpu_offload_space
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            raise ValueError(f"cpu_offload_space must be a fraction (float) or bytes (int), got {c!r}")
        if isinstance(c, float) and not (0.0 <= c <= 1.0):
            raise ValueError(f"cpu_offload_space as a fraction of the pool must be in [0, 1], got {c!r} "
                             f"(give an int for a size in bytes)")
        if isinstance(c, int) and c < 0:
            raise ValueError(f"cpu_offload_space in bytes must be >= 0, got {c!r}")

    def swap_slots(self, num_blocks: int, block_nbytes: int) -> int:
        """Blocks the CPU swap pool holds for a device pool of num_blocks blocks."""
        c = self.cpu_offload_space
        if isinstance(c, float):
            return int(num_blocks * c)
        return c // block_nbytes


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling (E2-E6, E10, E11).

    max_batch_tokens: query tokens per forward pass (token budget, E4).
    max_requests_per_batch: sequences per forward pass (request cap, E4).
    scheduler_type: "fifo" (decodes, then running prefills, then waiting) or "prefill_first".
    safety_margin: fraction of free blocks below which no new prefill is admitted (E11);
        None picks the scheduler's default: 0.15 for fifo, 0.0 for prefill_first.
    """

    max_batch_tokens: int = field(default=512, metadata={"help": "query tokens per forward pass"})
    max_requests_per_batch: int = field(default=32, metadata={"help": "sequences per forward pass"})
    scheduler_type: SchedulerType = field(default="fifo", metadata={
        "help": "fifo: decodes, then running prefills, then waiting requests; prefill_first: new prompts first"})
    safety_margin: float | None = field(default=None, metadata={
        "help": "fraction of free blocks below which no new prefill is admitted (default: 0.15 for fifo, "
                "0 for prefill_first)"})

    def __post_init__(self) -> None:
        _positive_int("max_batch_tokens", self.max_batch_tokens)
        _positive_int("max_requests_per_batch", self.max_requests_per_batch)
        if self.scheduler_type not in ("fifo", "prefill_first"):
            raise ValueError(f"scheduler_type must be 'fifo' or 'prefill_first', got {self.scheduler_type!r}")
        if self.safety_margin is not None:
            s = self.safety_margin
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0.0 <= s < 1.0):
                raise ValueError(f"safety_margin must be in [0, 1), got {s!r}")

    @property
    def effective_safety_margin(self) -> float:
        if self.safety_margin is not None:
            return float(self.safety_margin)
        return 0.15 if self.scheduler_type == "fifo" else 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs.

    model: local Hugging Face checkpoint directory or .gguf file; None = the default model.
    dtype: "float32" (reference-exact) or "bfloat16".
    num_threads: torch intra-op threads; None leaves torch's default.
    max_model_len: longest sequence (prompt + output); None = the model's max_position_embeddings.
    seed: seed of the sampler's default generator (requests without their own seed).
    attention_backend: "auto" (the C kernel where built, else torch), "cpu" or "torch".
    small_batch_max_tokens: passes of at most this many float32 tokens run the decoder layers on the
        C ops bound to the weights (pdserve/model/layer_ops.py), bit-identical to the module ops and
        faster for decode steps; 0 disables; at most 32, the small linear kernel's row limit.
    tensor_parallel_size: rank processes of this engine (E22, pdserve/parallel): the leader (this
        process) and N - 1 workers, each holding a shard of every layer (KV heads split as
        pdserve/model/tp.py says; a split that cannot be made is refused at start). Float32 greedy
        outputs are bit-identical at every size (TP-invariant reductions).
    tp_invariant: sum o_proj and down_proj in fixed fold blocks whatever the TP size, so float32
        logits and KV are bit-identical at every tensor_parallel_size. None (default, "auto"): on iff
        tensor_parallel_size > 1, so a single-shard engine runs the plain kernels' sums (one block,
        as before the blocked fold; the fold slows a TP 1 prefill: bench/results/tp/tp_invariant.md).
        True (--tp-invariant): a TP 1 engine that must give the same bits as TP > 1 engines of its
        cluster (e.g. a TP 1 decode node behind TP 2 prefill nodes: the KV it receives and the KV it
        computes must agree). False (--no-tp-invariant): one block per rank; TP N then differs from
        TP 1 by float32 rounding (logprobs within 1e-3 on the default model:
        tests/integration/test_tensor_parallel.py). `tp_invariant_active` is the resolved choice.
    speculative_config: speculative decoding (E20, pdserve.engine.spec_decode): a SpeculativeConfig,
        or its dict / JSON form (vLLM's --speculative-config); None: off.
    context_history_rows: hidden states of earlier prompt positions that a prefill hands over in its
        context record besides the last one (kv_messenger.context), for a decode node's draft head to
        write its history from (E20, D17); prefill and decode nodes must agree (it is part of their KV
        layout, NodeInfo.build). 0: none.
    """

    model: str | None = None
    dtype: str = field(default="float32", metadata={"help": "weights, activations and (by default) KV dtype"})
    num_threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's choice)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output (default: the model's)"})
    seed: int = 0
    attention_backend: str = "auto"
    small_batch_max_tokens: int = field(default=_SMALL_LINEAR_MAX_ROWS, metadata={
        "help": f"passes of at most N float32 tokens (decode steps) run the decoder layers on the C ops bound to "
                f"the weights, bit-identical to the module ops and faster; 0: never; at most {_SMALL_LINEAR_MAX_ROWS}"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "rank processes of this engine, each holding a shard of every layer (KV heads split evenly, by "
                "whole GQA groups, or replicated when N > KV heads); float32 outputs are bit-identical at every N"})
    tp_invariant: bool | None = field(default=None, metadata={
        "help": "sum the row-parallel layers in fixed blocks whatever the tensor-parallel size, so float32 "
                "outputs and KV are bit-identical at every -tp (default: auto, on iff -tp > 1; --tp-invariant "
                "on a TP 1 node that must match TP > 1 nodes of its cluster, e.g. a TP 1 decode node behind "
                "TP 2 prefill nodes; --no-tp-invariant: one block per rank, within float32 rounding of TP 1)"})
    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "help": "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (greedy output is unchanged; "
                "pdserve/engine/spec_decode/config.py lists the methods)"})
    context_history_rows: int = field(default=0, metadata={
        "help": "hidden states of the prompt positions before the last one that a prefill node hands a decode "
                "node in the context record, for an eagle draft head's history (prefill and decode nodes must "
                "agree; `pdserve up` sets it for eagle); at most 4096"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        # a dict or a JSON string (LLM(speculative_config=...), --speculative-config) becomes the config
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.tp_invariant is not None and not isinstance(self.tp_invariant, bool):
            raise ValueError(f"tp_invariant must be True, False or None (auto: on iff tensor_parallel_size > 1), "
                             f"got {self.tp_invariant!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        h = self.context_history_rows
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= 4096:
            raise ValueError(f"context_history_rows must be an integer in [0, 4096] (the context record's "
                             f"history capacity), got {h!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        n = self.small_batch_max_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _SMALL_LINEAR_MAX_ROWS:
            raise ValueError(f"small_batch_max_tokens must be an integer in [0, {_SMALL_LINEAR_MAX_ROWS}] (the small "
                             f"linear kernel's row limit; 0 disables the C-op layer loop), got {n!r}")
        kv = self.cache.kv_cache_dtype
        if kv != "auto" and kv != self.dtype and not (self.dtype == "float32" and kv == "bfloat16"):
            raise ValueError(f"kv_cache_dtype={kv!r} with dtype={self.dtype!r}: a KV cache can be the model's dtype "
                             f"or bfloat16 under a float32 model, not wider than the model")

    @property
    def tp_invariant_active(self) -> bool:
        """Whether the row-parallel layers sum in the TP-invariant fold blocks (tp_invariant resolved)."""
        return self.tensor_parallel_size > 1 if self.tp_invariant is None else self.tp_invariant

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's dtype: the model's, or bfloat16 for a float32 model (cache.kv_cache_dtype)."""
        kv = self.cache.kv_cache_dtype
        return self.torch_dtype if kv == "auto" else _DTYPES[kv]

    @classmethod
    def from_options(cls, **options: object) -> "EngineConfig":
        """Build from flat keyword options (LLM(**engine_options), CLI flags).

        Cache and scheduler settings may be given flat (page_size=..., max_batch_tokens=...);
        unknown names raise ValueError listing what is accepted.
        """
        cache_names = set(CacheConfig.__dataclass_fields__)
        sched_names = set(SchedulerConfig.__dataclass_fields__)
        engine_names = set(cls.__dataclass_fields__) - {"cache", "scheduler"}
        cache_kw, sched_kw, engine_kw = {}, {}, {}
        for key, value in options.items():
            if key in cache_names:
                cache_kw[key] = value
            elif key in sched_names:
                sched_kw[key] = value
            elif key in engine_names:
                engine_kw[key] = value
            else:
                accepted = sorted(cache_names | sched_names | engine_names)
                raise ValueError(f"unknown engine option {key!r}; accepted: {', '.join(accepted)}")
        return cls(cache=CacheConfig(**cache_kw), scheduler=SchedulerConfig(**sched_kw), **engine_kw)
