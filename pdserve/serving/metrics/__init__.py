"""Prometheus metrics of one pdserve process (R5).

Every process (router, prefill node, decode node) keeps its metrics in one registry, `REGISTRY`;
`render()` returns the text exposition that a `/metrics` endpoint serves (the router's HTTP API,
a node's `--metrics-port` MetricsServer).

Modules: registry (REGISTRY, render), definitions (the metric groups and their buckets), timing
(RequestTimer: TTFT, ITL, E2E of one streamed request), engine_collector (an engine's gauges and
counters at scrape time), server (MetricsServer: GET /metrics on a node's loop).

The groups of this process, built on first use: `router_metrics()`, `request_metrics()`,
`node_metrics()`, `prefill_metrics()` (each takes a registry; default REGISTRY).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.serving.metrics import definitions
from pdserve.serving.metrics.definitions import NodeMetrics, PrefillMetrics, RequestMetrics, RouterMetrics
from pdserve.serving.metrics.registry import REGISTRY, render
from pdserve.serving.metrics.timing import RequestTimer


def request_metrics(registry: CollectorRegistry = REGISTRY) -> RequestMetrics:
    return definitions.request_metrics(registry)


def router_metrics(registry: CollectorRegistry = REGISTRY) -> RouterMetrics:
    return definitions.router_metrics(registry)


def node_metrics(registry: CollectorRegistry = REGISTRY) -> NodeMetrics:
    return definitions.node_metrics(registry)


def prefill_metrics(registry: CollectorRegistry = REGISTRY) -> PrefillMetrics:
    return definitions.prefill_metrics(registry)


__all__ = ["REGISTRY", "NodeMetrics", "PrefillMetrics", "RequestMetrics", "RequestTimer", "RouterMetrics",
           "node_metrics", "prefill_metrics", "render", "request_metrics", "router_metrics"]
