"""Speculative rejection sampling (E20, pdserve/engine/spec_decode/rejection.py) keeps the target's
distribution: tiny vocabularies with tabulated, prefix-dependent target p and draft q (adversarial
pairs included), decoded T tokens at a time by repeated speculative steps, against exact enumeration;
the same statistic rejects two classic mistakes. Then the one-sequence API: its generator protocol,
its equality with plain sampling at K = 0, and its edge cases."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from pdserve.engine.sampling.sampler import Sampler, _filtered_probs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.rejection import (
    RejectionResult,
    num_accepted,
    race,
    rejection_sample,
    rejection_sample_batch,
    residual_weights,
    seeded_generators,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # small ops: a second OpenMP thread only spins

T = 3            # tokens decoded per trial; the joint over V**T sequences is compared
TRIALS = 20000
Z_1E4 = 3.719    # the standard normal's 1 - 1e-4 quantile


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (no scipy here)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom); inf when a cell of probability 0 was observed."""
    n = float(observed.sum())
    support = expected_probs > 0
    if bool((observed[~support] > 0).any()):
        return math.inf, int(support.sum()) - 1
    exp = expected_probs[support].double() * n
    stat = float(((observed[support].double() - exp) ** 2 / exp).sum())
    return stat, int(support.sum()) - 1


