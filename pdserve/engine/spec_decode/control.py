"""How many draft tokens each sequence verifies this step, so speculation pays for itself (E20).

A verification pass is one forward pass with more query tokens: its time grows with them. At
batch 1 on a CPU a pass reads every weight whatever its token count, so drafts are nearly free;
at batch 16 the extra tokens cost compute, and drafts that are rejected are a loss. The control
keeps two estimates and chooses the drafts that maximise tokens emitted per second:

- pass time t(T) = a + b * T for T query tokens: a least-squares line through the engine's own
  recent passes of decodes and verifications (`observe`, exponentially forgotten, FORGET per
  pass; passes with a prefill chunk are not observed: their tokens cost on a steeper slope, and
  a line through both once cut batch-1 drafts that paid 2x, bench/results/spec/spec_decode.md). Until
  the passes have varied enough to fit a line with a > 0 and b >= 0, nothing is cut (at batch 1
  the token counts rarely spread enough: every proposal is verified there).
- per-token acceptance alpha of each sequence: accepted / (accepted + rejected) over its recent
  verifications (FORGET_SEQ per verification), smoothed towards the acceptance of all sequences
  (PRIOR_WEIGHT pseudo-counts). A draft's j-th token is then accepted with probability alpha^j
  (a rejection ends the draft).

- drafting time d per draft token (`observe_drafting`: what the proposer spent, exponentially
  forgotten): ~0 for n-gram lookup, a head or draft-model step for the others. Without a fitted
  line, a known d is weighed against the mean pass time (tokens of the pass itself taken as free).

Choice: every decoding sequence emits at least one token (E = D, t = a + b * D for D sequences);
the draft token with the highest expected gain alpha_i^j goes next while it raises E / t, that is
while gain >= (b + d) * E / t, then E += gain and t += b + d. Proposers whose drafting costs
(eagle, draft models) are asked for only the tokens chosen (Speculator.drafts).

Probes: a sequence the choice leaves out stops producing the acceptance evidence that could bring
it back, so one that drafted nothing for its probe interval is given one token, and a sequence
whose text turns repetitive, or a cost that falls, is noticed. Probes are exploration paid for
out of throughput, so they are bounded twice: a sequence's interval starts at PROBE_AFTER steps
and doubles after each verification that accepts nothing (up to PROBE_MAX; one accepted token
brings it back), and probes spend at most PROBE_SHARE of the pass time: each step credits that
share of its expected pass time, and the due sequences are probed together (one drafting call)
once the credit covers them all at b + d per token. Without both, every sequence of a batch of
16 probed at the same step every 16 steps, and on prose those steps cost 1.3-1.9x a decode step
(bench/results/spec/spec_decode.md, the run before the budget): by that arithmetic most of the 4-8%
system-TPS loss at batch 16 measured there (bench/results/spec/spec_control_ab.md: a paired A/B).
First look: a sequence none of whose drafts has been verified yet (its first decode step with a
proposal: on a decode node the step right after the KV transfer, whose drafts come from the prefill
node's shipped hidden state, D17; or its first step back after a preemption) verifies at least one
draft token whatever the line says, outside the probe budget, until one verification happened (a
proposer that then drafts nothing, or a lookahead the step cannot fit, does not spend it). Nothing
is known of its own acceptance until then (the prior is the batch's), and the handoff step is where
a hidden-state head drafts from the freshest state it ever gets; the cost is bounded by one
verified draft token per request (b + d once: ~0.3 of a batch-1 decode step on the hosts of
bench/results/spec/spec_decode.md), and its verdict seeds the sequence's own estimate at once instead of
after PROBE_AFTER idle steps.
`SpeculativeConfig.adaptive=False` turns the control off (every proposal verified in full, as far
as the step's budget goes).

Owned by the engine thread; nothing here waits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FORGET = 0.97            # weight of the fit's past per pass observed
FORGET_SEQ = 0.8         # weight of a sequence's past per verification
FORGET_ALL = 0.98        # weight of the global acceptance's past per verification
PRIOR_WEIGHT = 2.0       # pseudo-verifications of the global acceptance in each sequence's estimate
PROBE_AFTER = 16         # steps without drafts before a sequence is first given one probe token
PROBE_MAX = 128          # the longest probe interval (it doubles per verification that accepts nothing)
PROBE_SHARE = 0.02       # probes spend at most this share of the pass time
MIN_SPREAD = 4.0         # the fit needs passes whose token counts spread at least this much (std)
FORGET_DRAFT = 0.9       # weight of the drafting-time estimate's past per drafting call


@dataclass(frozen=True)
class PassCost:
    """t(T) = fixed_s + per_token_s * T, from the engine's passes."""

    fixed_s: float
    per_token_s: float


@dataclass
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0
    idle_steps: int = 0
    probe_after: int = PROBE_AFTER   # steps without drafts before the next probe
    looked: bool = False             # a draft of it was verified (its first look is spent)


