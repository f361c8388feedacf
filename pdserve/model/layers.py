"""Building blocks of decoder models, laid out for tensor parallelism.

Linear layers come in the two Megatron flavours: `MergedColumnLinear` (several logical outputs
stacked, e.g. q|k|v or gate|up, a tensor-parallel rank holding a row range of each) and
`RowLinear` (a rank holds a range of input columns; the ranks' partial sums are folded in rank
order, TP-invariantly: pdserve/model/tp.py). Unsplit, both are plain linear layers (RowLinear's
sum in fold blocks). Weights are loaded one logical part at a time with `load_part`, which
slices the rank's share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.ops.linear import linear, linear_block_parts, linear_blocked
from pdserve.kernels.ops.norm_act import add_rms_norm, rms_norm_reference
from pdserve.kernels.ops.rope_kv import rope
from pdserve.model.arch import ModelArch
from pdserve.model.tp import RankShard, row_fold_block
from pdserve.model.weights import CheckpointReader


class MergedColumnLinear(nn.Module):
    """y = x W^T (+ b) with W = [W_0; W_1; ...] stacked by output rows; a tensor-parallel rank holds
    the rows [start, end) of each part (`part_rows`; None: every row)."""

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        part_rows: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        rows = [(0, s) for s in part_sizes] if part_rows is None else [tuple(r) for r in part_rows]
        if len(rows) != len(part_sizes):
            raise ValueError(f"{len(rows)} row ranges for {len(part_sizes)} parts")
        for size, (a, b) in zip(part_sizes, rows, strict=True):
            if not 0 <= a <= b <= size:
                raise ValueError(f"row range [{a}, {b}) is not inside an output part of size {size}")
        self.part_sizes = tuple(part_sizes)
        self.part_rows = tuple(rows)
        self.tp_split = part_rows is not None and any(r != (0, s) for r, s in zip(rows, part_sizes, strict=True))
        self.shard_sizes = [b - a for a, b in rows]
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None

    def load_part(self, index: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        size, off = self.shard_sizes[index], self.offsets[index]
        full = self.part_sizes[index]
        a, b = self.part_rows[index]
        if weight.shape != (full, self.weight.shape[1]):
            raise ValueError(f"part {index}: expected weight {(full, self.weight.shape[1])}, got {tuple(weight.shape)}")
        self.weight.data[off : off + size].copy_(weight[a:b])
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"part {index}: checkpoint has a bias but the layer was built without one")
            self.bias.data[off : off + size].copy_(bias[a:b])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        return linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:  # y: [T, out] -> one [T, size] per part
        return torch.split(y, self.shard_sizes, dim=-1)


class ShardedAttention(nn.Module):
    """What every attention layer's rank shares (Llama family, Gemma 3): its heads (all of them at
    TP 1) and the projections split by them, q|k|v column-parallel by output rows, o_proj
    row-parallel by input columns with `row_fold_block`'s blocked sums."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, shard: RankShard, invariant: bool, o_bias: bool) -> None:
        super().__init__()
        D = arch.head_dim
        q0, q1 = shard.q_heads
        kv0, kv1 = shard.kv_heads[0], shard.kv_heads[-1] + 1
        self.num_heads, self.num_kv_heads, self.head_dim = q1 - q0, kv1 - kv0, D
        q_size, kv_size = arch.num_heads * D, arch.num_kv_heads * D
        self.qkv_proj = MergedColumnLinear(arch.hidden_size, [q_size, kv_size, kv_size], arch.attention_bias, dtype,
                                           part_rows=[(q0 * D, q1 * D), (kv0 * D, kv1 * D), (kv0 * D, kv1 * D)])
        self.o_proj = RowLinear(q_size, arch.hidden_size, o_bias, dtype, in_cols=(q0 * D, q1 * D),
                                fold_block=row_fold_block(shard.o_fold_heads * D, dtype, invariant))


