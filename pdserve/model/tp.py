"""Tensor parallelism of a decoder (Llama family and Gemma 3): which heads and MLP rows each rank
holds, and the TP-invariant fold of the row-parallel sums (E22, issue 16). Both families split the
same way: column-parallel q|k|v and gate|up, row-parallel o_proj and down_proj; everything else
(embedding, norms, Gemma's embedding scale and q/k norms, which are per head) is replicated.

Head assignment (`shard_kv_heads`, `shard_query_heads`), K KV heads over N ranks: THE rule, written
only here. The engine's ranks hold their heads by it, and the transfer plan applies it to both
sides of a transfer (kv_messenger/shard_plan.py reaches it through the engine's connector seam,
pdserve.engine.kv_connector, as the layering forbids kv_messenger the model room; how prefill and
decode nodes of different TP sizes pair: docs/tp-shard-mismatch.md):

- N <= K: contiguous whole GQA groups; when K % N != 0 the earlier ranks get the extra group
  (K=3, N=2: rank 0 holds KV heads {0, 1}, rank 1 holds {2}); each rank holds the query heads of
  its groups.
- N > K with N % K == 0: replica sets; rank r holds KV head r // (N / K) (ranks [h*R, (h+1)*R)
  form head h's replica set), and that head's G query heads split evenly over its R = N / K
  replicas (refused unless G % R == 0).
- anything else is refused with a ValueError naming the counts.

The MLP splits by whole fold blocks of the intermediate axis (below), contiguous, the earlier
ranks getting the extra block; a tensor-parallel size above the number of blocks is refused.

TP-invariant reductions. A row-parallel layer (o_proj, down_proj) sums over its input axis, which
the ranks split; float addition is not associative, so summing each rank's share and then the
shares would round differently at every TP size. Instead the input axis is cut into fixed fold
blocks whatever the TP size, each output is the left fold ((b0 + b1) + b2) + ... of its blocks'
dot products (each block's dot summed by the one kernel of the pass: the C few-row kernel or
torch's matmul), and bias is added last. A rank's blocks are contiguous and in order, so the
ranks continue one left fold in rank order (`RowLinear.forward`: rank 0 folds its prefix and
sends it on; rank r adds its blocks' partials to what arrives from rank r - 1; the last rank adds
the bias and broadcasts). TP 1 runs the same blocked fold when asked to, so TP 1 and TP N give the
same bits. The engine folds in blocks only where that is needed (EngineConfig.tp_invariant; auto:
on iff tensor_parallel_size > 1): the blocked fold slows a TP 1 prefill
(bench/results/tp/tp_invariant.md), so a single-shard engine keeps the plain kernels' sums unless it
must give bit-identical KV / logits to TP > 1 engines of its cluster (e.g. a TP 1 decode node
behind TP 2 prefill nodes): then it runs with --tp-invariant (`pdserve up` passes it to every node
of a cluster where any node runs TP > 1).
Fold blocks: o_proj `o_proj_fold_heads` query heads (the finest split any supported TP size
makes: a whole GQA group unless replica sets of some TP size <= MAX_TP_SIZE split groups);
down_proj `MLP_FOLD_BLOCKS` blocks of the intermediate axis (a multiple of 8 wide). Tensor-parallel
sizes above MAX_TP_SIZE are refused. Only float32
models fold in blocks; other dtypes fold the ranks' whole shares in rank order (deterministic,
not TP-invariant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# down_proj's input axis is folded in this many blocks (at most): the largest TP size an MLP splits to.
MLP_FOLD_BLOCKS = 8
MAX_TP_SIZE = MLP_FOLD_BLOCKS


class TPComm(Protocol):
    """Point-to-point and broadcast between the ranks of one engine (pdserve.parallel.comm)."""

    rank: int
    size: int

    def send(self, t: torch.Tensor, dst: int) -> None: ...

    def recv(self, t: torch.Tensor, src: int) -> None: ...

    def broadcast(self, t: torch.Tensor, src: int) -> None: ...


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def shard_kv_heads(num_kv_heads: int, tp_size: int) -> tuple[tuple[int, ...], ...]:
    """[tp_size] the global KV heads each rank holds (ascending, contiguous), by the module
    docstring's rule: K=3, N=2 -> rank 0 (0, 1), rank 1 (2,); replicas (N > K, N % K == 0): rank r
    holds KV head r // (N / K). ValueError naming both counts when no split exists."""
    k, n = num_kv_heads, tp_size
    if not (_is_count(k) and _is_count(n)):
        raise ValueError(f"cannot split {k!r} KV heads over tensor-parallel size {n!r}: both must be integers >= 1")
    if n > k:
        if n % k:
            raise ValueError(f"cannot split {k} KV heads over tensor-parallel size {n}: with more ranks than KV "
                             f"heads the size must be a multiple of the KV head count (replica sets), and "
                             f"{n} % {k} = {n % k}")
        return tuple((rank // (n // k),) for rank in range(n))
    base, extra = divmod(k, n)
    out, start = [], 0
    for rank in range(n):
        count = base + (1 if rank < extra else 0)
        out.append(tuple(range(start, start + count)))
        start += count
    return tuple(out)


def shard_query_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[tuple[int, int], ...]:
    """[tp_size] [start, end) of the global query heads each rank holds: its groups' heads, or under
    replication its share of its KV head's group. ValueError naming the counts."""
    kv = shard_kv_heads(num_kv_heads, tp_size)    # validates both counts first (no division by 0)
    if not _is_count(num_heads) or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads!r} query heads are not whole GQA groups of {num_kv_heads} KV heads")
    g = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        return tuple((heads[0] * g, (heads[-1] + 1) * g) for heads in kv)
    r = tp_size // num_kv_heads
    if g % r:
        raise ValueError(f"cannot split {num_heads} query heads ({g} per KV head, {num_kv_heads} KV heads) over "
                         f"tensor-parallel size {tp_size}: each KV head's {r} replicas need {g} % {r} == 0")
    per = g // r
    return tuple((heads[0] * g + (rank % r) * per, heads[0] * g + (rank % r + 1) * per)
                 for rank, heads in enumerate(kv))


def o_proj_fold_heads(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per o_proj fold block: G / lcm(R) over the replica-set sizes R that split a group
    of G heads at some TP size K * R <= MAX_TP_SIZE (G when no supported size splits a group)."""
    g = num_heads // num_kv_heads
    lcm = 1
    for r in range(2, g + 1):
        if g % r == 0 and num_kv_heads * r <= MAX_TP_SIZE:
            lcm = lcm * r // math.gcd(lcm, r)
    return g // lcm


def mlp_fold_block(intermediate_size: int) -> int:
    """Width of down_proj's fold blocks: intermediate / MLP_FOLD_BLOCKS rounded up to a multiple of 8."""
    per = -(-intermediate_size // MLP_FOLD_BLOCKS)
    return -(-per // 8) * 8


@dataclass(frozen=True)
class RankShard:
    """What one rank of a TP group holds of each layer (global indices, [start, end) ranges)."""

    rank: int
    tp_size: int
    kv_heads: tuple[int, ...]       # global KV heads, ascending, contiguous
    q_heads: tuple[int, int]        # [start, end) global query heads
    mlp_rows: tuple[int, int]       # [start, end) of the intermediate axis (whole fold blocks)
    mlp_block: int                  # down_proj fold block width (the intermediate axis)
    o_fold_heads: int               # query heads per o_proj fold block


@dataclass(frozen=True)
class TensorParallelPlan:
    """The split of one model over `tp_size` ranks (module docstring); `ranks[r]` is rank r's shard."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    ranks: tuple[RankShard, ...]

    @property
    def kv_head_assignment(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the global KV heads it holds (what a transfer plan shards by)."""
        return tuple(r.kv_heads for r in self.ranks)


def plan_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int,
                         tp_size: int) -> TensorParallelPlan:
    """The shards of a model with these counts over tp_size ranks; ValueError naming the counts
    when the split cannot be made (heads, or more ranks than MLP fold blocks)."""
    if tp_size > MAX_TP_SIZE:
        raise ValueError(f"tensor_parallel_size {tp_size} is above the largest supported, {MAX_TP_SIZE}")
    try:
        kv = shard_kv_heads(num_kv_heads, tp_size)
        q = shard_query_heads(num_heads, num_kv_heads, tp_size)
    except ValueError as e:   # name the engine's setting too: the rule speaks of tensor-parallel sizes
        raise ValueError(f"{num_heads} query heads and {num_kv_heads} KV heads over tensor_parallel_size "
                         f"{tp_size}: {e}") from e
    o_heads = o_proj_fold_heads(num_heads, num_kv_heads)
    block = mlp_fold_block(intermediate_size)
    nblocks = -(-intermediate_size // block)
    if tp_size > nblocks:
        raise ValueError(f"cannot split intermediate_size {intermediate_size} ({nblocks} fold blocks of {block}) over "
                         f"tensor_parallel_size {tp_size}: at most {nblocks} ranks")
    base, extra = divmod(nblocks, tp_size)
    ranks, start = [], 0
    for r in range(tp_size):
        n = base + (1 if r < extra else 0)
        rows = (start * block, min((start + n) * block, intermediate_size))
        ranks.append(RankShard(r, tp_size, kv[r], q[r], rows, block, o_heads))
        start += n
    return TensorParallelPlan(tp_size, num_heads, num_kv_heads, intermediate_size, tuple(ranks))


def row_fold_block(block: int, dtype: torch.dtype, invariant: bool) -> int | None:
    """A row-parallel layer's fold block: the TP-invariant `block` for float32 models when
    tp_invariant is on, None (one block: each rank's whole share) when it is off or for other dtypes."""
    return block if invariant and dtype == torch.float32 else None


def single_rank(num_heads: int, num_kv_heads: int, intermediate_size: int) -> RankShard:
    """The one shard of TP 1 (every head, the whole MLP, the same fold blocks as any TP size)."""
    return plan_tensor_parallel(num_heads, num_kv_heads, intermediate_size, 1).ranks[0]
