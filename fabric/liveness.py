"""Host and process identity, to tell whether a peer on this host is gone."""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """The kernel's boot id: equal for all processes of one running host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


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
