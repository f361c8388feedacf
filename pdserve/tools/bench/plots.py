"""PNG plots (L3), drawn with matplotlib's Agg backend (no display needed).

- latency_cdfs: the TTFT and ITL CDFs of one or more runs, overlaid (serve: one run; compare: both);
- sweep_plot: throughput and p99 latencies against the offered request rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pdserve.tools.bench.metrics import BenchMetrics
from pdserve.tools.bench.records import RequestRecord


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    x = np.sort(np.asarray(values_ms, dtype=float))
    if x.size == 0:
        return
    y = np.arange(1, x.size + 1) / x.size
    ax.step(x, y, where="post", label=f"{label} (n={x.size})")


def latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], out_dir: str | Path, stem: str) -> list[Path]:
    """`<stem>_ttft_cdf.png` and `<stem>_itl_cdf.png` in out_dir: one curve per run (successful requests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title in (("ttft", "Time to first token"), ("itl", "Inter-token latency (pooled)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, records in runs.items():
            ok = [r for r in records if r.success]
            if key == "ttft":
                values = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
            else:
                values = [g * 1e3 for r in ok for g in r.itl_s]
            _cdf(ax, values, label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{key.upper()} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if key == "ttft" else "token gaps"))
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = out / f"{stem}_{key}_cdf.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def sweep_plot(rates: Sequence[float], metrics: Sequence[BenchMetrics], path: str | Path) -> Path:
    """Left: request throughput and output token throughput (system TPS); right: p99 TTFT, TPOT, ITL
    and E2E latency; both against the offered request rate."""
    if len(rates) != len(metrics):
        raise ValueError(f"{len(rates)} rates but {len(metrics)} results")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(rates, [m.request_throughput for m in metrics], "o-", color="tab:blue", label="request throughput")
    left.set_xlabel("offered request rate (req/s)")
    left.set_ylabel("completed requests / s", color="tab:blue")
    twin = left.twinx()
    twin.plot(rates, [m.output_token_throughput for m in metrics], "s--", color="tab:orange",
              label="output token throughput (system TPS)")
    twin.set_ylabel("output tokens / s (system TPS)", color="tab:orange")
    left.set_title("Throughput")
    left.grid(True, alpha=0.3)
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        ys = [getattr(m, key).p99 for m in metrics]
        right.plot(rates, [np.nan if y is None else y * 1e3 for y in ys], "o-", label=f"p99 {label}")
    right.set_yscale("log")
    right.set_xlabel("offered request rate (req/s)")
    right.set_ylabel("ms (log scale)")
    right.set_title("p99 latencies")
    right.grid(True, which="both", alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
