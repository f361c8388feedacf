"""Stale /dev/shm files of killed processes are removed; anything that may be alive is kept."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

from fabric import shmclean


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _region(path: str, pid: int, version: int = 4) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<BBHi", version, 0, 1, pid) + bytes(56))


def test_sweep_removes_only_certainly_stale_files(tmp_path) -> None:
    dead, me, alive = _dead_pid(), os.getpid(), os.getppid()
    d = str(tmp_path)
    _region(f"{d}/{dead}:0:0", dead)                     # killed owner: stale
    _region(f"{d}/{dead}:0:1", dead + 1)                 # header disagrees: not ours to judge
    _region(f"{d}/{dead}:0:2", dead, version=5)          # unknown layout: kept
    _region(f"{d}/{alive}:0:0", alive)                   # owner alive: kept
    open(f"{d}/{shmclean.BELL_PREFIX}{dead}-abc", "wb").close()   # killed owner's doorbell: stale
    open(f"{d}/{shmclean.BELL_PREFIX}{alive}-abc", "wb").close()  # alive: kept
    _region(f"{d}/{me}:7:0", me)                         # this pid, but older than this process
    os.utime(f"{d}/{me}:7:0", (time.time() - 10 ** 6, time.time() - 10 ** 6))
    _region(f"{d}/{me}:8:0", me)                         # made by this process: kept
    open(f"{d}/unrelated", "wb").close()
    assert shmclean.sweep(d) == 3
    left = sorted(os.listdir(d))
    for gone in (f"{dead}:0:0", f"{shmclean.BELL_PREFIX}{dead}-abc", f"{me}:7:0"):
        assert gone not in left, gone
    for kept in (f"{dead}:0:1", f"{dead}:0:2", f"{alive}:0:0", f"{shmclean.BELL_PREFIX}{alive}-abc", f"{me}:8:0",
                 "unrelated"):
        assert kept in left, kept
