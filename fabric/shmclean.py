"""Remove what killed processes left in /dev/shm: our doorbells and libfabric shm regions.

A process that exits normally unlinks both. One that is killed cannot, and its files stay:
each shm region is several MiB of tmpfs (memory), and libfabric 1.17 names regions
"<pid>:<endpoint>:<domain>", so a later process that gets the same pid cannot create its
endpoint at all (fi_enable: "Device or resource busy"). Tests kill peers on purpose, and
production processes crash, so every engine sweeps before it opens.

A file is removed only when it is certainly stale:
- it carries this process's pid but is older than this process (a previous owner of the pid);
- or its owner pid no longer exists and, for a libfabric region, its header names that same pid.
The pids are read in this process's pid namespace; shm peers must share it anyway (shm copies
with process_vm_writev, which addresses peers by pid), see fabric.liveness.host_id.
"""

from __future__ import annotations

import logging
import os
import re
import struct

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
BELL_PREFIX = "pdserve-bell-"
_REGION_NAME = re.compile(r"^(\d+):\d+:\d+$")  # libfabric 1.17 shm: "<pid>:<ep>:<domain>"
_REGION_HEADER = struct.Struct("<BBHi")  # version, resv, flags, pid (struct smr_region)
_REGION_VERSION = 4


def _owner(name: str) -> tuple[int, bool] | None:
    """(pid, is_region) for our doorbells and libfabric regions, None for anything else."""
    if name.startswith(BELL_PREFIX):
        pid = name[len(BELL_PREFIX) :].split("-", 1)[0]
        return (int(pid), False) if pid.isdigit() else None
    m = _REGION_NAME.match(name)
    return (int(m.group(1)), True) if m else None


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _region_pid(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            head = f.read(_REGION_HEADER.size)
    except OSError:
        return None
    if len(head) < _REGION_HEADER.size:
        return None
    version, _, _, pid = _REGION_HEADER.unpack(head)
    return pid if version == _REGION_VERSION else None


def _started_at() -> float:
    """This process's start time as a Unix time (from /proc), 0.0 if unknown."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, StopIteration):
        return 0.0
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def sweep(directory: str = SHM_DIR) -> int:
    """Remove stale doorbells and shm regions from ``directory``; returns how many."""
    me = os.getpid()
    born = _started_at()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        owner = _owner(name)
        if owner is None:
            continue
        pid, is_region = owner
        path = os.path.join(directory, name)
        if pid == me:
            try:
                # the previous owner of this pid wrote it last before it died, so before we started
                stale = born > 0 and os.stat(path).st_mtime < born - 1.0
            except FileNotFoundError:
                continue
        else:
            stale = _gone(pid) and (not is_region or _region_pid(path) == pid)
        if not stale:
            continue
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass  # another process swept it first
        except OSError as exc:
            logger.info("cannot remove stale %s: %s", path, exc)
    if removed:
        logger.info("removed %d shared-memory files left by processes that were killed", removed)
    return removed
