"""The benchmark's numbers (L2): pure arithmetic over RequestRecords, with vLLM's definitions.

Over the successful requests (finish reason "stop" or "length", no error), in a run that lasted
`duration_s` (first send to last stream end):
- TTFT, E2E: one value per request; TPOT = (E2E - TTFT) / (output tokens - 1), per request with
  more than one output token; ITL: every gap between streamed tokens, of every request, pooled;
- request throughput = completed requests / duration;
- output token throughput ("system TPS") = output tokens / duration;
- total token throughput = (prompt + output tokens) / duration;
- per-user TPS = 1 / mean ITL: the pace at which one user sees tokens while decoding;
- goodput = completed requests meeting every SLO (TTFT <= ttft_ms, TPOT <= tpot_ms, E2E <= e2el_ms)
  / duration; a request with a single output token has no TPOT and meets any TPOT SLO.
Latencies are summarised by mean, median, p90 and p99 (linear interpolation between order
statistics, numpy's default), plus std, min and max.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pdserve.tools.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LatencyStats:
    """Seconds. count 0: every other field is None (nothing to summarise)."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    std: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float]) -> LatencyStats:
        a = np.asarray(list(values), dtype=np.float64)
        if a.size == 0:
            return cls(0, None, None, None, None, None, None, None)
        p50, p90, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
        return cls(int(a.size), float(a.mean()), p50, p90, p99, float(a.std()), float(a.min()), float(a.max()))


@dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput, in milliseconds; None: not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for key in SLO_KEYS:
            value = getattr(self, f"{key}_ms")
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {key} must be a finite number of milliseconds > 0, got {value}")

    @classmethod
    def parse(cls, items: Sequence[str]) -> Slo:
        """From "KEY:MS" items, KEY one of ttft, tpot, e2el (e.g. ["ttft:2000", "tpot:100"])."""
        values: dict[str, float] = {}
        for item in items:
            key, sep, ms = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"a goodput SLO is KEY:MS with KEY one of {SLO_KEYS}, got {item!r}")
            if key in values:
                raise ValueError(f"goodput SLO {key} given twice")
            try:
                values[key] = float(ms)
            except ValueError:
                raise ValueError(f"goodput SLO {key}: {ms!r} is not a number of milliseconds") from None
        return cls(**{f"{k}_ms": v for k, v in values.items()})

    @property
    def empty(self) -> bool:
        return all(getattr(self, f"{k}_ms") is None for k in SLO_KEYS)

    def met_by(self, r: RequestRecord) -> bool:
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and r.tpot_s is not None and r.tpot_s * 1e3 > self.tpot_ms:
            return False
        return self.e2el_ms is None or r.e2e_s * 1e3 <= self.e2el_ms


@dataclass(frozen=True)
class BenchMetrics:
    """Every number of one run. Throughputs per second of `duration_s`; TPS = tokens per second."""

    duration_s: float
    requests_sent: int
    completed: int
    failed: int
    finish_reasons: dict[str, int]  # every sent request's finish reason ("none": the stream broke off)
    total_input_tokens: int          # prompts of completed requests (server usage, else dataset lengths)
    total_output_tokens: int         # outputs of completed requests
    request_throughput: float        # completed requests / s
    output_token_throughput: float   # system output TPS: output tokens / s, all users together
    total_token_throughput: float    # system total TPS: (prompt + output) tokens / s
    per_user_tps: float | None       # per-user decode TPS: 1 / mean ITL
    goodput: float | None            # completed requests meeting the SLOs / s (None: no SLO given)
    good_requests: int | None
    slo: Slo
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> BenchMetrics:
    """The run's metrics; raises ValueError for a non-positive duration."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    slo = slo or Slo()
    ok = [r for r in records if r.success]
    unknown_prompt = [r.index for r in ok if r.prompt_tokens is None]
    if unknown_prompt:
        raise ValueError(f"requests {unknown_prompt[:5]} completed without a prompt token count "
                         "(no usage from the server and none from the dataset)")
    inputs = sum(r.prompt_tokens or 0 for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    itl = LatencyStats.of(g for r in ok for g in r.itl_s)
    good = None if slo.empty else sum(1 for r in ok if slo.met_by(r))
    return BenchMetrics(
        duration_s=duration_s,
        requests_sent=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        finish_reasons=dict(sorted(Counter(r.finish_reason or "none" for r in records).items())),
        total_input_tokens=inputs,
        total_output_tokens=outputs,
        request_throughput=len(ok) / duration_s,
        output_token_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s,
        per_user_tps=1.0 / itl.mean if itl.mean else None,
        goodput=None if good is None else good / duration_s,
        good_requests=good,
        slo=slo,
        ttft=LatencyStats.of(r.ttft_s for r in ok if r.ttft_s is not None),
        tpot=LatencyStats.of(r.tpot_s for r in ok if r.tpot_s is not None),
        itl=itl,
        e2e=LatencyStats.of(r.e2e_s for r in ok),
    )
