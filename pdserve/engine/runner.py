"""The model runner: turns a SchedulerOutput into tensors, runs one forward pass, returns logits.

It owns the model, the KV cache tensors and the attention backend. It knows nothing of queues or
sampling: the scheduler decides what runs, the sampler decides what comes out.

Attention groups (E8): each layer reads one attention batch, chosen by its type. A
full-attention layer reads the cache's "full" group tables. A sliding-window layer reads the
"sliding" group's tables when the cache has that group (the sliding-window allocator recycles
pages that left the window), otherwise the "full" group's tables; either way its batch carries
the window, so its queries see only the last `sliding_window` positions. When every layer reads
the same batch (all models but hybrids like Gemma 3), the model gets that batch's plan itself;
otherwise it gets a `LayerPlans` with one plan per layer. The new K/V of every token is written
to the page of its own group's table.

Tensor parallelism (E22): with a `TensorParallelGroup` the runner sends each pass's inputs (a
StepMessage: token ids, positions, the attention batches, and for a self-draft's pass how many
layers) to the worker ranks before running the leader's own shard; the layers' row-parallel folds
are the collectives. Any failure inside a TP pass fails the group for good (the ranks can no longer
be in step): TensorParallelError. `tensor_parallel_plan` / `start_tensor_parallel` are what the
engine calls to set it up. A hybrid model (Gemma 3) sends both attention batches in each
StepMessage (one per window; a worker gives each layer the batch of its window,
pdserve/parallel/worker.py `layer_plans`); every rank writes its KV heads of both groups' pages
into its own pool, whose layout is the same
[layers, 2, pages, rank_kv_heads, P, D] as at TP 1, with the leader's one block table per group.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.cache.kv_cache import PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.kv_connector import KvShardPool
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from pdserve.kernels.attention.base import AttentionBackend, AttentionBatch, LayerPlans
from pdserve.model.arch import SLIDING_ATTENTION, ModelArch
from pdserve.model.llama import LayerHook
from pdserve.model.tp import TensorParallelPlan, plan_tensor_parallel
from pdserve.parallel.group import GroupSpec, TensorParallelError, TensorParallelGroup
from pdserve.parallel.messages import StepMessage

FULL_GROUP = "full"
SLIDING_GROUP = "sliding"


@dataclass(frozen=True)
class ModelOutput:
    """Rows of `logits`/`hidden` for the chunks that sample (ScheduledChunk.num_sample_rows rows
    each: the last known position, then one per draft token) or that end a prefill-only request
    (one row), in chunk order."""

    logits: torch.Tensor               # [S, V] float32
    hidden: torch.Tensor               # [S, hidden] final-norm hidden state of those positions
    chunk_rows: dict[str, int]         # request_id -> its first row in logits/hidden
    # [T, hidden] every fed token's final-norm hidden state, in the step's token order (execute's
    # all_hidden; a draft head's history, E20); None when not asked for
    all_hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchKey:
    """Which tables a layer reads and through which window."""

    group: str                  # cache group whose block tables hold the layer's pages
    window: int | None          # sliding window in tokens; None = full attention


@dataclass(frozen=True)
class StepInputs:
    """One forward pass's inputs: token-wise tensors plus one attention batch per BatchKey."""

    input_ids: torch.Tensor                # [T] int64
    positions: torch.Tensor                # [T] int64
    batches: tuple[AttentionBatch, ...]    # one per key in ModelRunner.batch_keys
    out_rows: list[int]                    # rows of the flat token axis whose logits are wanted


