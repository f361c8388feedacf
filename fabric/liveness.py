"""Host and process identity, to tell whether a peer on this host is gone."""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Equal for processes that share a kernel and a pid namespace.

    The kernel's boot id plus the pid namespace: containers on one node share
    the boot id but not pids, and a pid means something (liveness, pidfd,
    shm's CMA) only inside one namespace.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        pidns = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        pidns = "pid:?"
    return f"{boot}/{pidns}"


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot; -1 if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return -1
    # comm may contain spaces and parentheses: fields start after the last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # zombie or dead: its endpoints are gone
        return -1
    return int(fields[19])


def process_alive(pid: int, start_time: int) -> bool:
    """Whether the process (pid, start_time) still runs on this host."""
    return process_start_time(pid) == start_time
