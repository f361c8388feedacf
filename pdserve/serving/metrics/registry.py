"""The process registry: every process (router, prefill node, decode node) keeps its metrics in `REGISTRY`;
`render()` returns the text exposition that a `/metrics` endpoint serves.

The `*_created` timestamp series prometheus_client adds to every counter and histogram are turned off
for the process (as vLLM does): they double the exposition and no dashboard reads them.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest

disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)


def render() -> tuple[bytes, str]:
    """(body, content type) of the Prometheus text exposition of this process's metrics."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