def layer_batch_keys(arch: ModelArch, group_names: tuple[str, ...]) -> tuple[BatchKey, ...]:
    """The BatchKey of every layer, given the cache's groups; ValueError when a layer's group
    is missing."""
    keys = []
    for i, layer_type in enumerate(arch.layer_types):
        if layer_type == SLIDING_ATTENTION:
            group = SLIDING_GROUP if SLIDING_GROUP in group_names else FULL_GROUP
            key = BatchKey(group, arch.sliding_window)
        else:
            key = BatchKey(FULL_GROUP, None)
        if key.group not in group_names:
            raise ValueError(
                f"layer {i} ({layer_type}) needs attention group {key.group!r} but the cache has {group_names}"
            )
        keys.append(key)
    return tuple(keys)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,             # LlamaForCausalLM, Gemma3ForCausalLM, ... (pdserve.model.registry)
        kv_cache: PagedKVCache,
        cache_manager: KVCacheManager,
        backend: AttentionBackend,
        padding_block: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.model = model
        self.tp = tp
        self.kv = kv_cache
        self.cache_manager = cache_manager
        self.backend = backend
        self.page_size = kv_cache.shape.page_size
        self.padding_block = padding_block
        per_layer = layer_batch_keys(model.arch, tuple(cache_manager.group_names))
        self.batch_keys: tuple[BatchKey, ...] = tuple(dict.fromkeys(per_layer))
        self.groups: tuple[str, ...] = tuple(dict.fromkeys(k.group for k in self.batch_keys))
        # layer i reads batch_keys[self.layer_batch[i]]
        self.layer_batch: tuple[int, ...] = tuple(self.batch_keys.index(k) for k in per_layer)
        self._head_ids = torch.arange(kv_cache.shape.kv_heads)                # [H]

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing at TP 1)."""
        if self.tp is not None:
            self.tp.close()

    def build_batches(self, chunks: tuple[ScheduledChunk, ...]) -> StepInputs:
        """The step's token ids and positions, and one attention batch per BatchKey."""
        P = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        ctx_lens: list[int] = []
        q_lens: list[int] = []
        out_rows: list[int] = []
        tables: dict[str, list[list[int]]] = {g: [] for g in self.groups}
        slot_pages: dict[str, list[int]] = {g: [] for g in self.groups}
        num_decode = 0
        for c in chunks:
            r = c.request
            tokens.extend(r.token_slice(c.start, c.start + c.num_known))
            tokens.extend(c.draft_token_ids)   # speculative: verified at their positions (E20)
            span = range(c.start, c.end)
            positions.extend(span)
            n_pages = -(-c.end // P)
            for g in self.groups:
                table = self.cache_manager.block_table(r.request_id, g)
                if len(table) < n_pages:
                    raise RuntimeError(
                        f"{r!r}: group {g!r} table has {len(table)} pages, the chunk [{c.start}, {c.end}) "
                        f"needs {n_pages} of {P} tokens"
                    )
                slot_pages[g].extend(table[p // P] for p in span)
                tables[g].append(table[:n_pages])
            query_start.append(query_start[-1] + c.num_tokens)
            q_lens.append(c.num_tokens)
            ctx_lens.append(c.end)
            if c.num_tokens == 1 and num_decode == len(q_lens) - 1:
                num_decode += 1
            if c.samples:   # the last known position, and every draft position after it
                out_rows.extend(range(query_start[-1] - c.num_sample_rows, query_start[-1]))
            elif r.prefill_only and c.end == r.target_computed_tokens:
                out_rows.append(query_start[-1] - 1)
        positions_t = torch.tensor(positions, dtype=torch.int64)                # [T]
        offs_t = positions_t % P                                               # [T]
        query_start_t = torch.tensor(query_start, dtype=torch.int32)           # [S + 1]
        context_lens_t = torch.tensor(ctx_lens, dtype=torch.int32)             # [S]
        H = self.kv.shape.kv_heads
        per_group: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for g in self.groups:
            if self.padding_block in slot_pages[g]:
                raise RuntimeError(
                    f"group {g!r}: a token of this step would write its K/V into the padding block "
                    f"{self.padding_block} (a table entry in the written span was recycled)"
                )
            max_pages = max(len(t) for t in tables[g])
            pad = self.padding_block
            block_tables = torch.tensor([t + [pad] * (max_pages - len(t)) for t in tables[g]],
                                        dtype=torch.int32)                      # [S, max_pages]
            pages_t = torch.tensor(slot_pages[g], dtype=torch.int64)            # [T]
            # kv_rows[t * H + h] = (page * H + h) * P + offset
            kv_rows = ((pages_t[:, None] * H + self._head_ids[None, :]) * P + offs_t[:, None]).reshape(-1)
            per_group[g] = (block_tables, pages_t, kv_rows)
        batches = []
        for key in self.batch_keys:
            block_tables, pages_t, kv_rows = per_group[key.group]
            batches.append(AttentionBatch(
                query_start=query_start_t,
                context_lens=context_lens_t,
                block_tables=block_tables,
                slot_pages=pages_t,
                slot_offsets=offs_t,
                kv_rows=kv_rows,
                num_decode=num_decode,
                q_lens=tuple(q_lens),
                ctx_lens=tuple(ctx_lens),
                page_size=P,
                window=key.window,
            ))
        return StepInputs(torch.tensor(tokens, dtype=torch.int64), positions_t, tuple(batches), out_rows)

    def plan(self, batches: tuple[AttentionBatch, ...]) -> object:
        """The backend plan the model takes: the one batch's plan, or one plan per layer."""
        plans = [self.backend.plan(b) for b in batches]
        if len(plans) == 1:
            return plans[0]
        return LayerPlans(tuple(plans[i] for i in self.layer_batch))

    def execute(self, sched: SchedulerOutput, layer_hook: LayerHook | None = None,
                all_hidden: bool = False) -> ModelOutput:
        step = self.build_batches(sched.chunks)
        out_rows = torch.tensor(step.out_rows, dtype=torch.int64)
        logits, hidden = self._forward(step, out_rows, layer_hook, all_hidden=all_hidden)
        every = None
        if all_hidden:
            every, hidden = hidden, hidden[out_rows]
        rows: dict[str, int] = {}
        i = 0
        for c in sched.chunks:
            r = c.request
            if c.samples:
                rows[r.request_id] = i
                i += c.num_sample_rows
            elif r.prefill_only and c.end == r.target_computed_tokens:
                rows[r.request_id] = i
                i += 1
        return ModelOutput(logits=logits, hidden=hidden, chunk_rows=rows, all_hidden=every)

    def forward_chunks(self, chunks: Sequence[ScheduledChunk], logits_of: Sequence[int],
                       num_layers: int | None = None) -> torch.Tensor:
        """A pass over `chunks` outside the engine's schedule (a draft model's, E20): writes their
        K/V and returns the logits of the last token of chunks[i] for i in `logits_of`,
        [len(logits_of), V] float32. `num_layers`: only the model's first layers (a self-draft),
        then its final norm and lm_head; under tensor parallelism every rank runs those layers."""
        step = self.build_batches(tuple(chunks))
        ends = list(itertools.accumulate(c.num_tokens for c in chunks))
        rows = torch.tensor([ends[i] - 1 for i in logits_of], dtype=torch.int64)           # [S]
        logits, _ = self._forward(step, rows, None, num_layers)
        return logits

    def _forward(self, step: StepInputs, rows: torch.Tensor, layer_hook: LayerHook | None,
                 num_layers: int | None = None, all_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the model (every rank's, under tensor parallelism): logits of `rows` ([S]
        indices into the step's tokens) and their hidden states (every token's: `all_hidden`)."""
        tp = self.tp
        if tp is not None:
            tp.send_step(StepMessage(step.input_ids, step.positions, step.batches, num_layers))
        only: dict[str, object] = {} if num_layers is None else {"num_layers": num_layers}
        if all_hidden:
            only["all_hidden"] = True
        try:
            return self.model(step.input_ids, step.positions, self.kv.k, self.kv.v, self.backend,
                              self.plan(step.batches), rows, layer_hook, **only)
        except Exception as exc:
            # Any failure on the leader leaves the workers inside this pass's collectives: the group
            # is failed for good (a later pass would run them out of step).
            if tp is None or isinstance(exc, TensorParallelError):
                raise
            tp.fail(f"a pass failed on the leader: {type(exc).__name__}: {exc}")   # raises
            raise


# Families whose model classes take a tensor-parallel shard (pdserve/model/tp.py).
TP_FAMILIES = ("llama", "gemma3")


def tensor_parallel_plan(tensor_parallel_size: int, arch: ModelArch) -> TensorParallelPlan | None:
    """The model's split over the engine's ranks (None at TP 1); ValueError naming the counts when it
    cannot be made, or for a family tensor parallelism does not run. Hybrid attention runs where its
    family does (Gemma 3); a Llama-family hybrid is refused by the model registry either way."""
    if tensor_parallel_size == 1:
        return None
    if arch.family not in TP_FAMILIES:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size}: tensor parallelism runs the families "
                         f"{TP_FAMILIES}, not {arch.family!r} (model_type {arch.model_type!r})")
    return plan_tensor_parallel(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, tensor_parallel_size)


def start_tensor_parallel(plan: TensorParallelPlan, model: nn.Module, kv_cache: PagedKVCache, model_path: str,
                          dtype: str, max_model_len: int, small_batch_max_tokens: int, attention_backend: str,
                          kv_prefault: bool, tp_invariant: bool = True) -> TensorParallelGroup:
    """Start ranks 1..N-1 for an engine whose leader holds `model` (rank 0's shard) and `kv_cache`
    (rank 0's pool), and connect the leader's row-parallel layers to the group."""
    s = kv_cache.shape
    kv_dtype = str(kv_cache.dtype).removeprefix("torch.")
    group = TensorParallelGroup.start(plan, GroupSpec(
        model_path=model_path, dtype=dtype, kv_dtype=kv_dtype, max_model_len=max_model_len,
        small_batch_max_tokens=small_batch_max_tokens, tp_invariant=tp_invariant,
        attention_backend=attention_backend,
        num_blocks=s.num_pages, page_size=s.page_size, num_layers=s.num_layers, head_dim=s.head_dim,
        kv_element_size=kv_cache.buffer.element_size(), kv_populate=kv_prefault))
    model.set_tp_comm(group.comm)
    return group


def tp_shard_pools(tp: TensorParallelGroup | None, kv_cache: PagedKVCache) -> tuple[KvShardPool, ...]:
    """Every rank's KV pool as the leader maps it (KvCacheSpec.shards): rank 0's is `kv_cache`'s
    buffer, the others' the shared-memory mappings (D15); () at TP 1."""
    if tp is None:
        return ()
    heads = tp.plan.kv_head_assignment
    pools = (kv_cache.buffer, *tp.pool_tensors())
    return tuple(KvShardPool(rank=r, buffer=b, kv_heads=heads[r]) for r, b in enumerate(pools))
