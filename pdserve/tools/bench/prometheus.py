"""A server's latency histograms, read from its Prometheus /metrics, to set beside the client's view.

    before = scrape(url); ...run...; after = scrape(url)
    ttft = Histogram.from_text(after, TTFT).minus(Histogram.from_text(before, TTFT))
    low, high = ttft.quantile_bucket(0.99)   # the bucket holding the server's p99

Histograms are summed over every label set (e.g. model_name). The delta of two scrapes isolates
one run from whatever the server saw before it.

A speculating engine's counters (E20, pdserve/serving/metrics/engine_collector.py) are read the same
way: `SpecDecodeCounters.from_text(after).minus(SpecDecodeCounters.from_text(before))` gives the run's
drafts, draft tokens and accepted tokens (summed over label sets, per position by the `position` label),
whence acceptance rate = accepted / draft tokens and mean acceptance length = 1 + accepted / drafts
(vLLM's definitions; the bonus token counts in the length). An exposition without these counters
gives None: nothing to report.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

TTFT = "pdserve:time_to_first_token_seconds"
ITL = "pdserve:inter_token_latency_seconds"
E2E = "pdserve:e2e_request_latency_seconds"
SPEC_DRAFTS = "pdserve:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "pdserve:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "pdserve:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "pdserve:spec_decode_num_accepted_tokens_per_pos"


def scrape(url: str, timeout: float = 10.0) -> str:
    """The text exposition at `url` (e.g. http://127.0.0.1:8000/metrics)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # a URL the user gave
        return resp.read().decode("utf-8")


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts: counts[i] observations <= bounds[i]; the last bound is +Inf."""

    name: str
    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total: float   # sum of the observations

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    @classmethod
    def from_text(cls, text: str, name: str, missing_ok: bool = False) -> Histogram:
        """The histogram `name` in an exposition; when it is not there: ValueError, or with missing_ok
        an empty histogram (a process registers some metrics on first use)."""
        buckets: dict[float, float] = {}
        total = 0.0
        found = False
        for family in text_string_to_metric_families(text):
            if family.name != name:
                continue
            found = True
            for s in family.samples:
                if s.name == name + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name == name + "_sum":
                    total += s.value
        if not found and missing_ok:
            return cls(name, (), (), 0.0)
        if not found:
            raise ValueError(f"no histogram {name!r} in the exposition")
        bounds = tuple(sorted(buckets))
        return cls(name, bounds, tuple(buckets[b] for b in bounds), total)

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since `earlier` (same buckets)."""
        if not self.bounds:
            raise ValueError(f"{self.name}: no observations in the later scrape")
        if earlier.bounds and earlier.bounds != self.bounds:
            raise ValueError(f"{self.name}: bucket bounds differ between scrapes: {earlier.bounds} vs {self.bounds}")
        before = earlier.counts or (0.0,) * len(self.counts)
        return Histogram(self.name, self.bounds, tuple(a - b for a, b in zip(self.counts, before, strict=True)),
                         self.total - earlier.total)

    def quantile_bucket(self, q: float) -> tuple[float, float]:
        """(lower, upper] bounds of the bucket holding the q-quantile (rank ceil(q * count))."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {q}")
        if self.count <= 0:
            raise ValueError(f"{self.name}: no observations")
        rank = max(1, math.ceil(q * self.count - 1e-9))
        lower = 0.0
        for bound, cum in zip(self.bounds, self.counts, strict=True):
            if cum >= rank:
                return lower, bound
            lower = bound
        return lower, math.inf

    def neighbour_bounds(self, low: float, high: float) -> tuple[float, float]:
        """The bucket (low, high] widened by one bucket on each side."""
        i = self.bounds.index(high)
        lower = self.bounds[i - 2] if i >= 2 else 0.0
        upper = self.bounds[i + 1] if i + 1 < len(self.bounds) else math.inf
        return lower, upper

    def to_json(self) -> dict:
        return {"name": self.name, "bounds": [str(b) if math.isinf(b) else b for b in self.bounds],
                "counts": list(self.counts), "sum": self.total}


@dataclass(frozen=True)
class SpecDecodeCounters:
    """A server's speculative-decoding counters (totals since it started, or a run's delta)."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_pos: tuple[float, ...]   # [i]: drafts whose token i (from 0) was accepted

    @classmethod
    def from_text(cls, text: str) -> SpecDecodeCounters | None:
        """The counters in an exposition, summed over label sets; None when it has none of them.

        Matched by sample name (`<name>_total`), whatever family the parser groups a sample in (it
        depends on how the exposition's TYPE line spells the name)."""
        totals = {SPEC_DRAFTS + "_total": 0.0, SPEC_DRAFT_TOKENS + "_total": 0.0, SPEC_ACCEPTED + "_total": 0.0}
        per_pos: dict[int, float] = {}
        found = False
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in totals:
                    found = True
                    totals[s.name] += s.value
                elif s.name == SPEC_ACCEPTED_PER_POS + "_total":
                    pos = int(s.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0.0) + s.value
        if not found:
            return None
        positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1))
        return cls(totals[SPEC_DRAFTS + "_total"], totals[SPEC_DRAFT_TOKENS + "_total"],
                   totals[SPEC_ACCEPTED + "_total"], positions)

    def minus(self, earlier: SpecDecodeCounters | None) -> SpecDecodeCounters:
        """What was counted since `earlier` (None: since the server started)."""
        if earlier is None:
            return self
        # a position may first be counted between the scrapes: missing positions count 0
        n = max(len(self.accepted_per_pos), len(earlier.accepted_per_pos))
        now = self.accepted_per_pos + (0.0,) * (n - len(self.accepted_per_pos))
        then = earlier.accepted_per_pos + (0.0,) * (n - len(earlier.accepted_per_pos))
        return SpecDecodeCounters(self.num_drafts - earlier.num_drafts,
                                  self.num_draft_tokens - earlier.num_draft_tokens,
                                  self.num_accepted_tokens - earlier.num_accepted_tokens,
                                  tuple(a - b for a, b in zip(now, then, strict=True)))

    @classmethod
    def total(cls, parts: list[SpecDecodeCounters]) -> SpecDecodeCounters:
        """The sum of several servers' counters (positions aligned from 0)."""
        n = max((len(c.accepted_per_pos) for c in parts), default=0)
        per_pos = [0.0] * n
        for c in parts:
            for i, v in enumerate(c.accepted_per_pos):
                per_pos[i] += v
        return cls(sum(c.num_drafts for c in parts), sum(c.num_draft_tokens for c in parts),
                   sum(c.num_accepted_tokens for c in parts), tuple(per_pos))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / draft tokens; None before any draft token."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts (tokens emitted per verified draft, the bonus included); None before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts > 0 else None

    @property
    def per_position_rate(self) -> tuple[float, ...]:
        """[i]: the fraction of drafts whose token i was accepted; () before any draft."""
        return tuple(c / self.num_drafts for c in self.accepted_per_pos) if self.num_drafts > 0 else ()

    def to_json(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_rate": list(self.per_position_rate)}
