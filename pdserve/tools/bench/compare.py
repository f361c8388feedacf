"""`pdserve bench compare` (L4): colocated vs disaggregated serving on the same cores and workload.

    result = run_compare(CompareSettings(dataset=DatasetSpec("random", 40, LengthRange(512, 2048), ...),
                                         run=RunConfig(request_rate=0.05, duration_s=180)))

Starts one cluster after the other with `pdserve.tools.launcher.Cluster` and runs the same requests, at
the same arrival times, through each (`serve.serve`):
- colocated: `prefill + decode` colocated nodes (each prefills and decodes in mixed batches, D18);
- disaggregated: `prefill` prefill nodes and `decode` decode nodes (KV pages over the fabric);
every node pinned to its own `threads_per_node` cores with that many torch threads, so both
setups get the same CPU (the router is not pinned). Then the two results side by side, with the
ratio disaggregated / colocated for every metric, and the targets of the production write-up:
per-user TPS (1 / mean ITL) >= 1.6x, ITL p99 <= 1/3, TTFT p50 <= 2x, each with its margin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.tools.bench.datasets import DatasetSpec
from pdserve.tools.bench.metrics import BenchMetrics, Slo
from pdserve.tools.bench.report import machine_info
from pdserve.tools.bench.runner import RunConfig
from pdserve.tools.bench.serve import ServeResult, ServeSettings, run_serve

logger = logging.getLogger(__name__)

SETUPS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Target:
    """disaggregated / colocated of `metric` must be >= (at_least) or <= (at_most) `ratio`."""

    metric: str        # a key of comparison_rows
    ratio: float
    at_least: bool

    def check(self, measured: float | None) -> dict[str, Any]:
        if measured is None:
            return {"metric": self.metric, "target": self.text, "measured": None, "met": False,
                    "margin": "not measured (no value in one of the runs)"}
        met = measured >= self.ratio if self.at_least else measured <= self.ratio
        # margin: how far from the bound, as a factor (> 1 met, < 1 missed)
        factor = measured / self.ratio if self.at_least else (self.ratio / measured if measured else float("inf"))
        word = "met with" if met else "missed by"
        detail = f"{factor:.2f}x the bound" if met else f"a factor {1 / factor:.2f} (measured {measured:.3f})"
        return {"metric": self.metric, "target": self.text, "measured": measured, "met": met,
                "margin_factor": factor, "margin": f"{word} {detail}"}

    @property
    def text(self) -> str:
        return f"disaggregated / colocated {self.metric} {'>=' if self.at_least else '<='} {self.ratio:.3g}"


DEFAULT_TARGETS = (Target("per-user TPS", 1.6, True), Target("ITL p99", 1 / 3, False),
                   Target("TTFT p50", 2.0, False))


@dataclass(frozen=True)
class CompareSettings:
    dataset: DatasetSpec
    run: RunConfig = field(default_factory=RunConfig)
    slo: Slo = field(default_factory=Slo)
    backend: str = "grpc"
    prefill: int = 1
    decode: int = 1
    threads_per_node: int = 1
    pin_cores: bool = True
    num_blocks: int | None = 2048
    engine_args: tuple[str, ...] = ()
    provider: str = "shm"
    startup_timeout_s: float = 300.0
    targets: tuple[Target, ...] = DEFAULT_TARGETS

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "prefill": self.prefill, "decode": self.decode,
                "colocated": self.prefill + self.decode, "threads_per_node": self.threads_per_node,
                "pin_cores": self.pin_cores, "num_blocks": self.num_blocks, "engine_args": list(self.engine_args),
                "provider": self.provider, "targets": [t.text for t in self.targets]}


@dataclass(frozen=True)
class CompareResult:
    settings: CompareSettings
    results: dict[str, ServeResult]   # by setup name
    clusters: dict[str, list[str]]    # the command lines each setup ran
    targets: list[dict[str, Any]]

    def to_json(self, **extra: Any) -> dict[str, Any]:
        rows = comparison_rows(self.results["colocated"].metrics, self.results["disaggregated"].metrics)
        return {"schema": "pdserve-bench/1", "kind": "compare", "settings": self.settings.to_json(),
                "machine": machine_info(), "clusters": self.clusters,
                "side_by_side": [{"metric": k, "colocated": c, "disaggregated": d, "ratio": r}
                                 for k, (c, d, r) in rows.items()],
                "targets": self.targets, **extra,
                "runs": {name: res.to_json() for name, res in self.results.items()}}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else b / a


def comparison_rows(col: BenchMetrics, dis: BenchMetrics) -> dict[str, tuple[float | None, float | None, float | None]]:
    """metric -> (colocated, disaggregated, disaggregated / colocated). Latencies in seconds."""
    rows: dict[str, tuple[float | None, float | None, float | None]] = {}

    def add(name: str, a: float | None, b: float | None) -> None:
        rows[name] = (a, b, _ratio(a, b))

    add("completed requests", col.completed, dis.completed)
    add("failed requests", col.failed, dis.failed)
    add("duration s", col.duration_s, dis.duration_s)
    add("request throughput", col.request_throughput, dis.request_throughput)
    add("output token throughput (system TPS)", col.output_token_throughput, dis.output_token_throughput)
    add("total token throughput", col.total_token_throughput, dis.total_token_throughput)
    add("per-user TPS", col.per_user_tps, dis.per_user_tps)
    if col.goodput is not None and dis.goodput is not None:
        add("goodput", col.goodput, dis.goodput)
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        a, b = getattr(col, key), getattr(dis, key)
        for stat in ("mean", "median", "p90", "p99"):
            add(f"{label} {'p50' if stat == 'median' else stat}", getattr(a, stat), getattr(b, stat))
    return rows


def format_comparison(rows: dict[str, tuple[float | None, float | None, float | None]],
                      targets: list[dict[str, Any]]) -> str:
    def cell(name: str, v: float | None) -> str:
        if v is None:
            return "-"
        if name.split()[0] in ("TTFT", "TPOT", "ITL", "E2E"):
            return f"{v * 1e3:.1f} ms"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"

    w = 40
    lines = [" colocated vs disaggregated ".center(w + 48, "="),
             f"{'metric':<{w}}{'colocated':>16}{'disaggregated':>16}{'disagg/coloc':>16}"]
    for name, (a, b, r) in rows.items():
        lines.append(f"{name:<{w}}{cell(name, a):>16}{cell(name, b):>16}{'-' if r is None else f'{r:.3f}x':>16}")
    lines.append(" targets ".center(w + 48, "-"))
    for t in targets:
        lines.append(f"{'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['margin']}")
    lines.append("=" * (w + 48))
    return "\n".join(lines)


def cluster_config(settings: CompareSettings, setup: str):  # a launcher ClusterConfig
    from pdserve.tools.launcher import ClusterConfig

    common = dict(port=0, provider=settings.provider, threads_per_node=settings.threads_per_node,
                  pin_cores=settings.pin_cores, num_blocks=settings.num_blocks, engine_args=settings.engine_args,
                  startup_timeout_s=settings.startup_timeout_s, router_health_interval_s=0.5)
    if setup == "colocated":
        return ClusterConfig(colocated=settings.prefill + settings.decode, **common)
    if setup == "disaggregated":
        return ClusterConfig(prefill=settings.prefill, decode=settings.decode, **common)
    raise ValueError(f"setup must be one of {SETUPS}, got {setup!r}")


def run_setup(settings: CompareSettings, setup: str, progress: bool = True) -> tuple[ServeResult, list[str]]:
    """Start the setup's cluster, run the workload through it, stop it."""
    from pdserve.tools.launcher import Cluster

    with Cluster(cluster_config(settings, setup)) as cluster:
        url = cluster.url if settings.backend == "grpc" else cluster.http_url
        if url is None:
            raise RuntimeError(f"the {setup} cluster has no HTTP API for backend {settings.backend}")
        metrics_url = cluster.metrics_urls.get("router")
        nodes = tuple(u for name, u in cluster.metrics_urls.items() if name != "router")  # spec-decode counters
        serve = ServeSettings(settings.backend, url, settings.dataset, settings.run, settings.slo, metrics_url,
                              spec_metrics_urls=nodes)
        logger.info("%s cluster serving on %s; running the workload", setup, url)
        result = run_serve(serve, progress, label=setup)
        return result, [spec.command for spec in cluster.specs]


def run_compare(settings: CompareSettings, progress: bool = True,
                on_result: Callable[[str, ServeResult], None] | None = None) -> CompareResult:
    """Both setups, colocated first; on_result(setup, result) is called as each one ends."""
    results: dict[str, ServeResult] = {}
    clusters: dict[str, list[str]] = {}
    for setup in SETUPS:
        results[setup], clusters[setup] = run_setup(settings, setup, progress)
        if on_result is not None:
            on_result(setup, results[setup])
    rows = comparison_rows(results["colocated"].metrics, results["disaggregated"].metrics)
    targets = [t.check(rows[t.metric][2]) for t in settings.targets]
    return CompareResult(settings, results, clusters, targets)


