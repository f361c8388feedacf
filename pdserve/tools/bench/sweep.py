"""`pdserve bench sweep`: the same workload at several request rates against one running server.

One full result per rate (`<prefix>_rate<R>.json`, records included), a summary
(`<prefix>.json`: every rate's metrics) and the plot (`<prefix>.png`: throughput and p99 latencies
against the offered rate). The arrival times are drawn with the same seed at every rate, so runs
differ by their pace; rate i draws its prompts with the dataset seed + i, so that a server's
prefix cache does not serve one rate from the prompts of another (the shipped prompt set and JSONL
files have fixed texts: only their order changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.tools.bench.plots import sweep_plot
from pdserve.tools.bench.report import SCHEMA, format_table, machine_info, write_json
from pdserve.tools.bench.serve import ServeResult, ServeSettings, run_serve


def parse_rates(text: str) -> list[float]:
    """"0.5,1,2,inf" -> [0.5, 1.0, 2.0, inf]; each > 0, at least one."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"request rates must be comma-separated numbers (or inf), got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0, at least one, got {text!r}")
    return rates


def _rate_name(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


@dataclass(frozen=True)
class SweepResult:
    rates: tuple[float, ...]
    results: tuple[ServeResult, ...]

    def summary(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "kind": "sweep", "machine": machine_info(),
                "settings": self.results[0].settings.to_json() if self.results else {},
                "rates": [_rate_name(r) for r in self.rates],
                "metrics": [r.metrics.to_json() for r in self.results]}


def run_sweep(settings: ServeSettings, rates: Sequence[float], progress: bool = True,
              echo: bool = True) -> SweepResult:
    results = []
    for i, rate in enumerate(rates):
        one = replace(settings, run=replace(settings.run, request_rate=rate),
                      dataset=replace(settings.dataset, seed=settings.dataset.seed + i))
        result = run_serve(one, progress, label=f"rate {_rate_name(rate)}")
        if echo:
            print(format_table(result.metrics, f"rate {_rate_name(rate)} req/s"), flush=True)
        results.append(result)
    return SweepResult(tuple(rates), tuple(results))


def write_sweep(sweep: SweepResult, prefix: str | Path) -> list[Path]:
    """Every file of a sweep: per-rate JSONs, the summary JSON, the plot."""
    prefix = Path(prefix)
    paths = [write_json(f"{prefix}_rate{_rate_name(rate)}.json", res.to_json())
             for rate, res in zip(sweep.rates, sweep.results, strict=True)]
    paths.append(write_json(f"{prefix}.json", sweep.summary()))
    finite = [(r, res.metrics) for r, res in zip(sweep.rates, sweep.results, strict=True) if r != float("inf")]
    if finite:
        paths.append(sweep_plot([r for r, _ in finite], [m for _, m in finite], f"{prefix}.png"))
    return paths
