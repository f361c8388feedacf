"""Paired before/after runs of any benchmark module between two source trees, alternating.

    python -m bench.ab --base /tmp/main-before --head . [--rounds 2] [--out DIR] \\
        [--metric systems.pdserve.tokens_per_s --metric decode_step.step_s] -- bench.engine.throughput --systems pdserve
    python -m bench.ab --base /tmp/main-before --head . -- bench.fabric.transfer --providers shm --pages huge --record

Round n runs the module once per tree, base then head in odd rounds, head then base in even ones,
so both trees see the same phases of a noisy host (one machine, one run). Each run is
`python -P -m MODULE ARGS --results-dir OUT/<base|head>-<n>` with PYTHONPATH = (this checkout's
bench package alone, the tree, the tree's proto/): the benchmark's code is this checkout's, the
library (pdserve, fabric, kv_messenger, router, ...) the tree's, so the library API the benchmark
uses must be the same in both trees, and each tree needs its C extensions built in place
(`python setup.py build_ext --inplace`). Its output goes to OUT/<base|head>-<n>.log, its result
files to OUT/<base|head>-<n>/ (each stamped with its tree's commit by the results writer).

--metric PATH (repeatable) reads a number from each run's JSON result (a dotted path of keys, e.g.
systems.pdserve.tokens_per_s) and tabulates base and head medians and the median of the per-round
paired differences (head - base) in OUT/ab.md. Each run is bounded by --timeout-s (default 3600 s);
a run that fails or times out stops the comparison with its log's path. Runs on the caller's thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.paired import rounds_in_order, tree_env
from bench.common.results import write_results

TREES = ("base", "head")


@dataclass(frozen=True)
class Run:
    tree: str          # "base" or "head"
    round: int         # 1-based
    seconds: float
    results_dir: Path
    log: Path


def _git_commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=10, check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown (not a git checkout)"


def run_once(tree: Path, tag: str, rnd: int, module: str, module_args: list[str], out: Path,
             results_flag: str, timeout_s: float) -> Run:
    results_dir = out / f"{tag}-{rnd}"
    log = out / f"{tag}-{rnd}.log"
    argv = [sys.executable, "-P", "-m", module, *module_args, results_flag, str(results_dir)]
    print(f"[{tag} {rnd}] {' '.join(argv[3:])}  (library from {tree})", flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        try:
            done = subprocess.run(argv, env=tree_env(tree), stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired as e:
            raise SystemExit(f"[{tag} {rnd}] timed out after {timeout_s:.0f} s; log: {log}") from e
    if done.returncode != 0:
        raise SystemExit(f"[{tag} {rnd}] exited {done.returncode}; log: {log}")
    return Run(tag, rnd, time.monotonic() - t0, results_dir, log)


def metric(run: Run, path: str) -> float:
    """The number at dotted `path` in the run's (first) JSON result file (a list's element by its
    index: `rows.0.server_ttft_s`)."""
    files = sorted(run.results_dir.glob("*.json"))
    if not files:
        raise SystemExit(f"--metric {path}: run {run.tree}-{run.round} wrote no JSON result in {run.results_dir}")
    value: Any = json.loads(files[0].read_text())
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
            continue
        if not isinstance(value, dict) or key not in value:
            have = sorted(value)[:20] if isinstance(value, dict) else f"a list of {len(value)}" \
                if isinstance(value, list) else type(value).__name__
            raise SystemExit(f"--metric {path}: no {key!r} in {files[0]} (there: {have})")
        value = value[key]
    if not isinstance(value, int | float):
        raise SystemExit(f"--metric {path}: {value!r} in {files[0]} is not a number")
    return float(value)


def summary_lines(args: argparse.Namespace, trees: dict[str, Path], runs: list[Run]) -> list[str]:
    lines = ["# Paired A/B of two source trees", "",
             f"Module: `python -m {args.module} {' '.join(args.module_args)}`, {args.rounds} round(s), "
             "base and head alternating (odd rounds base first).", ""]
    lines += [f"- {tag}: {trees[tag]} (commit {_git_commit(trees[tag])})" for tag in TREES]
    lines += ["", "| run (in order) | seconds | results |", "|---|---:|---|"]
    lines += [f"| {r.tree} {r.round} | {r.seconds:.1f} | {r.results_dir.name}/ |" for r in runs]
    if args.metric:
        lines += ["", "| metric | base median | head median | median paired head - base | head higher in |",
                  "|---|---:|---:|---:|---:|"]
        for path in args.metric:
            by = {tag: [metric(r, path) for r in sorted(runs, key=lambda r: r.round) if r.tree == tag]
                  for tag in TREES}
            diffs = [h - b for b, h in zip(by["base"], by["head"], strict=True)]
            base, head = statistics.median(by["base"]), statistics.median(by["head"])
            pct = f" ({100 * statistics.median(diffs) / base:+.1f}%)" if base else ""
            lines.append(f"| {path} | {base:.4g} | {head:.4g} | {statistics.median(diffs):+.4g}{pct} | "
                         f"{sum(d > 0 for d in diffs)} of {len(diffs)} rounds |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, type=Path, help="source tree before the change")
    p.add_argument("--head", required=True, type=Path, help="source tree with the change")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="folder of logs and results (default: a new one in /tmp)")
    p.add_argument("--metric", action="append", default=[], help="dotted path of a number in the JSON result")
    p.add_argument("--results-flag", default="--results-dir", help="the module's flag for its results folder")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="the bound of one run")
    p.add_argument("module", help="a benchmark module, e.g. bench.engine.throughput")
    p.add_argument("module_args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    args = p.parse_args(argv)
    if args.module_args[:1] == ["--"]:
        args.module_args = args.module_args[1:]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    trees = {"base": args.base.resolve(), "head": args.head.resolve()}
    out = args.out or Path(f"/tmp/pdserve-ab-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_once(trees[tag], tag, rnd + 1, args.module, args.module_args, out, args.results_flag, args.timeout_s)
            for rnd, order in rounds_in_order(args.rounds, TREES) for tag in order]
    lines = summary_lines(args, trees, runs)
    print("\n".join(lines), flush=True)
    write_results(out, "ab", lines=lines, argv=None if argv is None else list(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
