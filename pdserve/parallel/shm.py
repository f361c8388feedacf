"""Each tensor-parallel rank's KV pool in a named shared-memory file that the leader maps (D15).

The leader creates one file per worker rank under /dev/shm (`pdserve-kv-<leader pid>-<rank>-<tag>`),
sized for that rank's pool, maps it read-write (MAP_SHARED) and hands the name to the worker,
which maps the same pages as its KV pool. Once every worker has mapped its file the leader
unlinks all of them: the mappings stay valid, and nothing is left in /dev/shm whether the
processes exit, crash or are killed. Files of a leader killed between creating and unlinking
them are removed by the next leader's `remove_stale_files` (their pid no longer runs).

Huge pages: the mapping is advised MADV_HUGEPAGE, which the kernel honours for shared memory only
when /sys/kernel/mm/transparent_hugepage/shmem_enabled allows it (`reason` says why not).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"
_SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_MADV_POPULATE_WRITE = 23


@dataclass(frozen=True)
class PoolFile:
    """One rank's pool file: its name under SHM_DIR and its size."""

    name: str
    nbytes: int

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)


def new_pool_file(rank: int, nbytes: int) -> PoolFile:
    return PoolFile(f"{PREFIX}{os.getpid()}-{rank}-{secrets.token_hex(4)}", nbytes)


class SharedPool:
    """A mapping of a pool file (create=True: the file is made, sized and zero-filled first)."""

    def __init__(self, file: PoolFile, create: bool, populate: bool = False) -> None:
        if file.nbytes <= 0:
            raise ValueError(f"shared KV pool {file.name}: nbytes must be > 0, got {file.nbytes}")
        self.file = file
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(file.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, file.nbytes)
            elif os.fstat(fd).st_size != file.nbytes:
                raise ValueError(f"shared KV pool {file.path} has {os.fstat(fd).st_size} bytes, expected {file.nbytes}")
            self._map = mmap.mmap(fd, file.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.huge_pages, self.reason = False, ""
        try:
            with open(_SHMEM_THP, encoding="ascii") as f:
                mode = f.read().split("[")[1].split("]")[0]
        except (OSError, IndexError):
            mode = "unavailable"
        if mode in ("never", "deny", "unavailable"):
            self.reason = f"shared-memory transparent huge pages are {mode} ({_SHMEM_THP})"
        else:
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except (OSError, AttributeError) as exc:
                self.reason = f"madvise(MADV_HUGEPAGE) refused: {exc}"
        if populate:
            try:
                self._map.madvise(_MADV_POPULATE_WRITE)
            except OSError:
                view = memoryview(self._map)
                for off in range(0, file.nbytes, mmap.PAGESIZE):
                    view[off] = view[off]
                view.release()

    def close(self) -> None:
        """Unmap (only before any tensor() view was made: a live view keeps the mapping, BufferError)."""
        self._map.close()

    @property
    def address(self) -> int:
        return self.tensor(torch.uint8).data_ptr()

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A tensor over the whole mapping (it keeps the mapping alive)."""
        flat = torch.frombuffer(self._map, dtype=dtype)
        return flat if shape is None else flat.view(shape)


def unlink(file: PoolFile) -> None:
    """Remove the file's name (mappings stay valid); a name already gone is fine."""
    try:
        os.unlink(file.path)
    except FileNotFoundError:
        logger.debug("shared KV pool %s was already unlinked", file.path)


def remove_stale_files() -> list[str]:
    """Remove pool files left by leaders that no longer run; returns the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
