"""The attention-backend seam: how new K/V enter the paged pool and how queries read it.

Ownership: the model runner builds one `AttentionBatch` per forward pass and asks the backend to
`plan` it once; the model then calls `forward` once per layer with that plan. The backend owns the
write of the step's K/V into the pool (a GPU backend such as flashinfer has its own append
kernel) and the attention itself. It never allocates pages or touches the scheduler.

Threading: `plan` and `forward` are called from the engine thread only, inside the forward pass.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from pdserve.kernels.ops.rope_kv import write_kv_rows


@dataclass(frozen=True)
class AttentionBatch:
    """The sequences of one forward pass, as attention sees them.

    Sequences 0..num_decode-1 have exactly one query (decodes); the rest are prefill chunks.
    Query rows of sequence s are query_start[s]:query_start[s+1] of the flat token axis.
    context_lens[s] counts the tokens of s in the cache after this step's tokens are written, so
    query i of s sits at position p = context_lens[s] - q_len_s + i and attends to positions <= p;
    with a sliding `window` W, only to positions in (p - W, p].

    Block tables use logical indexing (entry i holds positions [i*P, (i+1)*P)). With a window,
    entries of pages wholly before the window of a sequence's first query may point at the
    padding block (a sliding-window allocator recycled them): backends never read them.
    """

    query_start: torch.Tensor    # [S + 1] int32
    context_lens: torch.Tensor   # [S] int32
    block_tables: torch.Tensor   # [S, max_pages] int32, padded with a padding block id
    slot_pages: torch.Tensor     # [T] int64: page of each new token's K/V
    slot_offsets: torch.Tensor   # [T] int64: slot inside that page
    kv_rows: torch.Tensor        # [T * Hkv] int64: row of each (token, kv head) in a pool viewed as [N*Hkv*P, D]
    num_decode: int
    q_lens: tuple[int, ...]      # host copies, for per-sequence loops
    ctx_lens: tuple[int, ...]
    page_size: int
    window: int | None = None    # sliding window in tokens; None = full attention

    def __post_init__(self) -> None:
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"AttentionBatch.window must be None or an integer >= 1, got {w!r}")

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_pages.shape[0])


@dataclass(frozen=True)
class LayerPlans:
    """One backend plan per layer, for a model whose layers read different attention batches
    (a hybrid of sliding-window and full-attention layers): `plans[i]` serves layer i. A model
    whose layers all share one batch gets that batch's plan itself instead."""

    plans: tuple[object, ...]


class AttentionBackend(abc.ABC):
    """One implementation per device family; selected by name through `get_backend`."""

    name: str = ""

    @abc.abstractmethod
    def plan(self, batch: AttentionBatch) -> object:
        """Precompute what every layer of this pass reuses (masks, index tensors)."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,       # [T, Hq, D]
        k: torch.Tensor,       # [T, Hkv, D]
        v: torch.Tensor,       # [T, Hkv, D]
        k_pool: torch.Tensor,  # [N, Hkv, P, D]
        v_pool: torch.Tensor,  # [N, Hkv, P, D]
        plan: object,
        scale: float,
    ) -> torch.Tensor:         # [T, Hq, D]
        """Write k, v into their slots, then attend every query over its sequence's pages."""


def write_kv(
    k: torch.Tensor,          # [T, Hkv, D]
    v: torch.Tensor,          # [T, Hkv, D]
    k_pool: torch.Tensor,     # [N, Hkv, P, D]
    v_pool: torch.Tensor,     # [N, Hkv, P, D]
    batch: AttentionBatch,
) -> None:
    """Scatter the step's K/V rows into their pages (HND: page, head, slot, dim), converted to the
    pool's dtype: one row copy per (token, kv head) into the pool seen as a [N*Hkv*P, D] matrix."""
    write_kv_rows(k, v, k_pool, v_pool, batch.kv_rows)
