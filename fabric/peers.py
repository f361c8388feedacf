"""PeerTable: the engines this one talks to, their addresses, and whether they are still there.

A peer enters the address vector (AV) on first use (``resolve``): a write to it, a message
from it, or ``connect``, once its endpoint name passed ``check_address`` (a name from the network
never reaches fi_av_insert unless its length fits the provider's format), whose handshake
(HELLO answered by PONG) also brings the regions the peer had deregistered. The table knows
which peers failed at the transport (PEER_FAILED events: they stay failed until ``connect``
resets them), which said goodbye or were judged gone, and which regions of theirs are revoked.

Liveness (``wait_peer_gone``): a peer is gone when it said goodbye, when its process ended
(same host: pid and start time, fabric.liveness), or when a probe (PING) to it fails at the
transport because its endpoint no longer exists. Then what it had already sent is drained by
the progress thread (``quiesce``) before the answer is True.

Threads: every method may be called from any thread; ``on_*`` run on the progress thread.
Blocking waits, each bounded:
- ``connect``: the handshake's answer, at most ``timeout`` (default 5 s); from the progress
  thread it only sends HELLO and does not wait. ``send_control`` of a USER message to a peer not
  handshaken yet runs it first (the receiver drops messages from an address it has not inserted
  yet, fabric.protocol).
- ``wait_peer_gone``: at most ``timeout`` overall, in probes of at most 0.5 s each, with
  pauses of at most 50 ms between answered probes.
- ``quiesce``: 50 ms for a dead peer's bytes to surface, then at most 1 s for two full
  progress rounds.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from fabric import control, stale
from fabric._libfabric import ffi, lib
from fabric.descriptors import PeerDescriptor, check_address
from fabric.endpoint import Endpoint, bell_name
from fabric.errors import FabricError
from fabric.liveness import process_alive
from fabric.protocol import ControlChannel, OnSent

logger = logging.getLogger(__name__)

_PROBE_SLICE_S = 0.5  # wait_peer_gone: the longest wait for one probe's answer
_PROBE_PAUSE_S = 0.05  # wait_peer_gone: pause after a peer answered, before probing again
_DRAIN_GRACE_S = 0.05  # _quiesce: bytes a dead peer left in our socket buffers become readable
_DRAIN_TIMEOUT_S = 1.0  # _quiesce: the longest wait for two progress rounds


@dataclass
class _Probe:
    event: threading.Event
    alive: bool = False
    failed: bool = False


class PeerTable:
    """Peers of one endpoint, keyed by their raw address (AV) and by engine id."""

    def __init__(self, ep: Endpoint, channel: ControlChannel) -> None:
        self._ep = ep
        self._channel = channel
        self._fi_addr: dict[bytes, int] = {}
        self._peers: dict[int, PeerDescriptor] = {}
        self._failed: set[int] = set()  # fi_addr of peers failed at the transport
        self._gone: set[str] = set()  # engine ids that said goodbye or were judged gone
        self._revoked: set[tuple[str, int]] = set()  # (engine id, region id) revoked by their owner
        self._probes: dict[int, _Probe] = {}
        self._handshaken: set[tuple[str, bytes]] = set()  # (engine id, endpoint name) that answered our HELLO

    # ------------------------------------------------------------ queries

    def is_gone(self, engine_id: str) -> bool:
        """The engine said goodbye, or wait_peer_gone judged it gone."""
        return engine_id in self._gone

    def is_revoked(self, engine_id: str, region_id: int) -> bool:
        """The owner told us the region was deregistered."""
        return (engine_id, region_id) in self._revoked

    def is_failed(self, fi_addr: int) -> bool:
        """The transport failed this address (caller holds the endpoint lock for a consistent answer)."""
        return fi_addr in self._failed

    def handshaken(self, peer: PeerDescriptor) -> bool:
        """``peer``'s endpoint answered our HELLO. Per endpoint name, not per engine: an engine with
        several rails (fabric.engine) has one endpoint per rail, each with its own AV, regions and
        revocations to tell."""
        return (peer.engine_id, peer.address) in self._handshaken

    def addresses_of(self, engine_id: str) -> list[PeerDescriptor]:
        """Every endpoint of engine ``engine_id`` in this AV (several when it has several rails)."""
        with self._ep.lock:
            return [p for p in self._peers.values() if p.engine_id == engine_id]

    def mark_gone(self, engine_id: str) -> None:
        """Another rail of this engine judged ``engine_id`` gone (TransferEngine.wait_peer_gone)."""
        self._gone.add(engine_id)

    def peer_at(self, fi_addr: int) -> PeerDescriptor | None:
        """The peer inserted at AV address ``fi_addr`` (None: none, or PDF_ADDR_UNKNOWN)."""
        with self._ep.lock:
            return self._peers.get(fi_addr)

    def rebind(self, fi_addr: int, peer: PeerDescriptor) -> None:
        """A new engine now owns the endpoint name at ``fi_addr`` (a process restarted at the same
        address said HELLO from it): messages from there are its from now on. If the old engine
        had failed at the transport, the address is reinserted as ``connect`` does (``resolve``
        with reset: the native side's failed flag is cleared and a same-host peer's process
        watched anew), since the failure was the old process's: without it every send to the new
        one, the answer to its HELLO first, would fail at once (FI_EHOSTUNREACH)."""
        with self._ep.lock:
            old = self._peers.get(fi_addr)
            if old is None or old.address != peer.address:
                return
            self._peers[fi_addr] = peer
            failed = fi_addr in self._failed
        logger.info("endpoint %s now belongs to %r (was %r)%s", peer.address.hex()[:16], peer, old,
                    "; its failed state was the old engine's, cleared" if failed else "")
        if failed:
            self.resolve(peer, hello=False, reset=True)

    def known_peers(self) -> list[PeerDescriptor]:
        """Peers that may still listen (a closed peer must never be sent to:
        shm dereferences the peer's region, which is gone in this process)."""
        closed = stale.closed_engines()
        me = self._ep.engine_id
        with self._ep.lock:
            return [
                p
                for a, p in self._peers.items()
                if a not in self._failed
                and p.engine_id != me
                and p.engine_id not in self._gone
                and p.engine_id not in closed
            ]

    # ------------------------------------------------------------ addresses

    def resolve(self, peer: PeerDescriptor, hello: bool = True, reset: bool = False) -> int:
        """The AV address of ``peer``, inserting it on first use (then greeting it unless ``hello=False``).

        A failed peer keeps its failed address until ``reset`` (connect) reinserts it."""
        ep = self._ep
        if peer.provider != ep.provider:
            raise FabricError(
                lib.FI_EINVAL, f"peer {peer!r} uses provider {peer.provider!r}, this engine {ep.provider!r}"
            )
        with ep.lock:
            fi_addr = self._fi_addr.get(peer.address)
            if fi_addr is not None and not (reset and fi_addr in self._failed):
                return fi_addr  # a failed peer stays failed until connect()
        try:
            check_address(ep.provider, peer.address, len(ep.me.address))
        except ValueError as e:
            raise FabricError(lib.FI_EINVAL, f"peer {peer!r}: {e}") from None
        addr = ffi.new("uint8_t[]", peer.address)
        out = ffi.new("uint64_t *")
        rc = lib.pdf_av_insert(ep.h, addr, len(peer.address), out)
        if rc:
            raise FabricError(rc, f"fi_av_insert({peer!r})")
        fi_addr = int(out[0])
        with ep.lock:
            self._fi_addr[peer.address] = fi_addr
            self._peers[fi_addr] = peer
            self._failed.discard(fi_addr)
        if peer.host_id == ep.me.host_id and peer.engine_id != ep.engine_id:
            # same host (and pid namespace): watch its process, ring its doorbell (shm)
            rc = lib.pdf_peer_local(ep.h, fi_addr, peer.pid, bell_name(peer).encode())
            if rc:
                logger.info("peer %r: no pidfd or doorbell (%s); it may be judged late", peer,
                            FabricError(rc, "pdf_peer_local"))
        if hello and peer.engine_id != ep.engine_id:
            # first contact: introduce ourselves, so the peer can say goodbye
            # to us, revoke regions and answer probes
            self.send_control(peer, control.HELLO, 0)
        return fi_addr

    def send_control(
        self, peer: PeerDescriptor, kind: int, value: int, payload: bytes = b"", on_result: OnSent | None = None
    ) -> None:
        """Send one control message to ``peer``; refused (FI_ESHUTDOWN) once it is closed or gone."""
        data = self._channel.encode(kind, value, payload)
        if stale.engine_closed(peer.engine_id) or peer.engine_id in self._gone:
            raise FabricError(lib.FI_ESHUTDOWN, f"send {control.KINDS[kind]}: {peer!r} is closed")
        if kind == control.USER and not self.handshaken(peer) and not self._ep.on_progress_thread():
            self.connect(peer)   # it knows our address before our first message arrives
        fi_addr = self.resolve(peer)
        self._channel.post(peer, fi_addr, kind, data, on_result)

    # ------------------------------------------------------------ connect

    def connect(self, peer: PeerDescriptor, timeout: float = 5.0) -> None:
        """Insert ``peer`` into the AV and shake hands (see TransferEngine.connect)."""
        ep = self._ep
        ep.check_open()
        self.resolve(peer, hello=False, reset=True)
        if peer.engine_id == ep.engine_id or self.handshaken(peer):
            return
        if ep.on_progress_thread():
            self.send_control(peer, control.HELLO, 0)  # cannot wait for the answer here
            return
        nonce = ep.next_id()
        probe = _Probe(threading.Event())
        with ep.lock:
            self._probes[nonce] = probe
        try:
            self.send_control(peer, control.HELLO, nonce, on_result=lambda err: self._probe_sent(nonce, err))
            answered = probe.event.wait(timeout)
        finally:
            with ep.lock:
                self._probes.pop(nonce, None)
        if not answered or not probe.alive:
            raise FabricError(lib.FI_ETIMEDOUT, f"connect to {peer!r}: no answer within {timeout}s")
        self._handshaken.add((peer.engine_id, peer.address))

    def disconnect(self, peer: PeerDescriptor) -> None:
        """Remove ``peer`` from the AV; its outstanding work is failed."""
        ep = self._ep
        with ep.lock:
            fi_addr = self._fi_addr.pop(peer.address, None)
            if fi_addr is None:
                return
            self._peers.pop(fi_addr, None)
        ep.fail_peer(fi_addr, lib.FI_ECANCELED)
        rc = lib.pdf_av_remove(ep.h, fi_addr)
        if rc:
            raise FabricError(rc, f"fi_av_remove({peer!r})")

    def close_connection(self, peer: PeerDescriptor) -> None:
        """Insert ``peer``'s address if absent (no greeting), then ``disconnect`` it: with
        FI_AV_REMOVE_CLEANUP ofi_rxm closes the connection of the removed address whichever side
        opened it (TransferEngine.close_connection)."""
        self.resolve(peer, hello=False)
        self.disconnect(peer)

    # ------------------------------------------------------------ liveness

    def peer_gone(self, peer: PeerDescriptor) -> bool:
        """True if ``peer`` said goodbye, or (same host) its process has ended."""
        if peer.engine_id in self._gone:
            return True
        if peer.host_id == self._ep.me.host_id and not process_alive(peer.pid, peer.start_time):
            return True
        return False

    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no write from ``peer`` can land here any more (see TransferEngine)."""
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout={timeout!r}: expected seconds >= 0")
        deadline = time.monotonic() + timeout
        while True:
            if self.peer_gone(peer):
                self.quiesce()
                self._gone.add(peer.engine_id)
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            probe = self._probe(peer, min(remaining, _PROBE_SLICE_S))
            if probe is not None and probe.failed:
                self.quiesce()
                self._gone.add(peer.engine_id)
                return True
            if probe is not None and probe.alive:
                time.sleep(min(_PROBE_PAUSE_S, max(0.0, deadline - time.monotonic())))

    def _probe(self, peer: PeerDescriptor, timeout: float) -> _Probe | None:
        """PING ``peer`` and wait up to ``timeout`` s: the probe if answered or failed, None if silent."""
        ep = self._ep
        nonce = ep.next_id()
        probe = _Probe(threading.Event())
        with ep.lock:
            self._probes[nonce] = probe
        try:
            self.send_control(peer, control.PING, nonce, on_result=lambda err: self._probe_sent(nonce, err))
        except FabricError as exc:
            logger.info("probe of %r not sent: %s", peer, exc)
            probe.failed = True
            return probe
        probe.event.wait(timeout)
        with ep.lock:
            self._probes.pop(nonce, None)
        return probe if probe.event.is_set() else None

    def _probe_sent(self, nonce: int, err: FabricError | None) -> None:
        if err is None:
            return
        with self._ep.lock:
            probe = self._probes.get(nonce)
        if probe is not None:
            probe.failed = True
            probe.event.set()

    def quiesce(self) -> None:
        """Let the progress thread drain what already arrived (two full passes)."""
        ep = self._ep
        time.sleep(_DRAIN_GRACE_S)  # bytes a dead peer left in our socket buffers become readable
        start = ep.generation
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while ep.generation < start + 2 and time.monotonic() < deadline and ep.progress_alive():
            ep.poke()
            time.sleep(0.001)

    # ------------------------------------------------------------ events (progress thread)

    def on_peer_failed(self, ev) -> None:
        """PDF_EV_PEER_FAILED: the transport gave up on ``ev.id``; it stays failed until connect()."""
        with self._ep.lock:
            self._failed.add(int(ev.id))
            peer = self._peers.get(int(ev.id))
        level = logging.INFO if ev.code == lib.FI_ESHUTDOWN else logging.WARNING
        logger.log(level, "peer %r failed: %s", peer, FabricError(ev.code, "transport"))

    def on_bye(self, sender: PeerDescriptor) -> None:
        """The peer closed its engine: fail what is queued to it, never send to it again."""
        self._gone.add(sender.engine_id)
        with self._ep.lock:
            fi_addr = self._fi_addr.get(sender.address)
        if fi_addr is not None:
            self._ep.fail_peer(fi_addr, lib.FI_ESHUTDOWN)

    def on_revoke(self, sender: PeerDescriptor, region_id: int) -> None:
        self._revoked.add((sender.engine_id, region_id))

    def on_pong(self, nonce: int) -> None:
        with self._ep.lock:
            probe = self._probes.get(nonce)
        if probe is not None:
            probe.alive = True
            probe.event.set()
