"""TransferEngine: one-sided writes over a libfabric FI_EP_RDM endpoint.

A thin facade over the parts, each with one job:

- fabric.endpoint.Endpoint: the native endpoint (csrc/pdf_core.c), this engine's identity and
  attributes, the shared bookkeeping lock and the progress thread;
- fabric.regions.RegionTable: memory registrations and the regions this engine revoked;
- fabric.writes.WritePath: validating, posting and completing paged write batches, stats;
- fabric.peers.PeerTable: the peers, their addresses, the handshake and liveness probes;
- fabric.protocol: posting control messages (ControlChannel) and handling those that arrive
  (ControlProtocol: hello, bye, revoke, ping / pong, user messages);
- fabric.stale: the process-wide memory of closed engines and revoked regions.

This module composes them and routes each event of the progress thread to its part
(``_dispatch``). Primitives: register/deregister, connect/disconnect, write_pages,
write_pages_sync, send, wait_peer_gone, close; plus the receiver's ImmCounter and stats().

Threads: the progress thread (fabric.endpoint) runs every callback; the public methods may be
called from any thread (fabric.backend's rules). Blocking waits, each bounded: ``connect`` and
the first write to a peer (the handshake, ``timeout`` / 5 s), ``wait_peer_gone`` (its
``timeout``), ``write_pages_sync`` (its ``timeout``, see fabric.writes), ``close`` (outstanding
work: config.close_timeout_s; the goodbyes: min(1 s, close_timeout_s); the progress thread's
stop: fabric.endpoint).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from fabric import control, stale
from fabric._libfabric import lib
from fabric.backend import OnDone, OnError, SyncResult, TransferBackend
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.endpoint import Endpoint
from fabric.errors import FabricError
from fabric.imm import ImmCounter
from fabric.memory import MemoryRegion
from fabric.peers import PeerTable
from fabric.protocol import ControlChannel, ControlProtocol
from fabric.regions import RegionTable
from fabric.writes import FabricStats, Offsets, WritePath

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.002  # close(): how often it looks whether outstanding work finished
_BYE_TIMEOUT_S = 1.0  # close(): the longest wait for the goodbyes to leave

# ``disconnect`` must end a peer's connection: ofi_rxm closes the connection of an address removed
# from the AV (dropping the operations still queued on it, so nothing more is read from their
# source buffers) only with this set; libfabric reads it when it first initializes (fi_getinfo).
os.environ.setdefault("FI_AV_REMOVE_CLEANUP", "1")


class TransferEngine(TransferBackend):
    """libfabric implementation of TransferBackend (see its rules).

    One endpoint, one CQ, one progress thread. ``on_message(peer, payload)``
    receives messages sent with ``send`` by other engines.

    Attributes: config, engine_id, provider, domain, mr_mode, tx_credits, max_msg_size,
    wait_mode, delivery_complete (fabric.endpoint.Endpoint).
    """

    def __init__(
        self,
        config: FabricConfig | None = None,
        *,
        on_message: Callable[[PeerDescriptor, bytes], None] | None = None,
    ) -> None:
        self.config = config or FabricConfig()
        self._ep = ep = Endpoint(self.config)
        self.engine_id: str = ep.engine_id
        self.provider: str = ep.provider
        self.domain: str = ep.domain
        self.mr_mode: int = ep.mr_mode
        self.tx_credits: int = ep.tx_credits
        self.max_msg_size: int = ep.max_msg_size
        self.wait_mode: str = ep.wait_mode
        self.delivery_complete: bool = ep.delivery_complete
        self.tx_order: frozenset[str] = ep.tx_order   # FI_ORDER_* granted (csrc open_info asks SAS + WAW)
        self.rx_order: frozenset[str] = ep.rx_order
        self._imm = ImmCounter()
        self._regions = RegionTable(ep)
        self._channel = ControlChannel(ep)
        self._peers = PeerTable(ep, self._channel)
        self._writes = WritePath(ep, self._regions, self._peers)
        self._control = ControlProtocol(ep, self._peers, self._regions, on_message)
        ep.start(self._dispatch)
        logger.info(
            "engine %s: provider=%s domain=%s mr_mode=0x%x tx_credits=%d wait=%s delivery_complete=%s "
            "order tx=%s rx=%s", self.engine_id[:8], self.provider, self.domain, self.mr_mode, self.tx_credits,
            self.wait_mode, self.delivery_complete, "+".join(sorted(self.tx_order)), "+".join(sorted(self.rx_order)),
        )

    # ------------------------------------------------------------ properties

    @property
    def peer_descriptor(self) -> PeerDescriptor:
        return self._ep.me

    @property
    def writes_ordered(self) -> bool:
        """Writes to one peer are delivered in the order posted, as granted (FI_ORDER_WAW on
        this endpoint's transmit and receive sides): a fence write proves the earlier ones landed
        only where both ends have this."""
        return all(bool({"WAW", "RMA_WAW"} & side) for side in (self.tx_order, self.rx_order))

    @property
    def closes_connections(self) -> bool:
        """The provider carries a peer's writes on a connection that ``close_connection`` ends
        here (ofi_rxm: a TCP or verbs connection): what the peer sent on it and we had not read
        by then is refused by our kernel, never delivered. shm and other connectionless
        providers: False."""
        return "ofi_rxm" in self.provider

    @property
    def imm_counter(self) -> ImmCounter:
        return self._imm

    @property
    def closed(self) -> bool:
        return self._ep.closed

    @property
    def shm_locks_released(self) -> int:
        """Region locks of dead shm peers the watchdog released (csrc/pdf_shm.h)."""
        return self._ep.locks_released()

    def stats(self) -> FabricStats:
        """Counts of what write_pages accepted and posted since the engine opened."""
        return self._writes.stats()

    def outstanding(self) -> int:
        """Batches and sends not finished yet, plus operations the provider holds."""
        return self._ep.outstanding()

    # --------------------------------------------------------------- memory

    def register(
        self, buffer: object | None = None, *, address: int | None = None, length: int | None = None
    ) -> MemoryRegion:
        """Register ``buffer`` (writable buffer protocol) or raw ``address``/``length``.

        fabric never allocates: the owner passes a buffer (e.g. a host buffer's
        ``view``) or, for memory it keeps alive itself, e.g. a torch tensor, its
        ``data_ptr()`` and ``nbytes``.
        """
        return self._regions.register(buffer, address=address, length=length)

    def deregister(self, region: MemoryRegion) -> None:
        """Close the registration and tell peers its descriptor is stale.

        What this guarantees, per provider:
        - Every engine refuses the stale descriptor before posting once it
          knows: peers we know get a REVOKE message now; an engine that shakes
          hands later is sent the revocations before the handshake's answer,
          and write_pages checks again after its handshake. Engines in this
          process know at once.
        - tcp, verbs, efa: the target checks keys, so closing the MR also
          makes late writes fail at the target.
        - shm: no target-side check at all. shm moves data with
          process_vm_writev/readv into the virtual addresses it was given, so
          a write a peer posted before it processed the REVOKE still lands,
          in whatever the memory holds by then.
        So the memory may be reused only once every peer that could write to
        it is gone (``wait_peer_gone``), or has otherwise confirmed it will
        not write again (e.g. the prefill node's abort answer).
        """
        self._regions.deregister(region)
        for peer in self._peers.known_peers():
            self._peers.send_control(peer, control.REVOKE, region.region_id)

    # ---------------------------------------------------------------- peers

    def connect(self, peer: PeerDescriptor, timeout: float = 5.0) -> None:
        """Insert ``peer`` into the AV and shake hands: when this returns, the
        peer knows us (so it can tell us about revoked regions, say goodbye
        and answer probes). A failed peer is reset. write_pages connects on
        first use. Raises FabricError(FI_ETIMEDOUT) if the peer does not
        answer within ``timeout``."""
        self._peers.connect(peer, timeout)

    def disconnect(self, peer: PeerDescriptor) -> None:
        """Remove ``peer`` from the AV; its outstanding work is failed, and (rxm) its connection
        is closed with what the provider still queued on it: after this returns nothing more is
        sent to it from our buffers. shm has no connection: its per-peer transmit endpoint went
        when the peer failed (csrc/pdf_core.c peer_fail)."""
        self._peers.disconnect(peer)

    def close_connection(self, peer: PeerDescriptor) -> None:
        """End every connection this endpoint has with ``peer`` (ofi_rxm: the one its AV entry
        names, opened by either side), inserting its address first if we never did (a peer that
        only wrote to us): ``disconnect`` with the address known. Afterwards nothing ``peer``
        posted before can be read from those connections (see ``closes_connections``); a later
        write or send either way opens a new one. What was already read is handled by the
        progress thread within two rounds (``progress_mark`` / ``progressed``)."""
        self._peers.close_connection(peer)

    def progress_mark(self) -> int:
        """The progress thread's round counter now (for ``progressed``), after waking it."""
        self._ep.poke()
        return self._ep.generation

    def progressed(self, mark: int, rounds: int = 2) -> bool:
        """True once the progress thread ran ``rounds`` full rounds since ``mark`` (so what had
        arrived by then was handled), or it has stopped. Never blocks: for callers that poll, as
        an asyncio loop does after ``peer_gone`` (the blocking ``wait_peer_gone`` does it itself)."""
        if not self._ep.progress_alive():
            return True
        if self._ep.generation >= mark + rounds:
            return True
        self._ep.poke()
        return False

    def peer_gone(self, peer: PeerDescriptor) -> bool:
        """True if ``peer`` said goodbye, or (same host) its process has ended."""
        return self._peers.peer_gone(peer)

    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """Wait until no write from ``peer`` can land here any more.

        True when ``peer`` closed its engine (goodbye message), its process
        ended (same host), or a probe to it failed at the transport (its
        endpoint no longer exists); then what it had already sent has been
        drained by our progress thread. False when ``timeout`` passes while
        the peer still answers or cannot be judged: its writes may still land,
        so memory it targets must stay reserved (or be deregistered).
        """
        return self._peers.wait_peer_gone(peer, timeout)

    # -------------------------------------------------------------- writes

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
        *,
        imm_mode: str | None = None,
    ) -> int:
        """Write ``lengths[i]`` bytes from ``src_region+src_offsets[i]`` to ``dst+dst_offsets[i]``.

        ``imm`` (a tag, 0..IMM_TAG_MAX) is delivered to the receiver's
        ImmCounter: one unit per call with imm_mode "last", one unit per
        entry with "every" (config default), however entries contiguous at
        both ends were coalesced into fewer writes (config.coalesce).
        ``imm=None`` sends no immediate data. Exactly one of
        ``on_done()`` / ``on_error(FabricError)`` runs later on the progress
        thread. Everything is validated before anything is posted: bad
        values raise ValueError, bad handles FabricError. Returns the batch id.
        """
        return self._writes.write_pages(
            src_region, src_offsets, dst, dst_offsets, lengths, imm, on_done, on_error, imm_mode
        )

    def write_pages_sync(
        self,
        src_region: MemoryRegion,
        src_offsets: Offsets,
        dst: RemoteDescriptor,
        dst_offsets: Offsets,
        lengths: Offsets,
        imm: int | None,
        *,
        imm_mode: str | None = None,
        timeout: float | None = None,
        spin_us: int | None = None,
    ) -> SyncResult:
        """``write_pages``, waiting for completion on the calling thread.

        For lone, latency-bound writes: the batch is posted and its
        completion polled by this thread (GIL released) for up to
        ``spin_us`` (default ``config.sync_spin_us``); after that the
        progress thread takes over and this thread sleeps until the batch
        completes. No callback, no thread hop on the fast path. Other
        completions this thread happens to poll still reach their callbacks
        on the progress thread. Returns a SyncResult; raises FabricError if
        the batch failed (nothing or part of it landed), or
        FabricError(FI_ETIMEDOUT) once ``timeout`` seconds pass (the batch
        then stays in flight and the region busy until it completes or
        fails). Validation as in write_pages.
        """
        return self._writes.write_pages_sync(
            src_region, src_offsets, dst, dst_offsets, lengths, imm, imm_mode, timeout, spin_us
        )

    # ------------------------------------------------------------ messages

    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        """Send ``payload`` to ``peer``'s ``on_message`` handler (best effort, ordered)."""
        self._ep.check_open()
        self._peers.send_control(peer, control.USER, 0, bytes(payload))

    # ------------------------------------------------------------ progress

    def _dispatch(self, ev) -> None:
        """Route one native event to its part (progress thread, or a fail_* call's caller)."""
        kind = ev.kind
        try:
            if kind == lib.PDF_EV_IMM:
                self._imm.on_landed(int(ev.id), int(ev.count))
            elif kind == lib.PDF_EV_BATCH_DONE:
                self._writes.on_batch_done(ev)
            elif kind == lib.PDF_EV_BATCH_FAILED:
                self._writes.on_batch_failed(ev)
            elif kind == lib.PDF_EV_RECV:
                self._control.on_recv(ev)
            elif kind in (lib.PDF_EV_SEND_DONE, lib.PDF_EV_SEND_FAILED):
                self._channel.on_send_event(ev)
            elif kind == lib.PDF_EV_PEER_FAILED:
                self._peers.on_peer_failed(ev)
            elif kind == lib.PDF_EV_CQ_ERROR:
                logger.error("completion queue error: %s (prov_errno %d)", FabricError(ev.code, "fi_cq_read"), ev.count)
        except Exception:  # a user callback raised: report it, keep progressing
            logger.exception("fabric callback for event kind %d id %d raised", kind, int(ev.id))

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Drain for up to close_timeout_s, say goodbye, fail the rest, release everything."""
        ep = self._ep
        if ep.closed or ep.closing:
            return
        if ep.on_progress_thread():
            raise RuntimeError("TransferEngine.close() called from a fabric callback")
        ep.closing = True
        deadline = time.monotonic() + self.config.close_timeout_s
        while ep.outstanding() and time.monotonic() < deadline:
            time.sleep(_DRAIN_POLL_S)
        for peer in self._peers.known_peers():
            try:
                self._peers.send_control(peer, control.BYE, 0)
            except FabricError as exc:
                logger.info("goodbye to %r not sent: %s", peer, exc)
        bye_deadline = time.monotonic() + min(_BYE_TIMEOUT_S, self.config.close_timeout_s)
        while ep.outstanding() and time.monotonic() < bye_deadline:
            time.sleep(_DRAIN_POLL_S)
        ep.stop()
        stale.mark_engine_closed(self.engine_id)
        ep.close_ep()  # the endpoint goes first, then the MRs it used
        self._regions.close_all()
        ep.release()
        logger.info("engine %s closed", self.engine_id[:8])

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine({self.provider}, engine={self.engine_id[:8]})"

