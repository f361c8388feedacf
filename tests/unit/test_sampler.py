"""Tests for pdserve.engine.sampling.sampler: greedy, filters, seeds, distributions, logprobs, validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling.sampler import SampleLogprobs, Sampler, token_seed
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=_gen(seed)) * 3.0  # [rows, vocab]


def _draw(
    sampler: Sampler, logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int
) -> torch.Tensor:
    """n draws from one distribution, batched as n identical rows sharing one generator."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()  # logits: [n, vocab]
    gen = _gen(seed)
    out = sampler.sample(logits, [params] * n, [gen] * n)
    return torch.tensor(out.token_ids)  # [n]


def test_greedy_equals_argmax() -> None:
    logits = _logits(8)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0, top_k=3, top_p=0.2)] * 8, [None] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_take_lowest_id() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    logits[:, 9] = 1.0
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert out.token_ids == [5, 5]


def test_bf16_logits_are_accepted() -> None:
    logits = _logits(4).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    out = Sampler(seed=0).sample(logits, [SamplingParams(temperature=1.0)] * 4, [None] * 4)
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_mixed_batch_greedy_rows_unchanged() -> None:
    logits = _logits(6, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = Sampler(seed=1).sample(logits, params, [None] * 6)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(0, 6, 2)] == [argmax[i] for i in range(0, 6, 2)]


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    logits = torch.zeros(16, VOCAB)  # uniform: any sample is equally likely
    params = [SamplingParams(temperature=1.0, seed=7)] * 16

    def run(seed: int) -> list[int]:
        gens = [_gen(seed + i) for i in range(16)]
        # A fresh sampler with a different default seed must not matter: every row has a generator.
        return Sampler(seed=seed * 1000).sample(logits, params, gens).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
    # A row's draw depends only on its own generator, not on its neighbours.
    a = Sampler().sample(logits[:1], params[:1], [_gen(42)]).token_ids[0]
    gens = [_gen(5), _gen(42), _gen(6)]
    b = Sampler().sample(logits[:3], params[:3], gens).token_ids[1]
    assert a == b


def test_default_generator_seeded_by_sampler() -> None:
    logits = torch.zeros(8, VOCAB)
    params = [SamplingParams(temperature=1.0)] * 8
    assert Sampler(seed=3).sample(logits, params, [None] * 8).token_ids == Sampler(seed=3).sample(
        logits, params, [None] * 8
    ).token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(32, seed=11)
    argmax = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        gens = [_gen(i) for i in range(32)]
        assert Sampler().sample(logits, [params] * 32, gens).token_ids == argmax


def test_top_k_restricts_to_k_best() -> None:
    logits = _logits(1, seed=5)[0]
    allowed = set(logits.topk(4).indices.tolist())
    draws = _draw(Sampler(), logits, SamplingParams(temperature=5.0, top_k=4), 2000, seed=0)
    assert set(draws.tolist()) == allowed


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # top_p=0.75: 0.5 < 0.75, 0.5+0.3 >= 0.75 -> keep {0, 1}.
    draws = _draw(Sampler(), logits, SamplingParams(temperature=1.0, top_p=0.75), 2000, seed=1)
    assert set(draws.tolist()) == {0, 1}
    # top_p=0.9: 0.5 + 0.3 < 0.9, 0.5 + 0.3 + 0.15 >= 0.9 -> keep {0, 1, 2}.
    draws = _draw(Sampler(), logits, SamplingParams(temperature=1.0, top_p=0.9), 2000, seed=2)
    assert set(draws.tolist()) == {0, 1, 2}


def test_min_p_filters_low_probability_tokens() -> None:
    probs = torch.tensor([0.40, 0.25, 0.15, 0.09, 0.06, 0.05])
    logits = probs.log()
    # min_p=0.3: threshold 0.12 -> tokens 0, 1, 2 allowed; 3, 4, 5 filtered.
    draws = _draw(Sampler(), logits, SamplingParams(temperature=1.0, min_p=0.3), 2000, seed=3)
    assert set(draws.tolist()) == {0, 1, 2}


