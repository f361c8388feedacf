"""TransferBackend: the seam between pdserve and a transport implementation, and
PageWrites, the one typed value a batch of page writes crosses it as.

The libfabric engine (fabric.engine.TransferEngine) is the one implementation
today; a UCX backend (issue 32) implements the same abstract methods. A write
request is written once, as the fields of ``PageWrites``: ``write(writes,
on_done, on_error)`` posts it, ``write_sync(writes, ...)`` posts it and waits.
One PageWrites per batch (a batch holds every page of a layer for one rank
pair: its offsets are arrays), so the hot path gains one small object per
call and no per-page Python work. ``write_pages`` / ``write_pages_sync``, the
old positional spellings, remain as deprecated shims over them.

Ownership rules:
- A backend owns its endpoint, its registrations and its progress thread.
  MemoryRegion handles are valid only on the backend that made them; other
  processes get RemoteDescriptor / PeerDescriptor values (picklable).
- The caller owns registered memory: it must stay alive and unmoved until
  ``deregister`` returns. Source bytes must not change until the batch's
  on_done/on_error ran; destination bytes are the receiver's to read once its
  ImmCounter expectation fired.
Threading rules:
- Every public method may be called from any thread, except ``close`` which
  must not be called from a callback.
- Callbacks (on_done, on_error, ImmCounter.on_complete, message handlers) run
  on the backend's progress thread: keep them short, never block in them
  (and never call write_sync from one: it waits for that thread).
Blocking waits: ``connect`` and ``wait_peer_gone`` wait at most their timeout;
``write_sync`` at most its ``timeout`` (None: until the batch completes or
fails, which a backend bounds with its peer timeout); ``close`` drains for a
bounded time (TransferEngine: FabricConfig.close_timeout_s). ``write`` and
``send`` never wait for the peer (the first write to a peer may wait for its
handshake, which is bounded like ``connect``).
"""

from __future__ import annotations

import abc
import errno
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.errors import FabricError
from fabric.imm import ImmCounter
from fabric.memory import MemoryRegion

OnDone = Callable[[], None]
OnError = Callable[[FabricError], None]
Offsets = Sequence[int] | np.ndarray   # [n] non-negative ints; a uint64 array passes through as is

_SHORT = 64  # offsets lists up to this long take as_offsets' direct conversion