class RowLinear(nn.Module):
    """y = x W^T (+ b), summed over the input axis in fold blocks of `fold_block` columns (None:
    one block), left to right, then the bias (pdserve/model/tp.py). A tensor-parallel rank holds
    the input columns [start, end) (`in_cols`, whole fold blocks) and continues the fold of the rank
    before it through `comm` (set by the rank's runtime; None: this layer holds every column)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
        in_cols: tuple[int, int] | None = None, fold_block: int | None = None,
    ) -> None:
        super().__init__()
        a, b = (0, in_features) if in_cols is None else in_cols
        if not 0 <= a < b <= in_features:
            raise ValueError(f"input columns [{a}, {b}) are not inside an input of size {in_features}")
        if fold_block is not None and (fold_block < 1 or a % fold_block):
            raise ValueError(f"input columns [{a}, {b}) do not start on a fold block of {fold_block}")
        self.in_features, self.in_cols = in_features, (a, b)
        self.tp_split = (a, b) != (0, in_features)
        self.fold_block = b - a if fold_block is None else fold_block
        self.comm: object | None = None  # a pdserve.model.tp.TPComm when tp_split
        self.weight = nn.Parameter(torch.empty(out_features, b - a, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        expected = (self.weight.shape[0], self.in_features)
        if weight.shape != expected:
            raise ValueError(f"expected weight {expected}, got {tuple(weight.shape)}")
        a, b = self.in_cols
        self.weight.data.copy_(weight[:, a:b])
        if bias is not None:
            if self.bias is None:
                raise ValueError("checkpoint has a bias but the layer was built without one")
            self.bias.data.copy_(bias)  # every rank holds it; the fold's last rank adds it, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_shard] -> [T, out]
        comm = self.comm
        if comm is None or comm.size == 1:
            return linear_blocked(x, self.weight, self.bias, self.fold_block)
        r, n = comm.rank, comm.size
        if r == 0:      # the fold's prefix: rank 0's blocks, folded
            y = linear_blocked(x, self.weight, None, self.fold_block)          # [T, out]
            comm.send(y, 1)
        else:           # continue the fold of ranks 0 .. r-1 with this rank's blocks, in order
            parts = linear_block_parts(x, self.weight, self.fold_block)        # [nb, T, out]
            y = torch.empty_like(parts[0])                                     # [T, out]
            comm.recv(y, r - 1)
            for p in parts:
                y += p
            if r + 1 < n:
                comm.send(y, r + 1)
            elif self.bias is not None:
                y += self.bias
        comm.broadcast(y, n - 1)
        return y


def embedding_and_head(vocab_size: int, hidden_size: int, tied: bool,
                       dtype: torch.dtype) -> tuple[nn.Embedding, torch.Tensor]:
    """The token embedding and the lm_head weight [V, hidden]: the embedding's own weight when tied."""
    embed = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
    embed.weight.requires_grad_(False)
    if tied:
        return embed, embed.weight                                             # [V, hidden]
    return embed, nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)


def load_embedding_and_head(ckpt: CheckpointReader, embed: nn.Embedding, head: torch.Tensor, tied: bool) -> None:
    """Copy embed_tokens.weight and (untied) lm_head.weight; a tied checkpoint's stray lm_head copy is consumed."""
    ckpt.copy(embed.weight, "embed_tokens.weight")
    if tied:
        ckpt.take("lm_head.weight", required=False)  # some tied checkpoints still store a copy
    else:
        ckpt.copy(head, "lm_head.weight")


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementation does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., size]
        if x.dtype == torch.float32:
            # One fused kernel; in float32 it gives the same bits as the reference's op sequence.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """h += delta (in place: h is the residual stream), then the norm of h. h, delta: [T, size]."""
        return add_rms_norm(h, delta, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention) with precomputed cos/sin tables.

    rotate_half(x) * sin == roll(x, D/2) * sin_signed, where sin_signed negates the first half of
    sin: one roll instead of two slices, a negation and a concatenation, and bit-identical results
    ((-a) * b == a * (-b) in IEEE arithmetic). pdserve.kernels.ops.rope does that in one C pass per call
    (torch's roll / mul / add where the C path does not apply).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, dtype: torch.dtype):
        super().__init__()
        # inv_freq: [D/2]; positions: [max_positions]
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq.float())                                # [max_positions, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                                 # [max_positions, D]
        sin = emb.sin() * attention_scaling                                     # [max_positions, D]
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)         # [max_positions, D]
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin_signed", sin_signed.to(dtype), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for the step's positions ([T] -> [T, D] each), looked up once per pass."""
        return self.cos[positions], self.sin_signed[positions]

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # cos, sin_signed: [T, D]; q: [T, Hq, D]; k: [T, Hkv, D]
        return rope(q, *cos_sin), rope(k, *cos_sin)
