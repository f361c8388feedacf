"""The process registry: every process (router, prefill node, decode node) keeps its metrics in `REGISTRY`;
`render()` returns the text exposition that a `/metrics` endpoint serves."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)


def render() -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of this process's metrics."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
