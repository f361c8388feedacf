"""The results writer: every file a benchmark writes carries its stamp (commit, date, machine, command).

Called on the benchmark's main thread, once at the end of a run. The commit is the one of the
source tree the library (`pdserve`) was imported from, so a run under bench.ab against another tree
is stamped with that tree's commit; `dirty` counts its modified tracked files. Results go to
bench/results/<subject>/ unless the benchmark's --results-dir says otherwise (the smoke tests write
to a temporary folder). git is asked with a 10 s bound per call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common.machine import Machine, machine

BENCH_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = BENCH_DIR / "results"
_GIT_TIMEOUT_S = 10


def library_tree() -> Path:
    """The source tree `pdserve` is imported from (the repository root above the package)."""
    import pdserve

    return Path(pdserve.__file__).resolve().parents[1]


def _git(tree: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


@dataclass(frozen=True)
class Stamp:
    commit: str          # short commit of the library's tree
    dirty: int           # modified tracked files in that tree
    tree: str            # the library's tree
    date: str            # UTC, ISO 8601, seconds
    command: str         # how to run it again, from the repository root
    machine: Machine

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The Markdown footer every .md result ends with."""
        dirty = f" + {self.dirty} modified file(s)" if self.dirty else ""
        return ["", f"Commit {self.commit}{dirty} ({self.tree}), {self.date}.", "",
                f"Machine: {self.machine.summary()}.", "", f"Command: `{self.command}`"]


def command_line(argv: list[str] | None = None) -> str:
    """`python -m <the running module> <its arguments>`, shell-quoted."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    target = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    args = sys.argv[1:] if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["python", *target, *args])


def stamp(argv: list[str] | None = None) -> Stamp:
    tree = library_tree()
    status = _git(tree, "status", "--porcelain", "--untracked-files=no")
    dirty = 0 if status.startswith("unknown") else len(status.splitlines())
    return Stamp(commit=_git(tree, "rev-parse", "--short", "HEAD"), dirty=dirty, tree=str(tree),
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 command=command_line(argv), machine=machine())


def add_results_args(parser: argparse.ArgumentParser, subject: str) -> None:
    """--results-dir (default bench/results/<subject>) on a benchmark's parser."""
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR / subject,
                        help=f"where the result files go (default bench/results/{subject})")


def write_results(directory: Path | str, stem: str, *, payload: dict[str, Any] | None = None,
                  lines: list[str] | None = None, argv: list[str] | None = None) -> list[Path]:
    """<directory>/<stem>.json (payload + "stamp") and/or <stem>.md (lines + the stamp's footer);
    returns the paths written."""
    if payload is None and lines is None:
        raise ValueError(f"write_results({stem!r}): neither a payload nor lines to write")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    st = stamp(argv)
    written = []
    if payload is not None:
        if "stamp" in payload:
            raise ValueError(f"write_results({stem!r}): the payload has its own 'stamp' key")
        path = out / f"{stem}.json"
        path.write_text(json.dumps({**payload, "stamp": st.as_dict()}, indent=1, default=str) + "\n")
        written.append(path)
    if lines is not None:
        path = out / f"{stem}.md"
        path.write_text("\n".join([*lines, *st.lines()]) + "\n")
        written.append(path)
    for path in written:
        print(f"wrote {path}", flush=True)
    return written


def append_section(path: Path | str, lines: list[str], argv: list[str] | None = None) -> Path:
    """Append `lines` and the stamp's footer to a Markdown file that collects several runs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("\n".join([*lines, *stamp(argv).lines()]) + "\n")
    print(f"appended to {path}", flush=True)
    return path
