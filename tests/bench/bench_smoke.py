"""The smoke runs' runner and checks (tests/bench/*): `python -m bench.<module>` as a real subprocess
from the repository root, bounded by its timeout, and the stamp every results file must carry.
Imported by the test modules of this folder as `bench_smoke` (pytest puts the folder on sys.path)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.paths import ROOT, TESTS, child_env

__all__ = ["ROOT", "SMOKE_TIMEOUT_S", "TESTS", "BenchRun", "assert_json_stamped", "assert_stamped", "positive",
           "run_bench"]

SMOKE_TIMEOUT_S = 240   # one benchmark's smallest workload takes seconds; this only bounds a hang


@dataclass(frozen=True)
class BenchRun:
    stdout: str
    out: Path            # the --results-dir given (tmp_path / "results")

    def json(self, stem: str) -> dict[str, Any]:
        return json.loads((self.out / f"{stem}.json").read_text())

    def md(self, stem: str) -> str:
        return (self.out / f"{stem}.md").read_text()


def run_bench(module: str, *args: str, tmp_path: Path, timeout_s: float = SMOKE_TIMEOUT_S,
              **env: str) -> BenchRun:
    """Run `python -m <module> <args>` (the literal "{out}" in an argument becomes the results folder)."""
    out = tmp_path / "results"
    argv = [sys.executable, "-m", module, *(a.replace("{out}", str(out)) for a in args)]
    done = subprocess.run(argv, cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    assert done.returncode == 0, (f"{' '.join(argv[2:])} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
                                  f"\n--- stderr\n{done.stderr[-3000:]}")
    return BenchRun(done.stdout, out)


def assert_stamped(md: str, module: str) -> None:
    """The results writer's footer: commit, date, machine and the command that made the file."""
    assert "\nCommit " in md and "+00:00" in md, md[-600:]
    assert "\nMachine: " in md and " CPUs (" in md, md[-600:]
    assert f"\nCommand: `python -m {module} " in md, md[-600:]


def assert_json_stamped(data: dict[str, Any], module: str) -> None:
    stamp = data["stamp"]
    assert stamp["commit"] and stamp["date"] and stamp["machine"]["nproc"] >= 1, stamp
    assert stamp["command"].startswith(f"python -m {module} "), stamp["command"]


def positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0
