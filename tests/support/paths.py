"""Where things are: the repository root (the working directory and PYTHONPATH of every child process
a test starts), the tests folder, the wire package's sources."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PROTO_DIR = ROOT / "proto"


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ with the repository root first on PYTHONPATH, for `python -m <room>` children
    (so they import this checkout, not whatever an editable install points at), plus `overrides`."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, **overrides}
