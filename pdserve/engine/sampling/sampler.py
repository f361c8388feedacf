"""Batched token sampling (E19): greedy, temperature, top-k, top-p, min-p, seeds and logprobs.

One call samples one token for every row of a logits matrix. Each row carries its own
`SamplingParams` and its own `torch.Generator` (seeded by the engine from `params.seed`; `None`
uses a generator owned by the sampler).

Seeded streams (S10): a seeded request's token number n (0 = its first output token) draws its noise
from its generator reseeded with `token_seed(seed, n)`, so token n depends on (seed, n) and the
distribution alone, never on the draws before it or on the batch around it. That makes a stream
resumable exactly: a request moved to another node after k streamed tokens sets
`SamplingParams.rng_skip_tokens = k` and its next draw is token k's, what an uninterrupted run
draws. (Every sampled token does consume a fixed amount of one stream, one Exp(1) per vocabulary
entry, but the CPU generator (mt19937) has no skip-ahead: advancing it by k tokens means replaying
k x vocab draws, seconds for a thousand tokens of a 49k vocabulary; a reseed is a few microseconds
per token, next to a vocabulary-wide draw that takes hundreds of times longer.)

Order of operations for a sampled row (temperature > 0):

1. temperature: `logits / temperature`;
2. top-k: keep the k highest logits (ties at the boundary broken towards the lowest token id);
3. top-p: on the softmax of what top-k kept, keep the smallest prefix (by descending probability)
   whose mass reaches top_p; the most likely token is always kept;
4. min-p: drop tokens whose probability is below `min_p * p_max`, with probabilities taken from
   the softmax after temperature (the ratio p / p_max does not change when the surviving tokens
   are renormalised, so this equals min-p on the top-k/top-p distribution);
5. draw from the renormalised survivors with the row's generator (exponential race:
   `argmax(p / E)` with `E ~ Exp(1)` drawn per token, which picks token i with probability p_i).

Greedy rows (temperature == 0, or below `_GREEDY_EPS`) take `argmax` of the raw logits (ties go to
the lowest id, as `torch.argmax` does) and ignore top-k/top-p/min-p. A batch made only of greedy rows
is one `argmax` (the benchmark hot path).

Logprobs are always those of the raw model distribution (`log_softmax` of the unmodified logits),
whatever the filters did: the sampled token's logprob and rank (1 = most likely; rank counts tokens
with a strictly higher logprob, plus one), and the `params.logprobs` most likely tokens, best first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.ops.norm_act import argmax_rows

logger = logging.getLogger(__name__)

# Temperatures below this are sampled greedily: dividing logits by them overflows float32.
_GREEDY_EPS = 1e-5
GREEDY_EPS = _GREEDY_EPS   # public: what counts as a greedy row (speculative drafting)
_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints that spreads every input bit over all outputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's output token number `index` (0 = first), in [0, 2**64).

    Distinct (seed, index) pairs give well-spread seeds; the CPU generator (mt19937) keys on the low
    32 bits of it, as it does for any seed.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"token index must be an integer >= 0, got {index!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return _mix64((_mix64(seed & _MASK64) + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability under the raw model distribution."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely


@dataclass(frozen=True)
class SampleLogprobs:
    """Logprobs reported for one sampled position."""

    sampled: TokenLogprob  # the chosen token
    top: tuple[TokenLogprob, ...]  # the n most likely (n = params.logprobs), best first


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row, aligned with the rows of the logits."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]  # None where params.logprobs is None


class Sampler:
    """Samples one token per row; stateless apart from its default generators.

    `seed` seeds the default generators used by rows whose generator is `None` (one per device,
    created lazily); `None` seeds them nondeterministically.
    Not thread-safe: one sampler per model runner.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The sampler-owned generator for `device`, used for rows given no generator."""
        device = torch.device(device)
        gen = self._default_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._default_generators[device] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        """Sample one token for each row of `logits` ([num_seqs, vocab], float32 or bf16/fp16)."""
        _check_inputs(logits, params, generators)
        # logits: [num_seqs, vocab]
        if logits.dtype != torch.float32:
            logits = logits.float()
        num_seqs = logits.shape[0]

        greedy = [p.temperature < _GREEDY_EPS for p in params]
        if all(greedy):
            # Hot path: one argmax for the whole batch.
            token_ids_t = argmax_rows(logits)  # token_ids_t: [num_seqs]
        else:
            token_ids_t = self._sample_mixed(logits, params, generators, greedy)

        token_ids: list[int] = token_ids_t.tolist()
        if all(p.logprobs is None for p in params):
            return SamplerOutput(token_ids=token_ids, logprobs=[None] * num_seqs)
        return SamplerOutput(token_ids=token_ids, logprobs=_compute_logprobs(logits, params, token_ids_t))

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        """Token ids for a batch with at least one sampled row. logits: [num_seqs, vocab]."""
        device = logits.device
        token_ids = argmax_rows(logits)  # token_ids: [num_seqs]; greedy rows keep these
        rows = [i for i, g in enumerate(greedy) if not g]
        row_params = [params[i] for i in rows]
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)  # rows_t: [m]
        sub = logits.index_select(0, rows_t)  # sub: [m, vocab]
        probs = _filtered_probs(sub, row_params)  # probs: [m, vocab]
        noise = self._exponential_noise(probs, [generators[i] for i in rows])  # noise: [m, vocab]
        # Exponential race: argmax(p_i / E_i) is token i with probability p_i. Filtered tokens have
        # p = 0 and can only win if every survivor underflowed, which cannot happen (p_max >= 1/vocab).
        sampled = (probs / noise).argmax(dim=-1)  # sampled: [m]
        token_ids.index_copy_(0, rows_t, sampled)
        return token_ids

    def _exponential_noise(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Exp(1) noise of probs' shape, row i drawn from generators[i]. probs: [m, vocab]."""
        m, vocab = probs.shape
        noise = torch.empty_like(probs)  # noise: [m, vocab]
        default_rows = [i for i, g in enumerate(generators) if g is None]
        if default_rows:
            default = self.default_generator(probs.device)
            idx = torch.tensor(default_rows, dtype=torch.long, device=probs.device)  # idx: [d]
            drawn = torch.empty((len(default_rows), vocab), device=probs.device)  # drawn: [d, vocab]
            drawn.exponential_(generator=default)
            noise.index_copy_(0, idx, drawn)
        for i, gen in enumerate(generators):
            if gen is None:
                continue
            if gen.device == probs.device:
                noise[i].exponential_(generator=gen)
            else:
                # Engine generators may live on the CPU while logits are on the accelerator.
                row = torch.empty(vocab, device=gen.device).exponential_(generator=gen)  # row: [vocab]
                noise[i].copy_(row)
        # exponential_ may return exactly 0; keep the division finite.
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _check_inputs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [num_seqs, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(params) or logits.shape[0] != len(generators):
        raise ValueError(
            f"logits has {logits.shape[0]} rows (shape {tuple(logits.shape)}) but got "
            f"{len(params)} params and {len(generators)} generators"
        )
    if logits.shape[1] == 0:
        raise ValueError(f"logits has an empty vocabulary dimension, shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p. logits: [m, vocab] -> [m, vocab]."""
    m, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)  # temps: [m]
    scaled = logits / temps.unsqueeze(1)  # scaled: [m, vocab]

    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [float(p.top_p) for p in params]
    if any(k < vocab for k in top_ks) or any(tp < 1.0 for tp in top_ps):
        # Stable sort: among equal logits the lowest id ranks first, as argmax does.
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True, stable=True)  # both: [m, vocab]
        positions = torch.arange(vocab, device=device).unsqueeze(0)  # positions: [1, vocab]
        k_t = torch.tensor(top_ks, dtype=torch.long, device=device).unsqueeze(1)  # k_t: [m, 1]
        drop_sorted = positions >= k_t  # drop_sorted: [m, vocab]
        p_t = torch.tensor(top_ps, dtype=torch.float32, device=device).unsqueeze(1)  # p_t: [m, 1]
        sorted_probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(dim=-1)  # [m, vocab]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass_before: [m, vocab]
        # A token is dropped once the tokens ranked above it already reach top_p. top_p == 1 rows
        # never drop (float rounding could push the cumulative sum past 1).
        drop_sorted |= (mass_before >= p_t) & (p_t < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.empty_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)  # drop: [m, vocab]
        scaled = scaled.masked_fill(drop, float("-inf"))

    min_ps = [float(p.min_p) for p in params]
    if any(mp > 0.0 for mp in min_ps):
        probs = scaled.softmax(dim=-1)  # probs: [m, vocab]
        mp_t = torch.tensor(min_ps, dtype=torch.float32, device=device).unsqueeze(1)  # mp_t: [m, 1]
        threshold = probs.amax(dim=-1, keepdim=True) * mp_t  # threshold: [m, 1]
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))

    return scaled.softmax(dim=-1)


