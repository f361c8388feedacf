"""SpeculationControl (E20): drafts are verified only where they are expected to pay for their pass."""

from __future__ import annotations

import pytest

from pdserve.engine.spec_decode.control import PROBE_AFTER, PROBE_MAX, PROBE_SHARE, SpeculationControl


def fitted(fixed_s: float, per_token_s: float) -> SpeculationControl:
    c = SpeculationControl()
    for t in (1, 5, 16, 40, 80, 3, 24, 64):
        c.observe(t, fixed_s + per_token_s * t)
    return c


def test_the_pass_cost_line_is_fitted_from_the_passes():
    cost = fitted(0.010, 0.0005).cost()
    assert cost.fixed_s == pytest.approx(0.010) and cost.per_token_s == pytest.approx(0.0005)


def test_without_a_fit_every_proposal_passes():
    c = SpeculationControl()
    assert c.cost() is None
    for _ in range(5):
        c.observe(5, 0.02)          # one token count only: no line through it
    assert c.cost() is None
    assert c.choose({"a": 4, "b": 2}, 2) == {"a": 4, "b": 2}


def test_batch_one_on_weight_bound_passes_speculates_even_with_modest_acceptance():
    c = fitted(0.050, 0.0002)       # a pass reads the weights: tokens nearly free
    for _ in range(5):
        c.verified("a", 4, 1)       # per-token acceptance ~0.4
    assert c.choose({"a": 4}, 1) == {"a": 4}


def test_a_compute_bound_batch_drops_drafts_that_are_mostly_rejected():
    c = fitted(0.002, 0.002)        # every token costs as much as the fixed part
    for rid in "abcdefghijklmnop":
        for _ in range(5):
            c.verified(rid, 4, 0)
    assert c.choose({rid: 4 for rid in "abcdefghijklmnop"}, 16) == {}


def test_well_accepted_drafts_are_kept_in_the_same_batch():
    c = fitted(0.002, 0.002)
    for _ in range(8):
        c.verified("good", 4, 4)
        c.verified("bad", 4, 0)
    chosen = c.choose({"good": 4, "bad": 4}, 16)
    assert chosen.get("good", 0) >= 1 and "bad" not in chosen


def test_an_idle_sequence_is_probed_with_one_token():
    c = fitted(0.002, 0.002)
    for rid in "bcdefgh":
        for _ in range(8):
            c.verified(rid, 4, 0)      # the batch's acceptance is poor: nothing passes the choice
    c.verified("a", 4, 1)              # "a" once accepted a token: its probe interval is the first
    assert c.choose({"a": 4}, 16) == {}
    for _ in range(PROBE_AFTER - 2):
        assert c.choose({"a": 4}, 16) == {}
    assert c.choose({"a": 4}, 16) == {"a": 1}


def test_the_probe_interval_doubles_while_probes_fail_and_resets_on_an_accepted_token():
    c = fitted(0.002, 0.002)
    for rid in "bcdefgh":
        for _ in range(8):
            c.verified(rid, 4, 0)
    c.verified("a", 4, 1)

    def steps_to_probe() -> int:
        for n in range(1, 10 * PROBE_MAX):
            if c.choose({"a": 4}, 16) == {"a": 1}:
                return n
        raise AssertionError("never probed")

    assert steps_to_probe() == PROBE_AFTER
    c.verified("a", 1, 0)              # the probe failed
    assert steps_to_probe() == 2 * PROBE_AFTER
    c.verified("a", 1, 0)
    assert steps_to_probe() == 4 * PROBE_AFTER
    for _ in range(8):
        c.verified("a", 1, 0)
    assert steps_to_probe() == PROBE_MAX
    c.verified("a", 1, 1)              # accepted: probed as often as at first again
    assert steps_to_probe() == PROBE_AFTER


def test_probes_of_a_batch_go_together_and_spend_at_most_their_share_of_pass_time():
    fixed, per = 0.038, 0.002          # batch 16 on prose: a probe token costs ~5% of a step
    c = fitted(fixed, per)
    batch = [f"r{i}" for i in range(16)]
    for rid in batch:
        c.verified(rid, 2, 1)          # accepted once: every sequence due at the first interval
    for _ in range(8):
        c.verified("other", 4, 0)      # the batch's acceptance falls: the choice drafts nothing
    probes_per_step, pass_s = [], 0.0
    for _ in range(2000):
        chosen = c.choose(dict.fromkeys(batch, 2), len(batch))
        assert set(chosen.values()) <= {1}                   # nothing but probes
        probes_per_step.append(len(chosen))
        pass_s += fixed + per * (len(batch) + len(chosen))
        for rid in chosen:
            c.verified(rid, 1, 0)                            # every probe fails
    probe_steps = [n for n in probes_per_step if n]
    assert probe_steps and all(n == len(batch) for n in probe_steps)   # one drafting call for all
    spent = per * sum(probes_per_step)
    assert 0 < spent <= PROBE_SHARE * pass_s


def test_finished_requests_are_forgotten():
    c = SpeculationControl()
    c.verified("a", 2, 2)
    c.forget(set())
    assert c.acceptance("a") == c.global_acceptance


def test_drafting_time_counts_against_a_draft_token():
    # weight-bound batch 1: the pass's tokens nearly free, acceptance ~0.4 -> every token verified
    free = fitted(0.050, 0.0002)
    costly = fitted(0.050, 0.0002)
    for c in (free, costly):
        for _ in range(5):
            c.verified("a", 4, 1)
    costly.observe_drafting(4, 4 * 0.015)   # a head step per draft token: 15 ms each
    assert free.choose({"a": 4}, 1) == {"a": 4}
    assert costly.drafting_s_per_token == pytest.approx(0.015)
    assert costly.choose({"a": 4}, 1).get("a", 0) < 4   # the deep, unlikely tokens no longer pay


def test_without_a_fitted_line_a_known_drafting_cost_still_cuts_unlikely_drafts():
    c = SpeculationControl()
    for _ in range(5):
        c.observe(5, 0.035)                # one token count only: no line through it
        c.verified("a", 3, 0)              # drafts rejected
    assert c.choose({"a": 3}, 1) == {"a": 3}   # no drafting cost known: every proposal passes
    c.observe_drafting(3, 3 * 0.006)
    assert c.choose({"a": 3}, 1) == {}


def test_a_new_sequence_verifies_one_draft_token_at_its_first_step_only():
    c = fitted(0.002, 0.002)
    for rid in "bcdefgh":
        for _ in range(8):
            c.verified(rid, 4, 0)      # the batch's acceptance is poor: the choice drafts nothing
    assert c.choose({"b": 4}, 16) == {}
    # "new" decodes for the first time (a decode node's step after the transfer): one token, outside
    # the probe budget, though the line cuts it for a sequence already seen
    assert c.choose({"b": 4, "new": 4}, 16) == {"new": 1}
    # nothing was drafted or verified (a head without a state yet, a lookahead that did not fit):
    # the look is not spent
    assert c.choose({"b": 4, "new": 4}, 16) == {"new": 1}
    c.verified("new", 1, 0)
    assert all(c.choose({"b": 4, "new": 4}, 16) == {} for _ in range(PROBE_AFTER - 2))
    # preempted (forgotten) and back: a first look again
    c.forget({"b"})
    assert c.choose({"b": 4, "new": 4}, 16) == {"new": 1}