def as_offsets(values: Offsets, name: str) -> np.ndarray:
    """Validate a 1-D sequence of non-negative ints; return it as contiguous uint64 (both backends
    take a PageWrites' offsets through it)."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint64 and values.ndim == 1:
        return values if values.flags.c_contiguous else np.ascontiguousarray(values)
    if type(values) in (list, tuple) and len(values) <= _SHORT and all(type(v) is int for v in values):
        # short lists of ints (a lone write's [0]): one conversion instead of asarray's checks
        if all(0 <= v < 1 << 64 for v in values):
            return np.array(values, dtype=np.uint64)
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name}[{i}]={int(arr[i])}: offsets and lengths must be >= 0")
    return np.ascontiguousarray(arr, dtype=np.uint64)


@dataclass(frozen=True, slots=True, eq=False)   # eq by identity: its offsets are arrays
class PageWrites:
    """One batch of one-sided writes: entry i moves ``lengths[i]`` bytes from
    ``src_region + src_offsets[i]`` to ``dst + dst_offsets[i]``.

    The offset and length sequences are equally long (n entries); a uint64
    numpy array passes through without a copy. ``imm`` is the tag (0..IMM_TAG_MAX)
    the receiver's ImmCounter counts: one unit per batch with imm_mode "last",
    one per entry with "every", however entries were coalesced; None sends no
    immediate data. ``imm_mode`` None: the backend's configured mode. The
    backend validates everything when the batch is posted (ValueError for bad
    values, FabricError for bad handles) and posts nothing then.
    """

    src_region: MemoryRegion
    src_offsets: Offsets          # [n] byte offsets within src_region
    dst: RemoteDescriptor
    dst_offsets: Offsets          # [n] byte offsets within dst's region
    lengths: Offsets              # [n] bytes of each entry
    imm: int | None
    imm_mode: str | None = None


@dataclass(frozen=True)
class SyncResult:
    """How a write_pages_sync call completed.

    writes: RMA writes the batch became; spin_us: time the caller spent
    polling before it had the outcome or gave up spinning; rounds: progress
    rounds it ran; slept: True if it had to sleep and let the progress
    thread finish (the spin budget ran out).
    """

    batch_id: int
    writes: int
    spin_us: float
    rounds: int
    slept: bool


@dataclass(frozen=True)
class FabricStats:
    """What an engine posted since it opened.

    batches: write_pages calls accepted; entries: (offset, length) entries in
    them; writes: RMA writes those became after coalescing and splitting;
    bytes: bytes they move.
    """

    batches: int
    entries: int
    writes: int
    bytes: int


class TransferBackend(abc.ABC):
    """Moves bytes between registered regions with one-sided writes."""

    @property
    @abc.abstractmethod
    def peer_descriptor(self) -> PeerDescriptor:
        """This endpoint's address, to hand to the processes that write to us."""

    @property
    @abc.abstractmethod
    def imm_counter(self) -> ImmCounter:
        """Counts writes landing here by their immediate data."""

    @abc.abstractmethod
    def register(
        self, buffer: object | None = None, *, address: int | None = None, length: int | None = None
    ) -> MemoryRegion:
        """Register a writable buffer, or raw (address, length) memory."""

    @abc.abstractmethod
    def deregister(self, region: MemoryRegion) -> None:
        """Revoke remote access; raises FabricError(FI_EBUSY) while writes from it are in flight."""

    @abc.abstractmethod
    def connect(self, peer: PeerDescriptor) -> None:
        """Make ``peer`` addressable (idempotent) and introduce ourselves to it."""

    @abc.abstractmethod
    def disconnect(self, peer: PeerDescriptor) -> None:
        """Forget ``peer``; its queued and outstanding writes fail."""

    @abc.abstractmethod
    def write(self, writes: PageWrites, on_done: OnDone, on_error: OnError) -> int:
        """Queue one batch; exactly one of on_done/on_error runs later (progress thread). Returns a batch id."""

    def write_sync(self, writes: PageWrites, *, timeout: float | None = None) -> SyncResult:
        """``write``, returning once the batch completed (raises its FabricError if it failed).

        This default waits for the callbacks; backends override it with a
        path that polls on the calling thread (TransferEngine does)."""
        done = threading.Event()
        errors: list[FabricError] = []

        def failed(err: FabricError) -> None:
            errors.append(err)
            done.set()

        batch_id = self.write(writes, done.set, failed)
        if not done.wait(timeout):
            raise FabricError(errno.ETIMEDOUT, f"write_sync batch {batch_id}: not completed within {timeout}s")
        if errors:
            raise errors[0]
        return SyncResult(batch_id=batch_id, writes=len(writes.lengths), spin_us=0.0, rounds=0, slept=True)

    def write_pages(self, *args: Any, imm_mode: str | None = None) -> int:
        """Deprecated (issue 30): ``write(PageWrites(...), on_done, on_error)``. The old positional
        form ``write_pages(src_region, src_offsets, dst, dst_offsets, lengths, imm, on_done, on_error,
        *, imm_mode=None)``."""
        *fields, on_done, on_error = args
        return self.write(PageWrites(*fields, imm_mode=imm_mode), on_done, on_error)

    def write_pages_sync(self, *args: Any, imm_mode: str | None = None, **wait: Any) -> SyncResult:
        """Deprecated (issue 30): ``write_sync(PageWrites(...), timeout=..., ...)``. The old positional
        form ``write_pages_sync(src_region, src_offsets, dst, dst_offsets, lengths, imm, *,
        imm_mode=None, timeout=None, ...)``; ``wait``: write_sync's keywords."""
        return self.write_sync(PageWrites(*args, imm_mode=imm_mode), **wait)

    @abc.abstractmethod
    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        """Send a small control message to ``peer``'s message handler."""

    @abc.abstractmethod
    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """True once no write from ``peer`` can land here any more."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drain (bounded), say goodbye to peers, fail what is left, release everything."""
