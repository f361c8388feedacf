"""Speculative rejection sampling (E20; Leviathan et al. 2023, Chen et al. 2023) for one sequence.

    out = rejection_sample(target_probs, draft_token_ids, draft_probs, generators)
    out.token_ids      # the accepted drafts, then one corrected (or bonus) token
    out.num_accepted   # how many drafts were accepted, 0..K

Inputs: the target's distribution p_i at each of the K draft positions and the bonus position
(`target_probs`: [K+1, V], ALREADY filtered by temperature/top-k/top-p/min-p as the sampler's
`_filtered_probs` does, so the procedure keeps that filtered distribution); the K draft tokens d_i;
the draft's distributions q_i (`draft_probs`: [K, V]) or None for a deterministic draft (n-gram, a
greedy draft model: q_i is one-hot at d_i).

The procedure, position i = 0..K-1: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the
first rejection emit a token drawn from the residual norm(max(0, p_i - q_i)) and stop; when all K are
accepted, emit a bonus token drawn from p_K. Every emitted token is then distributed exactly as the
target's p given the tokens before it, whatever q is (tests/unit/test_spec_rejection.py checks this
against exact enumeration, and that the usual mistakes fail the same check).

Edge cases, each explicit:
- p_i(d_i) == 0 (the target filtered the draft token out, e.g. a one-hot draft outside top-k):
  rejected with probability 1; the residual is then p_i itself with d_i's zero.
- one-hot q: the residual max(0, p_i - onehot(d_i)) is p_i with d_i zeroed, drawn directly.
- residual with no mass (p_i <= q_i everywhere, i.e. p_i == q_i up to rounding; a rejection then
  only happens through rounding): the token is drawn from p_i.
- q_i(d_i) == 0 with draft_probs given: d_i cannot have been drawn from q_i; ValueError naming the
  position and token (the guarantee needs d_i ~ q_i).
- K == 0: one token drawn from p_0, the same draw plain decoding makes (see randomness).

Randomness, one generator per output token: `generators[i]` serves only the step's output token
number i (i = 0..K; the same object may repeat, e.g. an unseeded request's shared generator, and
then serves the draws in order). For position i < K it first gives one uniform for the acceptance
test and, on a rejection, the residual's noise; the bonus position gives only the noise. Every
token is drawn by the sampler's exponential race, argmax(w / E) with E ~ Exp(1) per vocabulary entry
drawn with `exponential_` exactly as pdserve/engine/sampling/sampler.py does, so the bonus token
(and every token when K == 0) is bit-identical to what the sampler draws from the same generator
state. A seeded request reseeds per token index (`token_seed`, Request.sample_generator):
`seeded_generators(seed, first_index, K + 1)` builds the list, and the step's result then depends
only on (seed, first_index, the inputs), never on the batch around it.

`rejection_sample_batch` is the same procedure over a leading batch dimension with the randomness
given as tensors (uniforms [N, K], noise [N, V]); `rejection_sample` computes the same for one
sequence, only for the row it needs, drawing the noise only for the one position that needs it (the
tests check the two agree draw for draw). Nothing here blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling.sampler import token_seed


@dataclass(frozen=True)
class RejectionResult:
    """What one sequence emits this step."""

    token_ids: tuple[int, ...]  # accepted drafts (num_accepted of them), then one corrected or bonus token
    num_accepted: int           # 0..K; == K means the last token is the bonus


def seeded_generators(seed: int, first_index: int, count: int, device: torch.device | str = "cpu",
                      ) -> list[torch.Generator]:
    """`count` generators, the i-th seeded for a seeded request's output token number first_index + i.

    first_index is the number of the step's first output token, what Request.sample_generator seeds
    for: rng_skip_tokens + tokens output so far. (Building one costs a few microseconds.)"""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"generator count must be an integer >= 1, got {count!r}")
    gens = []
    for i in range(count):
        g = torch.Generator(device=device)
        g.manual_seed(token_seed(seed, first_index + i))
        gens.append(g)
    return gens



def row_generators(request: Request, num_rows: int, default: torch.Generator) -> list[torch.Generator]:
    """One generator per sampled row of a request's chunk (1 + its drafts). A seeded request's
    row j draws as its output token number (tokens so far + j) would in plain decoding
    (sampler.token_seed); unseeded rows share `default` (the engine's), drawn in row order."""
    first = request.sample_generator() or default
    if num_rows == 1:
        return [first]
    if request.sampling.seed is None:
        return [first] * num_rows
    base = request.sampling.rng_skip_tokens + len(request.output_token_ids)
    return [first] + seeded_generators(request.sampling.seed, base + 1, num_rows - 1)

# ---- the procedure over a batch (randomness given) -----------------------------------------------


def num_accepted(p_draft: torch.Tensor, q_draft: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """How many leading drafts are accepted. All [N, K] (p and q at the draft tokens) -> [N] long in 0..K.

    Draft i is accepted when u_i < p_i(d_i) / q_i(d_i), written u * q < p (no division: p >= q always
    accepts since u < 1, p == 0 never does)."""
    rejected = ~(uniforms * q_draft < p_draft)  # rejected: [N, K]
    k = rejected.shape[-1]
    if k == 0:
        return torch.zeros(rejected.shape[:-1], dtype=torch.long, device=rejected.device)
    any_rejected = rejected.any(dim=-1)  # any_rejected: [N]
    first = rejected.to(torch.int8).argmax(dim=-1)  # first: [N]; argmax gives the first maximum
    return torch.where(any_rejected, first, torch.full_like(first, k))


def residual_weights(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised; rows with no mass fall back to p. [N, V] -> [N, V]."""
    r = (p - q).clamp_min_(0.0)  # r: [N, V]
    empty = r.sum(dim=-1, keepdim=True) <= 0.0  # empty: [N, 1]
    return torch.where(empty, p, r)


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: row n picks token v with probability weights[n, v] / sum(weights[n]).
    weights, noise (Exp(1) draws): [N, V] -> [N] long."""
    return (weights / noise.clamp(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _draft_rows(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int,
                dtype: torch.dtype) -> torch.Tensor:
    """q as [N, K, V]: the given draft_probs, or one-hot at the draft tokens."""
    if draft_probs is not None:
        return draft_probs
    onehot = torch.zeros((*draft_token_ids.shape, vocab), dtype=dtype, device=draft_token_ids.device)
    return onehot.scatter_(-1, draft_token_ids.unsqueeze(-1), 1.0)


def _final_weights(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                   accepted: torch.Tensor) -> torch.Tensor:
    """The distribution of each row's last emitted token: the residual at the first rejection, or p_K.
    target_probs: [N, K+1, V], draft_token_ids: [N, K], draft_probs: [N, K, V] | None, accepted: [N]."""
    n_rows, k1, vocab = target_probs.shape
    rows = torch.arange(n_rows, device=target_probs.device)  # rows: [N]
    p = target_probs[rows, accepted]  # p: [N, V]
    k = k1 - 1
    if k == 0:
        return p
    at = accepted.clamp(max=k - 1)  # at: [N]; rows with accepted == K keep p below
    if draft_probs is not None:
        q = draft_probs[rows, at]  # q: [N, V]
    else:
        q = torch.zeros_like(p).scatter_(1, draft_token_ids[rows, at].unsqueeze(1), 1.0)  # q: [N, V]
    return torch.where((accepted < k).unsqueeze(1), residual_weights(p, q), p)


def rejection_sample_batch(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                           draft_probs: torch.Tensor | None, uniforms: torch.Tensor, noise: torch.Tensor,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The procedure for N independent rows with the randomness given.

    target_probs: [N, K+1, V]; draft_token_ids: [N, K] long; draft_probs: [N, K, V] or None (one-hot);
    uniforms: [N, K] in [0, 1); noise: [N, V] Exp(1) draws for the last emitted token.
    Returns (num_accepted [N] long, last_token [N] long): row n emits draft_token_ids[n, :num_accepted[n]]
    then last_token[n]."""
    n_rows, k1, vocab = target_probs.shape
    k = k1 - 1
    rows = torch.arange(n_rows, device=target_probs.device).unsqueeze(1)  # rows: [N, 1]
    cols = torch.arange(k, device=target_probs.device).unsqueeze(0)  # cols: [1, K]
    p_draft = target_probs[rows, cols, draft_token_ids]  # p_draft: [N, K]
    q_draft = (draft_probs[rows, cols, draft_token_ids] if draft_probs is not None
               else torch.ones_like(p_draft))  # q_draft: [N, K]
    accepted = num_accepted(p_draft, q_draft, uniforms)  # accepted: [N]
    weights = _final_weights(target_probs, draft_token_ids, draft_probs, accepted)  # weights: [N, V]
    return accepted, race(weights, noise)


# ---- one sequence, per-position generators -------------------------------------------------------


def _check(target_probs: torch.Tensor, draft_token_ids: Sequence[int], draft_probs: torch.Tensor | None,
           generators: Sequence[torch.Generator]) -> None:
    k = len(draft_token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1 or target_probs.shape[1] == 0:
        raise ValueError(f"target_probs must be [K+1, V] = [{k + 1}, V] for {k} draft tokens, "
                         f"got shape {tuple(target_probs.shape)}")
    if not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be floating point, got dtype {target_probs.dtype}")
    vocab = target_probs.shape[1]
    bad = [t for t in draft_token_ids if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft token ids must be integers in [0, {vocab}), got {bad[:4]}")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (k, vocab):
            raise ValueError(f"draft_probs must be [K, V] = [{k}, {vocab}], got shape {tuple(draft_probs.shape)}")
        if draft_probs.device != target_probs.device:
            raise ValueError(f"draft_probs on {draft_probs.device}, target_probs on {target_probs.device}")
    if len(generators) != k + 1:
        raise ValueError(f"need K+1 = {k + 1} generators (one per output token), got {len(generators)}")


def _exponential(gen: torch.Generator, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [V], drawn as the sampler draws a row (on the generator's device, then moved)."""
    noise = torch.empty(vocab, dtype=torch.float32, device=gen.device).exponential_(generator=gen)  # noise: [V]
    return noise.to(device)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                     draft_probs: torch.Tensor | None, generators: Sequence[torch.Generator]) -> RejectionResult:
    """Verify one sequence's K drafts (see the module docstring).

    target_probs: [K+1, V] float (filtered target distributions at the K draft positions and the bonus
    position); draft_token_ids: K ints; draft_probs: [K, V] float or None (deterministic draft);
    generators: K+1, generators[i] for this step's output token number i."""
    _check(target_probs, draft_token_ids, draft_probs, generators)
    k = len(draft_token_ids)
    vocab = target_probs.shape[1]
    device = target_probs.device
    accepted = k
    if k:
        ids = torch.tensor([int(t) for t in draft_token_ids], dtype=torch.long, device=device)  # ids: [K]
        pos = torch.arange(k, device=device)  # pos: [K]
        p_list = target_probs[pos, ids].tolist()  # p(d_i), K floats (one device sync)
        q_list = draft_probs[pos, ids].tolist() if draft_probs is not None else [1.0] * k
        for i in range(k):
            if q_list[i] <= 0.0:
                raise ValueError(f"draft token {draft_token_ids[i]} at position {i} has draft probability "
                                 f"{q_list[i]}: it cannot have been drawn from draft_probs")
            gen = generators[i]
            u = torch.rand((), generator=gen, device=gen.device).item()
            if not u * q_list[i] < p_list[i]:  # the same test as num_accepted
                accepted = i
                break
    # what _final_weights computes, for the one row that is needed
    p = target_probs[accepted : accepted + 1]  # p: [1, V]
    if accepted == k:
        weights = p
    elif draft_probs is None:
        # max(0, p - onehot(d)) is p with d zeroed, bit for bit; with no mass left, p
        weights = p.clone()
        weights[0, int(draft_token_ids[accepted])] = 0.0
        if not float(weights.sum()) > 0.0:
            weights = p
    else:
        weights = residual_weights(p, draft_probs[accepted : accepted + 1])  # weights: [1, V]
    if not float(weights.sum()) > 0.0:
        raise ValueError(f"target_probs row {accepted} has no probability mass")
    noise = _exponential(generators[accepted], vocab, device).unsqueeze(0)  # noise: [1, V]
    last = int(race(weights, noise).item())
    return RejectionResult(token_ids=(*(int(t) for t in draft_token_ids[:accepted]), last), num_accepted=accepted)