class SpeculationControl:
    def __init__(self) -> None:
        self._w = self._wt = self._wtt = self._wy = self._wty = 0.0
        self._seqs: dict[str, _Acceptance] = {}
        self._all = _Acceptance(accepted=1.0, rejected=1.0)
        self._draft_s: float | None = None   # drafting seconds per draft token
        self._probe_credit_s = 0.0           # pass time probes may still spend (PROBE_SHARE of each step's)

    # --- observations ------------------------------------------------------------------------

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One pass of `num_tokens` query tokens took `seconds` (its forward pass and drafting)."""
        f = FORGET
        t, y = float(num_tokens), float(seconds)
        self._w = f * self._w + 1.0
        self._wt = f * self._wt + t
        self._wtt = f * self._wtt + t * t
        self._wy = f * self._wy + y
        self._wty = f * self._wty + t * y

    def observe_drafting(self, num_tokens: int, seconds: float) -> None:
        """The proposer drafted `num_tokens` tokens (all sequences together) in `seconds`."""
        if num_tokens <= 0:
            return
        per = float(seconds) / num_tokens
        self._draft_s = per if self._draft_s is None else FORGET_DRAFT * self._draft_s + (1 - FORGET_DRAFT) * per

    @property
    def drafting_s_per_token(self) -> float:
        return self._draft_s or 0.0

    def verified(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """A verification of `num_draft` tokens of which the first `num_accepted` were kept."""
        rejected = 1.0 if num_accepted < num_draft else 0.0
        s = self._seqs.setdefault(request_id, _Acceptance())
        s.accepted = FORGET_SEQ * s.accepted + num_accepted
        s.rejected = FORGET_SEQ * s.rejected + rejected
        s.probe_after = PROBE_AFTER if num_accepted else min(PROBE_MAX, 2 * s.probe_after)
        s.looked = True
        g = self._all
        g.accepted = FORGET_ALL * g.accepted + num_accepted
        g.rejected = FORGET_ALL * g.rejected + rejected

    def forget(self, live: set[str]) -> None:
        """Drop the estimates of requests that are no longer running."""
        for rid in [r for r in self._seqs if r not in live]:
            del self._seqs[rid]

    # --- estimates ---------------------------------------------------------------------------

    def cost(self) -> PassCost | None:
        """The fitted line, or None while the passes seen do not determine one."""
        if self._w < 2.0:
            return None
        mean_t = self._wt / self._w
        var_t = self._wtt / self._w - mean_t * mean_t
        if var_t < MIN_SPREAD * MIN_SPREAD:
            return None
        mean_y = self._wy / self._w
        b = (self._wty / self._w - mean_t * mean_y) / var_t
        a = mean_y - b * mean_t
        if a <= 0.0 or b < 0.0:
            return None
        return PassCost(fixed_s=a, per_token_s=b)

    @property
    def global_acceptance(self) -> float:
        g = self._all
        return g.accepted / (g.accepted + g.rejected)

    def acceptance(self, request_id: str) -> float:
        """Per-token acceptance estimate of a sequence's drafts, in (0, 1)."""
        prior = self.global_acceptance
        s = self._seqs.get(request_id)
        if s is None:
            return prior
        return (s.accepted + PRIOR_WEIGHT * prior) / (s.accepted + s.rejected + PRIOR_WEIGHT)

    # --- the choice --------------------------------------------------------------------------

    def choose(self, proposals: Mapping[str, int], num_decoding: int) -> dict[str, int]:
        """How many tokens of each sequence's proposal (request id -> proposed length) to verify,
        for `num_decoding` sequences that decode this step; ids with 0 are left out."""
        cost = self.cost()
        draft_s = self.drafting_s_per_token
        if cost is None and draft_s > 0.0 and self._w >= 2.0:   # tokens of the pass taken as free
            cost = PassCost(fixed_s=self._wy / self._w, per_token_s=0.0)
        if cost is None:   # nothing known of what a token costs: every proposal, and no probes needed
            for rid in proposals:
                self._seqs.setdefault(rid, _Acceptance()).idle_steps = 0
            return {rid: n for rid, n in proposals.items() if n > 0}
        first_look = [rid for rid, n in proposals.items() if n > 0 and not self._seqs.get(rid, _Acceptance()).looked]
        gains: list[tuple[float, str]] = []
        for rid, n in proposals.items():
            alpha = self.acceptance(rid)
            gains.extend((alpha ** j, rid) for j in range(1, n + 1))
        gains.sort(key=lambda g: -g[0])
        emitted = float(max(1, num_decoding))
        t = cost.fixed_s + cost.per_token_s * emitted
        chosen = dict.fromkeys(proposals, 0)
        per_token = cost.per_token_s + draft_s
        for gain, rid in gains:
            if gain < per_token * emitted / t:
                break
            chosen[rid] += 1
            emitted += gain
            t += per_token
        due: list[str] = []
        for rid, n in proposals.items():
            s = self._seqs.setdefault(rid, _Acceptance())
            if chosen[rid]:
                s.idle_steps = 0
                continue
            s.idle_steps += 1
            if n > 0 and s.idle_steps >= s.probe_after:
                due.append(rid)
        # the credit never exceeds what probing every decoding sequence once costs (no burst after
        # a long quiet stretch)
        most = per_token * max(1, num_decoding, len(due))
        self._probe_credit_s = min(most, self._probe_credit_s + PROBE_SHARE * t)
        if due and self._probe_credit_s >= per_token * len(due):
            self._probe_credit_s -= per_token * len(due)
            for rid in due:
                chosen[rid] = 1
                self._seqs[rid].idle_steps = 0
        for rid in first_look:   # outside the probe budget, until a verification (see the docstring)
            chosen[rid] = max(1, chosen[rid])
            self._seqs[rid].idle_steps = 0
        return {rid: n for rid, n in chosen.items() if n > 0}
