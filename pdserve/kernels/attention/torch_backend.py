"""Attention with plain torch ops on gathered pages (the CPU reference backend).

Decodes are batched: their pages are gathered into [B, Hkv, L, D] and one SDPA call with a
padding mask serves all of them. Prefill chunks run one SDPA call each over their own pages
(selective batching, E2). Query heads are folded per KV head ([Hkv, q_len * G, D]) so that K/V
are never repeated for grouped-query attention.

With a sliding window, each sequence gathers only the pages from its first query's window on
(recycled table entries before it are never read) and the mask also hides keys that left the
window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention.base import AttentionBackend, AttentionBatch, write_kv


@dataclass(frozen=True)
class _PrefillSeq:
    q_start: int
    q_len: int
    ctx_len: int
    key_start: int             # position of the first key read (page-aligned; 0 without a window)
    pages: torch.Tensor        # [num_pages] int64: pages of keys key_start..ctx_len-1
    own_kv: bool               # the chunk's own k, v are the whole context (a fresh prompt)
    mask: torch.Tensor | None  # [q_len, ctx_len - key_start] bool (True = attend); None = causal


@dataclass(frozen=True)
class TorchPlan:
    batch: AttentionBatch
    decode_pages: torch.Tensor | None   # [B, max_pages] int64
    decode_mask: torch.Tensor | None    # [B, 1, 1, max_pages * P] bool
    prefills: tuple[_PrefillSeq, ...]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def plan(self, batch: AttentionBatch) -> TorchPlan:
        P = batch.page_size
        nd = batch.num_decode
        W = batch.window
        decode_pages = decode_mask = None
        if nd and W is None:
            max_ctx = max(batch.ctx_lens[:nd])
            max_pages = -(-max_ctx // P)
            decode_pages = batch.block_tables[:nd, :max_pages].long()
            pos = torch.arange(max_pages * P)                                   # [L]
            decode_mask = (pos[None, :] < batch.context_lens[:nd, None]).view(nd, 1, 1, -1)
        elif nd:
            # Each decode reads from the page holding its window's first key: ctx - W.
            ctx = batch.context_lens[:nd].long()                                # [B]
            first = (ctx - W).clamp(min=0) // P                                 # [B]
            n = int(((ctx + P - 1) // P - first).max())
            idx = (first[:, None] + torch.arange(n)[None, :]).clamp(max=batch.block_tables.shape[1] - 1)
            decode_pages = batch.block_tables[:nd].long().gather(1, idx)        # [B, n]
            pos = first[:, None] * P + torch.arange(n * P)[None, :]             # [B, n*P]
            decode_mask = ((pos < ctx[:, None]) & (pos >= (ctx - W)[:, None])).view(nd, 1, 1, -1)
        prefills = []
        for s in range(nd, batch.num_seqs):
            q_len, ctx = batch.q_lens[s], batch.ctx_lens[s]
            key_start = 0 if W is None else max(0, ctx - q_len - W + 1) // P * P
            pages = batch.block_tables[s, key_start // P : -(-ctx // P)].long()
            mask = None
            if ctx != q_len or W is not None:
                q_pos = torch.arange(ctx - q_len, ctx)[:, None]                  # [q_len, 1]
                k_pos = torch.arange(key_start, ctx)[None, :]                    # [1, L]
                mask = k_pos <= q_pos                                           # [q_len, L]
                if W is not None:
                    mask &= k_pos > q_pos - W
            prefills.append(_PrefillSeq(int(batch.query_start[s]), q_len, ctx, key_start, pages,
                                        ctx == q_len, mask))
        return TorchPlan(batch, decode_pages, decode_mask, tuple(prefills))

    def forward(self, q, k, v, k_pool, v_pool, plan: object, scale: float) -> torch.Tensor:
        assert isinstance(plan, TorchPlan)
        write_kv(k, v, k_pool, v_pool, plan.batch)
        T, Hq, D = q.shape
        Hkv = k_pool.shape[1]
        G = Hq // Hkv
        out = torch.empty_like(q)                                                # [T, Hq, D]
        # A pool narrower than q (bfloat16 K/V under float32 math) is read widened; a fresh chunk's
        # own k, v are rounded through the pool's dtype, so every key reads as it is stored.
        widen = k_pool.dtype != q.dtype
        nd = plan.batch.num_decode
        if nd:
            B, max_pages = plan.decode_pages.shape
            # kd, vd: [B, Hkv, max_pages * P, D]
            kd = k_pool[plan.decode_pages].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
            vd = v_pool[plan.decode_pages].permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
            if widen:
                kd, vd = kd.to(q.dtype), vd.to(q.dtype)
            qd = q[:nd].view(nd, Hkv, G, D)                                      # [B, Hkv, G, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=scale)
            out[:nd] = od.reshape(nd, Hq, D)
        for seq in plan.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            if seq.own_kv:
                # Fresh prompt chunk: its own k, v are the whole context.
                ks = k[rows].transpose(0, 1)                                     # [Hkv, n, D]
                vs = v[rows].transpose(0, 1)
            else:
                L = seq.ctx_len - seq.key_start
                ks = k_pool[seq.pages].transpose(0, 1).reshape(Hkv, -1, D)[:, :L]  # [Hkv, L, D]
                vs = v_pool[seq.pages].transpose(0, 1).reshape(Hkv, -1, D)[:, :L]
            if widen:
                ks, vs = ks.to(k_pool.dtype).to(q.dtype), vs.to(k_pool.dtype).to(q.dtype)
            qs = q[rows].view(seq.q_len, Hkv, G, D).transpose(0, 1)              # [Hkv, n, G, D]
            if seq.mask is None:
                o = F.scaled_dot_product_attention(
                    qs.transpose(1, 2), ks[:, None], vs[:, None], is_causal=True, scale=scale
                )                                                                # [Hkv, G, n, D]
                o = o.permute(2, 0, 1, 3)                                        # [n, Hkv, G, D]
            else:
                qf = qs.reshape(Hkv, seq.q_len * G, D)                           # [Hkv, n*G, D]
                mask = seq.mask.repeat_interleave(G, dim=0)                      # [n*G, ctx]
                o = F.scaled_dot_product_attention(qf, ks, vs, attn_mask=mask, scale=scale)
                o = o.view(Hkv, seq.q_len, G, D).transpose(0, 1)                 # [n, Hkv, G, D]
            out[rows] = o.reshape(seq.q_len, Hq, D)
        return out
