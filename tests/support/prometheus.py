"""Reading Prometheus text exposition in tests: fetch a /metrics page, parse it to samples, sum them."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (sample name, sorted labels) -> value


def fetch(url: str, timeout: float = 10.0) -> tuple[str, str]:
    """The page's text and its Content-Type."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(), r.headers.get("Content-Type", "")


def parse(text: str) -> Samples:
    """Sample name + sorted labels -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of `name` over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def family_names(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}
