"""What is stale in this process: engines closed here and regions deregistered here.

Process-wide, shared by every TransferEngine of the process, so that a descriptor of an
engine or region closed in this process is refused before anything is posted (a peer's
goodbye or revocation message may not have been processed yet, and for shm a write to a
closed engine's region would dereference memory that is gone). Entries are never removed:
engine ids are never reused, and (engine id, region id) pairs neither.

Threads: any thread; one lock guards both sets and is held only for a set operation
(never while waiting on anything).
"""

from __future__ import annotations

import threading

_closed_engines: set[str] = set()
_revoked_regions: set[tuple[str, int]] = set()
_lock = threading.Lock()


def mark_engine_closed(engine_id: str) -> None:
    """Record that the engine ``engine_id`` of this process has closed."""
    with _lock:
        _closed_engines.add(engine_id)


def mark_region_revoked(engine_id: str, region_id: int) -> None:
    """Record that region ``region_id`` of engine ``engine_id`` was deregistered."""
    with _lock:
        _revoked_regions.add((engine_id, region_id))


def engine_closed(engine_id: str) -> bool:
    """Whether the engine ``engine_id`` was closed in this process."""
    with _lock:
        return engine_id in _closed_engines


def region_revoked(engine_id: str, region_id: int) -> bool:
    """Whether region ``region_id`` of engine ``engine_id`` was deregistered in this process."""
    with _lock:
        return (engine_id, region_id) in _revoked_regions


def closed_engines() -> frozenset[str]:
    """A snapshot of the engines closed in this process."""
    with _lock:
        return frozenset(_closed_engines)
