"""Attention through the C paged-attention kernel (pdserve/attention/csrc), reading pages in place.

Decode and prefill chunks of a whole pass go through one kernel call per layer: the kernel walks
each sequence's block table itself, so no K/V is gathered or copied. A batch's sliding window is
passed through: the kernel then skips the pages before each sequence's window.
"""

from __future__ import annotations

import torch

from pdserve.attention import cpu_kernels
from pdserve.attention.base import AttentionBackend, AttentionBatch, write_kv


class CpuKernelAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels.available():
            raise RuntimeError(f"the C attention kernels are not built: {cpu_kernels.unavailable_reason()}")

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        return batch

    def forward(self, q, k, v, k_pool, v_pool, plan: object, scale: float) -> torch.Tensor:
        assert isinstance(plan, AttentionBatch)
        write_kv(k, v, k_pool, v_pool, plan)
        out = torch.empty_like(q)                                                # [T, Hq, D]
        cpu_kernels.paged_attention(
            out, q, k_pool, v_pool, plan.block_tables, plan.query_start, plan.context_lens, scale,
            window=plan.window,
        )
        return out
