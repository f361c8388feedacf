"""Paired, alternating A/B runs: the order of each round, the paired summary, and worker processes
that import the library from another source tree.

A shared host's speed drifts by a third within minutes, so every A/B here alternates (A, B, then
B, A, ...) on one machine in one run and reads the per-round paired differences, not two medians
taken at different moments. Tree workers: `python -P -m <bench module> --worker ...` with
PYTHONPATH = (a folder holding only this bench package, the tree, the tree's proto/), so the
benchmark's code is this checkout's and the library is the tree's (each tree needs its C
extensions built in place). TreeWorker.ask waits at most its `bound_s` (default 900 s, a model
load included) for each answer. Called from the benchmark's main thread.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_PACKAGE = Path(__file__).resolve().parents[1]
WORKER_BOUND_S = 900.0


def rounds_in_order(rounds: int, names: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """(round, the names in this round's order): rotated by one each round (two names: flipped)."""
    names = list(names)
    for r in range(rounds):
        k = r % len(names)
        yield r, names[k:] + names[:k]


@dataclass(frozen=True)
class Paired:
    """Two series measured in the same rounds (seconds), `b` against `a`."""
    a: str
    b: str
    a_median_s: float
    b_median_s: float
    median_diff_s: float     # median over rounds of (b - a)
    b_faster_rounds: int
    rounds: int

    @classmethod
    def of(cls, a: str, b: str, a_s: Sequence[float], b_s: Sequence[float]) -> Paired:
        if len(a_s) != len(b_s) or not a_s:
            raise ValueError(f"paired series {a}/{b} need the same non-zero length, got {len(a_s)} and {len(b_s)}")
        diffs = [y - x for x, y in zip(a_s, b_s, strict=True)]
        return cls(a, b, statistics.median(a_s), statistics.median(b_s), statistics.median(diffs),
                   sum(d < 0 for d in diffs), len(diffs))

    def row(self, label: str) -> str:
        """A Markdown row: label | a ms | b ms | paired b - a ms (%) | b faster in."""
        pct = 100 * self.median_diff_s / self.a_median_s if self.a_median_s else float("nan")
        return (f"| {label} | {self.a_median_s * 1e3:.2f} | {self.b_median_s * 1e3:.2f} | "
                f"{self.median_diff_s * 1e3:+.2f} ({pct:+.1f}%) | {self.b_faster_rounds} of {self.rounds} rounds |")


@functools.cache
def bench_home() -> Path:
    """A folder (made once per process, left in /tmp: it holds one symlink) with only a link to this
    bench package, the first PYTHONPATH entry of a tree's processes."""
    home = Path(tempfile.mkdtemp(prefix="pdserve-bench-home-"))
    (home / "bench").symlink_to(BENCH_PACKAGE, target_is_directory=True)
    return home


def tree_env(tree: Path | str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process that imports bench from here and the library from `tree`
    (run it with `python -P`, so the working directory is not put first)."""
    tree = Path(tree).resolve()
    if not (tree / "pdserve").is_dir():
        raise FileNotFoundError(f"{tree} is not a pdserve source tree (no pdserve/ folder)")
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(bench_home()), str(tree), str(tree / "proto")])
    return env


class TreeWorker:
    """One worker process of a benchmark module for one tree: JSON commands in, one JSON line out each."""

    def __init__(self, tree: Path | str, module: str, args: Sequence[str], bound_s: float = WORKER_BOUND_S) -> None:
        self.tree = Path(tree).resolve()
        self.bound_s = bound_s
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", module, "--worker", *args], cwd=self.tree,
                                     env=tree_env(self.tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send `command` (None: only read, e.g. the ready line) and return the worker's answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=self.bound_s):
                raise TimeoutError(f"worker of {self.tree} gave no answer to {command!r} within {self.bound_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker of {self.tree} exited (code {self.proc.wait(timeout=30)}) on {command!r}")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=self.bound_s)


def serve_commands(handle: Callable[[dict[str, Any]], dict[str, Any]], ready: dict[str, Any] | None = None) -> None:
    """A worker's loop: print the ready line (with `ready`), then answer each JSON command on stdin
    with one JSON line, until stdin closes."""
    print(json.dumps({"ready": True, **(ready or {})}), flush=True)
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line))), flush=True)