class Tables:
    """p(. | prefix) and q(. | prefix) for every prefix of length <= max_len, indexed by a prefix code
    (offsets[length] + the prefix's base-V value)."""

    def __init__(self, vocab: int, max_len: int, make_p: Callable, make_q: Callable, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.offsets = [0]
        for length in range(max_len + 1):
            self.offsets.append(self.offsets[-1] + vocab**length)
        self._offsets_t = torch.tensor(self.offsets, dtype=torch.long)
        n = self.offsets[-1]
        self.p = make_p(g, n, vocab)  # p: [codes, V]
        self.q = make_q(g, self.p)  # q: [codes, V]

    def code(self, length: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self._offsets_t[length] + value

    def exact_joint(self, t: int) -> torch.Tensor:
        """P(x_1..x_t) = prod p(x_j | x_<j), indexed by the sequence's base-V value. [V**t]."""
        out = torch.empty(self.vocab**t, dtype=torch.float64)
        for seq in itertools.product(range(self.vocab), repeat=t):
            prob, value = 1.0, 0
            for j, x in enumerate(seq):
                prob *= float(self.p[self.offsets[j] + value, x])
                value = value * self.vocab + x
            out[value] = prob
        return out


def dirichlet(g: torch.Generator, n: int, vocab: int, zeros: int = 1) -> torch.Tensor:
    """n random distributions [n, V], each with `zeros` random entries filtered to exactly 0."""
    w = -torch.rand((n, vocab), generator=g).log()
    rank = torch.rand((n, vocab), generator=g).argsort(dim=-1).argsort(dim=-1)
    w = w.masked_fill(rank < zeros, 0.0)
    return (w / w.sum(dim=-1, keepdim=True)).float()


def q_random(g, p):
    return dirichlet(g, *p.shape, zeros=0)  # q puts mass where p has none


def q_disjoint(g, p):
    w = (p == 0).float()                  # q only on the tokens p filtered: every draft rejected
    return w / w.sum(dim=-1, keepdim=True)


def q_equal(g, p):
    return p.clone()


def q_sharp(g, p):
    w = torch.full_like(p, 0.02)          # q confident about a token p dislikes
    w.scatter_(1, p.argmin(dim=-1, keepdim=True), 1.0)
    return w / w.sum(dim=-1, keepdim=True)


Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def decode(tables: Tables, k: int, deterministic: bool, step: Step, seed: int) -> torch.Tensor:
    """TRIALS independent sequences decoded by repeated speculative steps until each has T tokens;
    returns the codes (base-V value) of their first T tokens. [TRIALS]."""
    g = torch.Generator().manual_seed(seed)
    v = tables.vocab
    n = TRIALS
    length = torch.zeros(n, dtype=torch.long)
    value = torch.zeros(n, dtype=torch.long)     # base-V value of the prefix
    first_t = torch.zeros(n, dtype=torch.long)   # the first T tokens' value, filled as they come
    while bool((length < T).any()):
        drafts, rows, qrows = [], [], []
        active = length < T  # finished sequences draft from the empty prefix and take nothing
        base_len, base_val = torch.where(active, length, 0), torch.where(active, value, 0)
        d_len, d_val = base_len, base_val
        for _ in range(k):
            c = tables.code(d_len, d_val)
            rows.append(tables.p[c])
            qrows.append(tables.q[c])
            if deterministic:
                d = tables.q[c].argmax(dim=-1)   # q is then only used to choose the draft
            else:
                d = torch.multinomial(tables.q[c], 1, generator=g).squeeze(1)
            drafts.append(d)
            d_len, d_val = d_len + 1, d_val * v + d
        rows.append(tables.p[tables.code(d_len, d_val)])
        target = torch.stack(rows, dim=1)  # target: [N, K+1, V]
        draft_ids = torch.stack(drafts, dim=1) if k else torch.zeros((n, 0), dtype=torch.long)  # [N, K]
        draft_probs = None if deterministic else torch.stack(qrows, dim=1)  # draft_probs: [N, K, V]
        uniforms = torch.rand((n, k), generator=g)
        noise = torch.empty((n, v)).exponential_(generator=g)
        accepted, last = step(target, draft_ids, draft_probs, uniforms, noise)
        emitted = torch.cat([draft_ids, torch.zeros((n, 1), dtype=torch.long)], dim=1)  # [N, K+1]
        emitted[torch.arange(n), accepted] = last
        for j in range(k + 1):
            take = (length < T) & (j <= accepted)   # finished sequences take nothing more
            first_t = torch.where(take, first_t * v + emitted[:, j], first_t)
            value = torch.where(take, value * v + emitted[:, j], value)
            length = length + take.long()
    return first_t


def check(tables: Tables, k: int, deterministic: bool, step: Step = rejection_sample_batch, seed: int = 0,
          ) -> tuple[float, float, float, float]:
    """(chi2 of the first token, its critical value, chi2 of the T-token joint, its critical value)."""
    codes = decode(tables, k, deterministic, step, seed)
    v = tables.vocab
    joint = torch.bincount(codes, minlength=v**T).double()
    first = torch.bincount(codes // v ** (T - 1), minlength=v).double()
    s1, df1 = chi2(first, tables.p[0])
    sj, dfj = chi2(joint, tables.exact_joint(T))
    return s1, chi2_critical(df1), sj, chi2_critical(dfj)


CASES = {
    # name: (vocab, make_p, make_q, deterministic draft)
    "random p, q with mass where p has none": (4, dirichlet, q_random, False),
    "p and q disjoint": (4, lambda g, n, v: dirichlet(g, n, v, zeros=2), q_disjoint, False),
    "q == p": (3, dirichlet, q_equal, False),
    "sharp q on p's least likely token": (5, lambda g, n, v: dirichlet(g, n, v, zeros=0), q_sharp, False),
    "one-hot draft, often on a token p filtered": (4, lambda g, n, v: dirichlet(g, n, v, zeros=2), q_disjoint, True),
    "one-hot draft at q's argmax": (6, lambda g, n, v: dirichlet(g, n, v, zeros=3), q_random, True),
}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_steps_keep_the_target_distribution(case, k):
    vocab, make_p, make_q, deterministic = CASES[case]
    tables = Tables(vocab, T - 1 + k, make_p, make_q, seed=list(CASES).index(case) * 10 + k)
    s1, c1, sj, cj = check(tables, k, deterministic, seed=k)
    assert s1 < c1, f"{case}, K={k}: first token chi2 {s1:.1f} >= {c1:.1f}"
    assert sj < cj, f"{case}, K={k}: {T}-token joint chi2 {sj:.1f} >= {cj:.1f}"


# ---- the same statistic rejects the usual mistakes ---------------------------------------------


def wrong_accept_with_p(target, draft_ids, draft_probs, uniforms, noise):
    """Accepts draft i with probability p(d_i) instead of min(1, p(d_i) / q(d_i))."""
    n, k1, v = target.shape
    rows, cols = torch.arange(n).unsqueeze(1), torch.arange(k1 - 1).unsqueeze(0)
    p_d = target[rows, cols, draft_ids]
    accepted = num_accepted(p_d, torch.ones_like(p_d), uniforms)
    return accepted, _last(target, draft_ids, draft_probs, accepted, noise, residual=True)


def wrong_residual_from_p(target, draft_ids, draft_probs, uniforms, noise):
    """Accepts correctly but draws the corrected token from p instead of norm(max(0, p - q))."""
    n, k1, v = target.shape
    rows, cols = torch.arange(n).unsqueeze(1), torch.arange(k1 - 1).unsqueeze(0)
    p_d = target[rows, cols, draft_ids]
    q_d = draft_probs[rows, cols, draft_ids] if draft_probs is not None else torch.ones_like(p_d)
    accepted = num_accepted(p_d, q_d, uniforms)
    return accepted, _last(target, draft_ids, draft_probs, accepted, noise, residual=False)


def _last(target, draft_ids, draft_probs, accepted, noise, residual):
    n, k1, v = target.shape
    rows = torch.arange(n)
    p = target[rows, accepted]
    if not residual:
        return race(p, noise)
    at = accepted.clamp(max=k1 - 2)
    if draft_probs is not None:
        q = draft_probs[rows, at]
    else:
        q = torch.nn.functional.one_hot(draft_ids[rows, at], v).float()
    w = torch.where((accepted < k1 - 1).unsqueeze(1), residual_weights(p, q), p)
    return race(w, noise)


@pytest.mark.parametrize(("wrong", "case"), [
    (wrong_accept_with_p, "random p, q with mass where p has none"),
    (wrong_residual_from_p, "random p, q with mass where p has none"),
    (wrong_residual_from_p, "one-hot draft at q's argmax"),  # p with the draft token kept
])
def test_the_statistic_rejects_a_broken_procedure(wrong, case):
    vocab, make_p, make_q, deterministic = CASES[case]
    tables = Tables(vocab, T + 1, make_p, make_q, seed=7)
    s1, c1, sj, cj = check(tables, 2, deterministic, step=wrong, seed=2)
    assert s1 > c1 and sj > cj, f"{wrong.__name__} passed: first {s1:.1f} vs {c1:.1f}, joint {sj:.1f} vs {cj:.1f}"
    s1, c1, sj, cj = check(tables, 2, deterministic, seed=2)  # the real one on the same tables passes
    assert s1 < c1 and sj < cj


# ---- the one-sequence API -------------------------------------------------------------------------


def test_one_sequence_first_token_follows_p_through_the_generators():
    g = torch.Generator().manual_seed(11)
    p = dirichlet(g, 3, 4)  # p: [K+1, V], K = 2
    q = dirichlet(g, 2, 4, zeros=0)  # q: [K, V]
    shared = torch.Generator().manual_seed(5)  # an unseeded request: one generator serves every draw
    counts = torch.zeros(4)
    for _ in range(1500):
        d = torch.multinomial(q[0], 1, generator=g).tolist() + torch.multinomial(q[1], 1, generator=g).tolist()
        out = rejection_sample(p, d, q, [shared] * 3)
        assert out.token_ids[: out.num_accepted] == tuple(d[: out.num_accepted])
        assert len(out.token_ids) == out.num_accepted + 1
        counts[out.token_ids[0]] += 1
    stat, df = chi2(counts, p[0])
    assert stat < chi2_critical(df)


def test_generator_protocol_matches_the_batch_procedure():
    """Position i's generator gives its uniform first, then (on a rejection) the noise; the bonus
    position gives only the noise. Rebuilding those draws by hand reproduces the step exactly."""
    g = torch.Generator().manual_seed(3)
    vocab, k = 6, 3
    seen = set()
    for trial in range(60):
        p = dirichlet(g, k + 1, vocab, zeros=2)
        q = dirichlet(g, k, vocab, zeros=1)
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        for draft_probs in (q, None):  # a draft with a distribution, and a deterministic one
            out = rejection_sample(p, d, draft_probs, seeded_generators(seed=trial, first_index=10, count=k + 1))
            again = rejection_sample(p, d, draft_probs, seeded_generators(seed=trial, first_index=10, count=k + 1))
            assert out == again  # seeded: reproducible
            gens = seeded_generators(seed=trial, first_index=10, count=k + 1)
            uniforms = torch.stack([torch.rand((), generator=gens[i]) for i in range(k)]).unsqueeze(0)
            n = out.num_accepted
            noise = torch.empty(vocab).exponential_(generator=gens[n]).unsqueeze(0)
            batch_q = None if draft_probs is None else draft_probs.unsqueeze(0)
            acc, last = rejection_sample_batch(p.unsqueeze(0), torch.tensor([d]), batch_q, uniforms, noise)
            assert (int(acc), int(last)) == (n, out.token_ids[-1])
            seen.add((draft_probs is None, n))
    assert len(seen) >= 6  # the trials exercised rejections at several positions and the bonus, both kinds


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(temperature=0.7, top_p=0.6, min_p=0.05)])
def test_k0_draws_exactly_what_the_sampler_draws(params):
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        logits = torch.randn(1, 50, generator=g) * 3  # logits: [1, V]
        probs = _filtered_probs(logits, [params])  # probs: [1, V]
        gen = seeded_generators(seed, 7, 1)
        ours = rejection_sample(probs, [], None, gen)
        plain = Sampler().sample(logits, [params], seeded_generators(seed, 7, 1))
        assert ours == RejectionResult(token_ids=(plain.token_ids[0],), num_accepted=0)
        # the bonus after K accepted drafts is that same draw at its own token index
        k = 2
        target = torch.cat([torch.nn.functional.one_hot(torch.tensor([4, 9]), 50).float(), probs])  # [K+1, V]
        out = rejection_sample(target, [4, 9], None, seeded_generators(seed, 5, k + 1))
        assert out.token_ids == (4, 9, plain.token_ids[0]) and out.num_accepted == 2


def test_edge_cases():
    gens = [torch.Generator().manual_seed(1)] * 3
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    # a one-hot draft on a token the target filtered: always rejected, corrected from p
    for _ in range(50):
        out = rejection_sample(p, [2, 0], None, gens)
        assert out.num_accepted == 0 and out.token_ids[0] in (0, 1)
    # q == p: every draft accepted, and the bonus comes from p_K
    for _ in range(50):
        q = p[:2].clone()
        q[0] = torch.tensor([0.5, 0.5, 0.0])
        out = rejection_sample(p, [1, 2], q, gens)
        assert out == RejectionResult(token_ids=(1, 2, 0), num_accepted=2)
    # the residual of p == q has no mass: drawn from p
    assert torch.equal(residual_weights(p[:1], p[:1]), p[:1])
    assert torch.allclose(residual_weights(p[1:2], torch.tensor([[0.4, 0.3, 0.3]])), torch.tensor([[0.0, 0.0, 0.2]]))
    # num_accepted: first rejection, or K
    u = torch.tensor([[0.1, 0.9, 0.1], [0.1, 0.1, 0.1], [0.99, 0.0, 0.0]])
    pd = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.0, 0.5]])
    assert num_accepted(pd, torch.ones_like(pd), u).tolist() == [1, 3, 0]
    assert num_accepted(pd, torch.full_like(pd, 0.4), u).tolist() == [3, 3, 1]  # p >= q accepted, p == 0 not
    with pytest.raises(ValueError, match="draft token 2 at position 0 has draft probability 0.0"):
        rejection_sample(p, [2, 0], torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]), gens)
    with pytest.raises(ValueError, match=r"target_probs must be \[K\+1, V\] = \[2, V\]"):
        rejection_sample(p, [1], None, gens[:2])
    with pytest.raises(ValueError, match=r"in \[0, 3\), got \[3\]"):
        rejection_sample(p, [0, 3], None, gens)
    with pytest.raises(ValueError, match="need K\\+1 = 3 generators"):
        rejection_sample(p, [0, 1], None, gens[:2])
    with pytest.raises(ValueError, match=r"draft_probs must be \[K, V\] = \[2, 3\]"):
        rejection_sample(p, [0, 1], p, gens)
    with pytest.raises(ValueError, match="row 0 has no probability mass"):
        rejection_sample(torch.zeros(1, 3), [], None, gens[:1])