def test_filters_combine_in_order() -> None:
    probs = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    logits = probs.log()
    # top_k=4 -> {0..3} renormalised [0.333, 0.278, 0.222, 0.167]; top_p=0.7 -> {0, 1, 2};
    # min_p=0.7: threshold 0.7 * 0.30 = 0.21 -> {0, 1} (min-p ratios are taken after temperature).
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.7, min_p=0.7)
    draws = _draw(Sampler(), logits, params, 2000, seed=4)
    assert set(draws.tolist()) == {0, 1}


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()  # [vocab]
    expected = probs.double() * draws.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_matches_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        expected = (logits / temperature).softmax(dim=-1)
        params = SamplingParams(temperature=temperature)
        draws = _draw(Sampler(), logits, params, n, seed=int(temperature * 10))
        # 7 degrees of freedom: the 99.99th percentile is ~29.9; the draws are seeded.
        assert _chi_square(draws, expected) < 30.0, temperature


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = _logits(4, seed=9)
    raw = logits.log_softmax(dim=-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0, top_k=3, logprobs=0),  # filters must not change logprobs
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, logprobs=20),
    ]
    out = Sampler(seed=0).sample(logits, params, [None, _gen(1), None, _gen(2)])
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert isinstance(lp, SampleLogprobs)
        tid = out.token_ids[i]
        assert lp.sampled.token_id == tid
        assert math.isclose(lp.sampled.logprob, raw[i, tid].item(), rel_tol=1e-6, abs_tol=1e-6)
        order = raw[i].argsort(descending=True).tolist()
        assert lp.sampled.rank == order.index(tid) + 1
        n = params[i].logprobs
        assert len(lp.top) == n
        assert [t.token_id for t in lp.top] == order[:n]
        assert [t.rank for t in lp.top] == list(range(1, n + 1))
        for t in lp.top:
            assert math.isclose(t.logprob, raw[i, t.token_id].item(), rel_tol=1e-6, abs_tol=1e-6)
    assert out.logprobs[0].sampled.rank == 1


def test_all_greedy_with_logprobs() -> None:
    logits = _logits(3, seed=2)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=2)] * 3, [None] * 3)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    for lp in out.logprobs:
        assert lp is not None and lp.sampled.rank == 1 and lp.top[0].token_id == lp.sampled.token_id


def test_filtered_tokens_never_sampled_with_neg_inf_logits() -> None:
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 17] = 0.0
    logits[0, 33] = 0.0
    draws = _draw(Sampler(), logits[0], SamplingParams(temperature=1.0), 500, seed=0)
    assert set(draws.tolist()) == {17, 33}


@pytest.mark.parametrize(
    ("shape", "n_params", "n_gens"),
    [((4,), 4, 4), ((2, 3, 4), 2, 2), ((3, VOCAB), 2, 3), ((3, VOCAB), 3, 2)],
)
def test_shape_mismatch_raises(shape: tuple[int, ...], n_params: int, n_gens: int) -> None:
    logits = torch.zeros(shape)
    with pytest.raises(ValueError, match="shape"):
        Sampler().sample(logits, [SamplingParams()] * n_params, [None] * n_gens)


def test_token_seed_spreads_pairs_and_a_requests_draw_depends_on_its_token_number_only() -> None:
    """S10: token n of a seeded request draws from token_seed(seed, n), whatever was drawn before."""
    seeds = {token_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**64 for x in seeds)
    assert len({x & 0xFFFFFFFF for x in seeds}) == 2500  # the CPU generator's 32 bits stay distinct
    with pytest.raises(ValueError, match="token index must be an integer >= 0, got -1"):
        token_seed(1, -1)
    logits = _logits(1, seed=8)  # [1, vocab]
    params = SamplingParams(temperature=1.0, seed=9)
    first = Request(request_id="a", prompt_token_ids=[1], sampling=params, max_total_tokens=64)
    drawn = []
    for _ in range(6):
        tok = Sampler().sample(logits, [params], [first.sample_generator()]).token_ids[0]
        first.output_token_ids.append(tok)
        drawn.append(tok)
    assert len(set(drawn)) > 1  # the same logits, a different draw per token number
    resumed = Request(request_id="b", prompt_token_ids=[1, *drawn[:4]], max_total_tokens=64,
                      sampling=dataclasses.replace(params, rng_skip_tokens=4))
    gen = resumed.sample_generator()
    assert gen is not None
    torch.empty(VOCAB).exponential_(generator=gen)  # draws in between change nothing
    assert Sampler().sample(logits, [params], [resumed.sample_generator()]).token_ids[0] == drawn[4]
    assert Request(request_id="c", prompt_token_ids=[1], sampling=SamplingParams(temperature=1.0),
                   max_total_tokens=64).sample_generator() is None