def _compute_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor
) -> list[SampleLogprobs | None]:
    """Raw-distribution logprobs for rows that asked. logits: [num_seqs, vocab], token_ids: [num_seqs]."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    device = logits.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)  # rows_t: [r]
    logprobs = logits.index_select(0, rows_t).log_softmax(dim=-1)  # logprobs: [r, vocab]
    chosen = token_ids.index_select(0, rows_t)  # chosen: [r]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # chosen_lp: [r, 1]
    chosen_rank = (logprobs > chosen_lp).sum(dim=-1) + 1  # chosen_rank: [r]
    n_max = min(max(params[i].logprobs or 0 for i in rows), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(n_max, dim=-1)  # both: [r, n_max]; sorted best first

    chosen_l = chosen.tolist()
    chosen_lp_l = chosen_lp.squeeze(1).tolist()
    chosen_rank_l = chosen_rank.tolist()
    top_lp_l = top_lp.tolist()
    top_ids_l = top_ids.tolist()
    out: list[SampleLogprobs | None] = [None] * len(params)
    for j, i in enumerate(rows):
        n = min(params[i].logprobs or 0, n_max)
        top = tuple(
            TokenLogprob(token_id=top_ids_l[j][r], logprob=top_lp_l[j][r], rank=r + 1) for r in range(n)
        )
        sampled = TokenLogprob(token_id=chosen_l[j], logprob=chosen_lp_l[j], rank=chosen_rank_l[j])
        out[i] = SampleLogprobs(sampled=sampled, top=top)
    return out


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled row draws from (temperature, top-k, top-p, min-p applied), for
    speculative verification (pdserve.engine.spec_decode.rejection). logits: [m, V] -> [m, V]."""
    return _filtered_probs(logits.float(), list(params))


def compute_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                     token_ids: Sequence[int]) -> list[SampleLogprobs | None]:
    """The raw-distribution logprobs plain sampling reports, for tokens chosen elsewhere (a
    speculative verification). logits: [m, V]; one token per row."""
    if all(p.logprobs is None for p in params):
        return [None] * len(params)
    return _compute_logprobs(logits.float(), params, torch.tensor(list(token_ids), dtype=torch.long))

