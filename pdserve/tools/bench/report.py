"""What a run leaves behind (L3): a readable table for the terminal and the result JSON.

The JSON holds the run's settings, the machine (cores, CPU, load average, commit), every metric of
metrics.BenchMetrics, the per-request records, and anything the caller adds (server-side histograms,
a comparison's targets). `load_result` reads one back (records as RequestRecords).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.tools.bench.metrics import BenchMetrics, LatencyStats
from pdserve.tools.bench.prometheus import SpecDecodeCounters
from pdserve.tools.bench.records import RequestRecord

SCHEMA = "pdserve-bench/1"
_LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e"))


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, load average now, Python, commit, date."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"nproc": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)), "cpu": cpu,
            "load_average": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def spec_decode_rows(c: SpecDecodeCounters | None) -> list[tuple[str, str]]:
    """The run's speculative decoding, as the server counted it; nothing when it exported no counters
    or verified no draft in the run (the rates are then undefined)."""
    if c is None or c.num_drafts <= 0:
        return []
    per_pos = " ".join(f"{r:.3f}" for r in c.per_position_rate) or "-"
    return [("Spec decode drafts / draft tokens / accepted", f"{c.num_drafts:g} / {c.num_draft_tokens:g} / "
             f"{c.num_accepted_tokens:g}"),
            ("Spec decode acceptance rate (accepted / drafted)", _num(c.acceptance_rate, 3)),
            ("Spec decode mean acceptance length (1+acc/drafts)", _num(c.mean_acceptance_length, 3)),
            ("Spec decode acceptance rate by position", per_pos)]


def format_table(m: BenchMetrics, title: str = "pdserve bench", header: Sequence[tuple[str, str]] = (),
                 footer: Sequence[tuple[str, str]] = ()) -> str:
    """The terminal summary of one run; `footer` rows (e.g. spec_decode_rows) follow the throughputs."""
    w = 54
    rows: list[tuple[str, str]] = list(header)
    reasons = ", ".join(f"{k} {v}" for k, v in m.finish_reasons.items()) or "-"
    rows += [
        ("Requests sent / completed / failed", f"{m.requests_sent} / {m.completed} / {m.failed}"),
        ("Finish reasons", reasons),
        ("Duration (s)", _num(m.duration_s)),
        ("Prompt tokens / output tokens (completed)", f"{m.total_input_tokens} / {m.total_output_tokens}"),
        ("Request throughput (req/s)", _num(m.request_throughput, 3)),
        ("Output token throughput, system TPS (tok/s)", _num(m.output_token_throughput)),
        ("Total token throughput, prompt+output (tok/s)", _num(m.total_token_throughput)),
        ("Per-user TPS, 1 / mean ITL (tok/s)", _num(m.per_user_tps)),
    ]
    if m.goodput is not None:
        slo = " ".join(f"{k}<={getattr(m.slo, f'{k}_ms'):g}ms" for k in ("ttft", "tpot", "e2el")
                       if getattr(m.slo, f"{k}_ms") is not None)
        rows.append((f"Goodput (req/s; {slo})", f"{_num(m.goodput, 3)} ({m.good_requests} of {m.completed})"))
    rows += list(footer)
    lines = [f" {title} ".center(w + 40, "="), *(f"{k:<{w}}{v}" for k, v in rows)]
    lines.append(" latencies (ms) ".center(w + 40, "-"))
    lines.append(f"{'':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'max':>10}{'count':>10}")
    for label, key in _LATENCIES:
        s: LatencyStats = getattr(m, key)
        lines.append(f"{label:<14}{_ms(s.mean):>10}{_ms(s.median):>10}{_ms(s.p90):>10}{_ms(s.p99):>10}"
                     f"{_ms(s.max):>10}{s.count:>10}")
    lines.append("=" * (w + 40))
    return "\n".join(lines)


def result_dict(kind: str, settings: dict[str, Any], metrics: BenchMetrics, records: Sequence[RequestRecord],
                machine: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"schema": SCHEMA, "kind": kind, "settings": settings, "machine": machine or machine_info(),
            "metrics": metrics.to_json(), **extra, "records": [r.to_json() for r in records]}


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_result(path: str | Path) -> tuple[dict[str, Any], list[RequestRecord]]:
    """(the result dict, its records); ValueError for a file that is not a pdserve-bench result."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else None
        raise ValueError(f"{path} is not a {SCHEMA} result (schema: {schema})")
    return data, [RequestRecord.from_json(r) for r in data.get("records", [])]
