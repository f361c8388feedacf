"""TransferBackend: the seam between pdserve and a transport implementation.

The libfabric engine (fabric.engine.TransferEngine) is the one implementation
today; a UCX or NIXL backend would implement the same methods.

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
  (and never call write_pages_sync from one: it waits for that thread).
Blocking waits: ``connect`` and ``wait_peer_gone`` wait at most their timeout;
``write_pages_sync`` at most its ``timeout`` (None: until the batch completes or
fails, which a backend bounds with its peer timeout); ``close`` drains for a
bounded time (TransferEngine: FabricConfig.close_timeout_s). ``write_pages`` and
``send`` never wait for the peer (the first write to a peer may wait for its
handshake, which is bounded like ``connect``).
"""

from __future__ import annotations

import abc
import errno
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.errors import FabricError
from fabric.imm import ImmCounter
from fabric.memory import MemoryRegion

OnDone = Callable[[], None]
OnError = Callable[[FabricError], None]
Offsets = Sequence[int]


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
    def write_pages(
        self,
        src_region: MemoryRegion,
        src_offsets: Offsets,
        dst: RemoteDescriptor,
        dst_offsets: Offsets,
        lengths: Offsets,
        imm: int | None,
        on_done: OnDone,
        on_error: OnError,
    ) -> int:
        """Queue one batch of writes; exactly one of on_done/on_error runs. Returns a batch id."""

    def write_pages_sync(
        self,
        src_region: MemoryRegion,
        src_offsets: Offsets,
        dst: RemoteDescriptor,
        dst_offsets: Offsets,
        lengths: Offsets,
        imm: int | None,
        *,
        timeout: float | None = None,
    ) -> SyncResult:
        """write_pages, returning once the batch completed (raises its FabricError if it failed).

        This default waits for the callbacks; backends override it with a
        path that polls on the calling thread (TransferEngine does)."""
        done = threading.Event()
        errors: list[FabricError] = []

        def failed(err: FabricError) -> None:
            errors.append(err)
            done.set()

        batch_id = self.write_pages(src_region, src_offsets, dst, dst_offsets, lengths, imm, done.set, failed)
        if not done.wait(timeout):
            raise FabricError(errno.ETIMEDOUT, f"write_pages_sync batch {batch_id}: not completed within {timeout}s")
        if errors:
            raise errors[0]
        return SyncResult(batch_id=batch_id, writes=len(lengths), spin_us=0.0, rounds=0, slept=True)

    @abc.abstractmethod
    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        """Send a small control message to ``peer``'s message handler."""

    @abc.abstractmethod
    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """True once no write from ``peer`` can land here any more."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drain (bounded), say goodbye to peers, fail what is left, release everything."""
