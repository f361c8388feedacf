"""Attention through the C paged-attention kernel (pdserve/kernels/attention/csrc), reading pages in place.

Decode and prefill chunks of a whole pass go through one kernel call per layer: the kernel walks
each sequence's block table itself, so no K/V is gathered or copied. A batch's sliding window is
passed through: the kernel then skips the pages before each sequence's window. The pass's
metadata (block tables, query starts, context lengths) is checked once, in `plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.attention import cpu_kernels
from pdserve.kernels.attention.base import AttentionBackend, AttentionBatch, write_kv


@dataclass(frozen=True)
class CpuPlan:
    """One pass's batch and its kernel metadata, checked once for every layer."""

    batch: AttentionBatch
    kernel: cpu_kernels.KernelBatch


class CpuKernelAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels.available():
            raise RuntimeError(f"the C attention kernels are not built: {cpu_kernels.unavailable_reason()}")

    def plan(self, batch: AttentionBatch) -> CpuPlan:
        return CpuPlan(batch, cpu_kernels.prepare_batch(batch.block_tables, batch.query_start, batch.context_lens,
                                                        batch.window))

    def forward(self, q, k, v, k_pool, v_pool, plan: object, scale: float) -> torch.Tensor:
        if not isinstance(plan, CpuPlan):
            raise TypeError(f"cpu attention backend: plan must come from its own plan(), got {type(plan).__name__}")
        write_kv(k, v, k_pool, v_pool, plan.batch)
        out = torch.empty_like(q)                                                # [T, Hq, D]
        cpu_kernels.run_batch(out, q, k_pool, v_pool, plan.kernel, scale)
        return out
