"""The model runner: turns a SchedulerOutput into tensors, runs one forward pass, returns logits.

It owns the model, the KV cache tensors and the attention backend. It knows nothing of queues or
sampling: the scheduler decides what runs, the sampler decides what comes out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend, AttentionBatch
from pdserve.cache.kv_cache import PagedKVCache
from pdserve.cache.manager import KVCacheManager
from pdserve.model.llama import LayerHook, LlamaForCausalLM
from pdserve.scheduler.output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class ModelOutput:
    """Rows of `logits`/`hidden` belong to `chunks[i]` for i in `rows_for` (chunks that sample
    or that end a prefill-only request)."""

    logits: torch.Tensor               # [S, V] float32
    hidden: torch.Tensor               # [S, hidden] final-norm hidden state of those positions
    chunk_rows: dict[str, int]         # request_id -> row in logits/hidden


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        cache_manager: KVCacheManager,
        backend: AttentionBackend,
        padding_block: int = 0,
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.cache_manager = cache_manager
        self.backend = backend
        self.page_size = kv_cache.shape.page_size
        self.padding_block = padding_block

    def build_batch(self, chunks: tuple[ScheduledChunk, ...]) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, list[int]]:
        """input_ids [T], positions [T], the attention batch, and the rows whose logits are wanted."""
        P = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_pages: list[int] = []
        slot_offsets: list[int] = []
        query_start = [0]
        ctx_lens: list[int] = []
        q_lens: list[int] = []
        tables: list[list[int]] = []
        out_rows: list[int] = []
        num_decode = 0
        for c in chunks:
            r = c.request
            table = self.cache_manager.block_table(r.request_id)
            tokens.extend(r.token_slice(c.start, c.end))
            span = range(c.start, c.end)
            positions.extend(span)
            slot_pages.extend(table[p // P] for p in span)
            slot_offsets.extend(p % P for p in span)
            query_start.append(query_start[-1] + c.num_tokens)
            q_lens.append(c.num_tokens)
            ctx_lens.append(c.end)
            tables.append(table[: -(-c.end // P)])
            if c.num_tokens == 1 and num_decode == len(q_lens) - 1:
                num_decode += 1
            if c.samples or (r.prefill_only and c.end == r.target_computed_tokens):
                out_rows.append(query_start[-1] - 1)
        max_pages = max(len(t) for t in tables)
        block_tables = torch.full((len(tables), max_pages), self.padding_block, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        pages_t = torch.tensor(slot_pages, dtype=torch.int64)
        offs_t = torch.tensor(slot_offsets, dtype=torch.int64)
        H = self.kv.shape.kv_heads
        # kv_rows[t * H + h] = (page * H + h) * P + offset
        kv_rows = ((pages_t[:, None] * H + torch.arange(H)[None, :]) * P + offs_t[:, None]).reshape(-1)
        batch = AttentionBatch(
            query_start=torch.tensor(query_start, dtype=torch.int32),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            block_tables=block_tables,
            slot_pages=pages_t,
            slot_offsets=offs_t,
            kv_rows=kv_rows,
            num_decode=num_decode,
            q_lens=tuple(q_lens),
            ctx_lens=tuple(ctx_lens),
            page_size=P,
        )
        return (
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            batch,
            out_rows,
        )

    def execute(self, sched: SchedulerOutput, layer_hook: LayerHook | None = None) -> ModelOutput:
        input_ids, positions, batch, out_rows = self.build_batch(sched.chunks)
        plan = self.backend.plan(batch)
        logits, hidden = self.model(
            input_ids,
            positions,
            self.kv.k,
            self.kv.v,
            self.backend,
            plan,
            torch.tensor(out_rows, dtype=torch.int64),
            layer_hook,
        )
        rows: dict[str, int] = {}
        i = 0
        for c in sched.chunks:
            r = c.request
            if c.samples or (r.prefill_only and c.end == r.target_computed_tokens):
                rows[r.request_id] = i
                i += 1
        return ModelOutput(logits=logits, hidden=hidden, chunk_rows=rows)
