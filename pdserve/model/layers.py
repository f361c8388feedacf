"""Building blocks of decoder models, laid out for tensor parallelism.

Linear layers come in the two Megatron flavours so that a later TP split is a matter of
`tp_rank`/`tp_size`: `MergedColumnLinear` (several logical outputs stacked, e.g. q|k|v or
gate|up, each split by output rows) and `RowLinear` (split by input columns; its partial outputs
are summed across ranks). With tp_size == 1 both are plain linear layers. Weights are loaded one
logical part at a time with `load_part`, which slices the rank's share.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.ops.linear import linear
from pdserve.kernels.ops.norm_act import add_rms_norm, rms_norm_reference
from pdserve.kernels.ops.rope_kv import rope
from pdserve.model.weights import CheckpointReader


class MergedColumnLinear(nn.Module):
    """y = x W^T (+ b) with W = [W_0; W_1; ...] stacked by output rows, each part split across ranks."""

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        for size in part_sizes:
            if size % tp_size:
                raise ValueError(f"output part of size {size} does not split over tp_size={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard_sizes = [s // tp_size for s in part_sizes]
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(self.shard_sizes))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None

    def load_part(self, index: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        size, off = self.shard_sizes[index], self.offsets[index]
        full = size * self.tp_size
        if weight.shape != (full, self.weight.shape[1]):
            raise ValueError(f"part {index}: expected weight {(full, self.weight.shape[1])}, got {tuple(weight.shape)}")
        shard = weight[self.tp_rank * size : (self.tp_rank + 1) * size]
        self.weight.data[off : off + size].copy_(shard)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"part {index}: checkpoint has a bias but the layer was built without one")
            self.bias.data[off : off + size].copy_(bias[self.tp_rank * size : (self.tp_rank + 1) * size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        return linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:  # y: [T, out] -> one [T, size] per part
        return torch.split(y, self.shard_sizes, dim=-1)


class RowLinear(nn.Module):
    """y = x W^T (+ b) with W split by input columns across ranks (partial sums reduced by the caller)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"input size {in_features} does not split over tp_size={tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_shard = in_features // tp_size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_shard, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        expected = (self.weight.shape[0], self.in_shard * self.tp_size)
        if weight.shape != expected:
            raise ValueError(f"expected weight {expected}, got {tuple(weight.shape)}")
        self.weight.data.copy_(weight[:, self.tp_rank * self.in_shard : (self.tp_rank + 1) * self.in_shard])
        if bias is not None:
            if self.bias is None:
                raise ValueError("checkpoint has a bias but the layer was built without one")
            # The bias is added once, by rank 0, so the sum across ranks counts it once.
            self.bias.data.copy_(bias if self.tp_rank == 0 else torch.zeros_like(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_shard] -> [T, out]
        return linear(x, self.weight, self.bias)


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
