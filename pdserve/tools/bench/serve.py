"""One benchmark run against a running server: `pdserve bench serve`, and the unit sweep and compare repeat.

    result = run_serve(ServeSettings("grpc", "127.0.0.1:50051", DatasetSpec("random", 100, ...), RunConfig(...)))
    print(format_table(result.metrics)); write_json("out.json", result.to_json())

With `metrics_url` set (a server's Prometheus /metrics, e.g. the router's), its TTFT, ITL and E2E
histograms are scraped before and after the run and their difference is kept in the result, so
the client's latencies can be checked against what the server measured (the warm-up requests
come before the first scrape). A speculating engine's counters are scraped the same way, summed over
`metrics_url` and `spec_metrics_urls` (a cluster's nodes: the router exports none), and their
difference is kept: the run's acceptance rate and mean acceptance length
(`ServeResult.server_spec_decode`, None when no endpoint exports such counters).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdserve.serving.channels import PLAINTEXT, ChannelSecurity
from pdserve.tools.bench import prometheus
from pdserve.tools.bench.backends import make_backend
from pdserve.tools.bench.datasets import DatasetSpec
from pdserve.tools.bench.metrics import BenchMetrics, Slo, compute_metrics
from pdserve.tools.bench.progress import Progress
from pdserve.tools.bench.report import machine_info, result_dict
from pdserve.tools.bench.runner import RunConfig, RunOutcome, run_benchmark, warm_up

SERVER_HISTOGRAMS = (prometheus.TTFT, prometheus.ITL, prometheus.E2E)


@dataclass(frozen=True)
class ServeSettings:
    backend: str
    url: str
    dataset: DatasetSpec
    run: RunConfig = field(default_factory=RunConfig)
    slo: Slo = field(default_factory=Slo)
    metrics_url: str | None = None
    security: ChannelSecurity = PLAINTEXT   # the gRPC backend's channel (never in the result JSON)
    spec_metrics_urls: tuple[str, ...] = ()  # more /metrics with speculative-decoding counters (nodes)

    @property
    def spec_urls(self) -> tuple[str, ...]:
        """Every endpoint whose spec-decode counters are summed, each once."""
        urls = ((self.metrics_url,) if self.metrics_url else ()) + self.spec_metrics_urls
        return tuple(dict.fromkeys(urls))

    def to_json(self) -> dict[str, Any]:
        r = self.run
        return {"backend": self.backend, "url": self.url, "dataset": self.dataset.to_json(),
                "request_rate": "inf" if r.request_rate == float("inf") else r.request_rate,
                "burstiness": r.burstiness, "max_concurrency": r.max_concurrency, "duration_s": r.duration_s,
                "seed": r.seed, "num_warmups": r.num_warmups, "temperature": r.send.temperature,
                "ignore_eos": r.send.ignore_eos, "request_timeout_s": r.send.timeout_s, "model": r.send.model,
                "slo": {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms, "e2el_ms": self.slo.e2el_ms},
                "metrics_url": self.metrics_url, "spec_metrics_urls": list(self.spec_metrics_urls)}


@dataclass(frozen=True)
class ServeResult:
    settings: ServeSettings
    outcome: RunOutcome
    metrics: BenchMetrics
    machine_before: dict[str, Any]
    machine_after: dict[str, Any]
    server_histograms: dict[str, prometheus.Histogram] | None = None
    server_histograms_error: str | None = None
    server_spec_decode: prometheus.SpecDecodeCounters | None = None   # the run's delta, when exported

    def to_json(self, **extra: Any) -> dict[str, Any]:
        server = None if self.server_histograms is None else {k: h.to_json() for k, h in self.server_histograms.items()}
        return result_dict("serve", self.settings.to_json(), self.metrics, self.outcome.records,
                           machine=self.machine_before, machine_after=self.machine_after,
                           planned=self.outcome.planned, not_sent=self.outcome.not_sent,
                           server_histograms=server, server_histograms_error=self.server_histograms_error,
                           server_spec_decode=None if self.server_spec_decode is None
                           else self.server_spec_decode.to_json(),
                           **extra)


def _scrape_all(url: str, missing_ok: bool) -> dict[str, prometheus.Histogram]:
    text = prometheus.scrape(url)
    return {name: prometheus.Histogram.from_text(text, name, missing_ok) for name in SERVER_HISTOGRAMS}


def _scrape_spec(urls: tuple[str, ...]) -> prometheus.SpecDecodeCounters | None:
    """The spec-decode counters summed over `urls` (None when none exports them)."""
    found = [c for c in (prometheus.SpecDecodeCounters.from_text(prometheus.scrape(u)) for u in urls) if c is not None]
    return prometheus.SpecDecodeCounters.total(found) if found else None


async def serve(settings: ServeSettings, progress: bool = True, label: str = "") -> ServeResult:
    requests = settings.dataset.build()
    before = machine_info()
    async with make_backend(settings.backend, settings.url, settings.security) as backend:
        if settings.run.num_warmups:
            await warm_up(backend, settings.dataset.warmup_requests(settings.run.num_warmups), settings.run.send)
        first = await asyncio.to_thread(_scrape_all, settings.metrics_url, True) if settings.metrics_url else None
        spec_first = await asyncio.to_thread(_scrape_spec, settings.spec_urls) if settings.spec_urls else None
        bar = Progress(len(requests), label, enabled=progress)
        outcome = await run_benchmark(backend, requests, settings.run, bar)
    server = server_error = spec = None
    if first is not None and settings.metrics_url:
        try:  # the run's results are kept whatever the server's exposition holds
            last = await asyncio.to_thread(_scrape_all, settings.metrics_url, False)
            server = {name: last[name].minus(first[name]) for name in SERVER_HISTOGRAMS}
        except (OSError, ValueError) as e:
            server_error = f"server histograms from {settings.metrics_url} unavailable: {e}"
    if settings.spec_urls:
        try:
            spec_last = await asyncio.to_thread(_scrape_spec, settings.spec_urls)
            spec = None if spec_last is None else spec_last.minus(spec_first)
        except (OSError, ValueError) as e:
            server_error = "; ".join(filter(None, (server_error, f"spec-decode counters unavailable: {e}")))
    metrics = compute_metrics(outcome.records, outcome.duration_s, settings.slo)
    return ServeResult(settings, outcome, metrics, before, machine_info(), server, server_error, spec)


def run_serve(settings: ServeSettings, progress: bool = True, label: str = "") -> ServeResult:
    return asyncio.run(serve(settings, progress, label))
