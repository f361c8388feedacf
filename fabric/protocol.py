"""The control protocol between engines: posting control messages and handling those that arrive.

Messages (wire format in fabric.control): HELLO introduces an engine (first contact, and
``connect``'s handshake, answered with PONG after the REVOKEs of the regions this engine
deregistered, so the peer knows them before its connect returns); BYE says an engine closes
(its peer fails what is queued to it and treats it as gone); REVOKE names a deregistered
region; PING / PONG are liveness probes (fabric.peers); USER carries a caller's payload to the
``on_message(peer, payload)`` handler. Messages to one peer arrive in the order sent
(FI_ORDER_SAS, csrc/pdf_core.c).

Who sent a message is the receive completion's source address (FI_SOURCE, fi_cq_readfrom:
PDF_EV_RECV's aux), never the sender its payload claims: a message is handled only when its
source is a peer in the AV whose endpoint name and engine id are the claimed ones. The
exceptions are HELLO and PING from an address not in the AV yet (first contact: the claimed name
is inserted and answered there, so a forgery only makes this engine greet or answer the claimed
name; a receive batch read before the HELLO inserted its sender also shows the sender's next
messages as unknown, which is why USER messages wait for the handshake: PeerTable.send_control);
a HELLO from a known address that claims a new engine id rebinds the address (a process
restarted there).
Anything else is dropped and counted (``ControlProtocol.rejected``, by reason). A provider
without FI_SOURCE (``Endpoint.source_addr`` False: logged at open) leaves only the payload's claim;
shm is one (its 1.17 source addresses are the sender's AV index, not ours, so they are never
used), and there the claim is only believed from this host: a process that can reach a shm
endpoint shares its host and can already write its memory (shm's CMA is process_vm_writev).

ControlChannel posts one encoded message to a resolved peer address and reports its
completion; ControlProtocol handles what arrives. Which peers may be sent to, and their
addresses, is the peer table's business (fabric.peers.PeerTable.send_control).

Threads: ``post`` runs on any thread and never waits (the send is queued to the native side);
``on_recv`` and the send-completion callbacks run on the progress thread and never block.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Callable

from fabric import control
from fabric._libfabric import ffi, lib
from fabric.descriptors import PeerDescriptor
from fabric.endpoint import Endpoint
from fabric.errors import FabricError
from fabric.regions import RegionTable

if TYPE_CHECKING:
    from fabric.peers import PeerTable

logger = logging.getLogger(__name__)

OnSent = Callable[[FabricError | None], None]  # the send's outcome: None when it completed
OnMessage = Callable[[PeerDescriptor, bytes], None]


class ControlChannel:
    """Posts control messages and routes their completions to the sender's callback."""

    def __init__(self, ep: Endpoint) -> None:
        self._ep = ep
        self._sends: dict[int, OnSent] = {}

    def encode(self, kind: int, value: int, payload: bytes = b"") -> bytes:
        """The message from this engine; ValueError when it exceeds config.control_msg_size."""
        data = control.encode(kind, value, self._ep.me, payload)
        limit = self._ep.config.control_msg_size
        if len(data) > limit:
            raise ValueError(f"message of {len(payload)} bytes too large: {len(data)} > control_msg_size {limit}")
        return data

    def post(self, peer: PeerDescriptor, fi_addr: int, kind: int, data: bytes, on_result: OnSent | None) -> None:
        """Queue ``data`` (from ``encode``) to ``fi_addr``; ``on_result`` gets its outcome later."""
        ep = self._ep
        send_id = ep.next_id()
        if on_result is not None:
            with ep.lock:
                self._sends[send_id] = on_result
        buf = ffi.from_buffer("uint8_t[]", data)
        rc = lib.pdf_submit_send(ep.h, send_id, fi_addr, buf, len(data))
        if rc:
            with ep.lock:
                self._sends.pop(send_id, None)
            raise FabricError(rc, f"send {control.KINDS[kind]} to {peer!r}")

    def on_send_event(self, ev) -> None:
        """PDF_EV_SEND_DONE / PDF_EV_SEND_FAILED (progress thread)."""
        with self._ep.lock:
            cb = self._sends.pop(int(ev.id), None)
        err = None
        if ev.kind == lib.PDF_EV_SEND_FAILED:
            err = FabricError(ev.code, f"send {int(ev.id)} to fi_addr {int(ev.aux)}")
            logger.info("%s", err)
        if cb is not None:
            cb(err)


class ControlProtocol:
    """Handles the control messages that arrive (progress thread)."""

    def __init__(self, ep: Endpoint, peers: PeerTable, regions: RegionTable, on_message: OnMessage | None) -> None:
        self._ep = ep
        self._peers = peers
        self._regions = regions
        self._on_message = on_message
        self.rejected: Counter[str] = Counter()  # messages dropped, by reason (progress thread writes)
        if not ep.source_addr:
            logger.log(logging.INFO if ep.provider == "shm" else logging.WARNING,
                       "provider %s gives no usable source address (FI_SOURCE): control messages are "
                       "attributed to the sender they name", ep.provider)

    def on_recv(self, ev) -> None:
        """PDF_EV_RECV: copy the message out of its receive slot, repost the slot, handle it."""
        h = self._ep.h
        data = bytes(ffi.buffer(lib.pdf_recv_buf(h, ev.id), ev.count))
        lib.pdf_recv_release(h, ev.id)
        self.handle(data, int(ev.aux))

    def _reject(self, reason: str, msg: control.ControlMessage | None, detail: str) -> None:
        self.rejected[reason] += 1
        kind = control.KINDS.get(msg.kind, "?") if msg is not None else "?"
        logger.warning("dropping control message %s: %s", kind, detail)

    def _from_claimed_sender(self, msg: control.ControlMessage, source: int) -> bool:
        """Whether the message comes from the endpoint it claims (see the module docstring);
        rejects (and counts) it if not."""
        if not self._ep.source_addr:
            if self._ep.provider == "shm" and msg.sender.host_id != self._ep.me.host_id:
                self._reject("source_mismatch", msg, f"shm message claiming a sender on another host: {msg.sender!r}")
                return False
            return True
        known = None if source == lib.PDF_ADDR_UNKNOWN else self._peers.peer_at(source)
        claimed = msg.sender
        if known is None:
            if msg.kind in (control.HELLO, control.PING):
                return True   # first contact: answered at the claimed name only
            self._reject("unknown_source", msg, f"from an address not in the AV, claiming {claimed!r}")
            return False
        if known.address != claimed.address:
            self._reject("source_mismatch", msg, f"from {known!r} claiming to be {claimed!r} (another endpoint)")
            return False
        if known.engine_id != claimed.engine_id:
            if msg.kind == control.HELLO:
                self._peers.rebind(source, claimed)
                return True
            self._reject("source_mismatch", msg, f"from {known!r} claiming engine {claimed.engine_id[:8]}")
            return False
        return True

    def handle(self, data: bytes, source: int = lib.PDF_ADDR_UNKNOWN) -> None:
        """Handle one received message; `source` is its sender's AV address (PDF_ADDR_UNKNOWN: none)."""
        try:
            msg = control.decode(data)
        except ValueError as exc:
            self._reject("malformed", None, f"malformed ({len(data)} bytes): {exc}")
            return
        if msg.sender.provider != self._ep.provider:
            self._reject("provider", msg, f"from provider {msg.sender.provider}")
            return
        if not self._from_claimed_sender(msg, source):
            return
        peers = self._peers
        if msg.kind == control.BYE:
            logger.info("peer %r said goodbye", msg.sender)
            peers.on_bye(msg.sender)
            return
        if msg.kind == control.REVOKE:
            peers.on_revoke(msg.sender, msg.value)
            return
        if msg.kind == control.PONG:
            peers.on_pong(msg.value)
            return
        try:
            if msg.kind == control.PING:
                peers.send_control(msg.sender, control.PONG, msg.value)
            elif msg.kind == control.HELLO:
                peers.resolve(msg.sender, hello=False)
                # revocations first: messages arrive in order, so the peer knows
                # them before its connect() returns
                for region_id in self._regions.revoked_here():
                    peers.send_control(msg.sender, control.REVOKE, region_id)
                if msg.value:
                    peers.send_control(msg.sender, control.PONG, msg.value)
            elif msg.kind == control.USER and self._on_message is not None:
                self._on_message(msg.sender, msg.payload)
        except FabricError as exc:
            logger.warning("control message %s from %r not handled: %s", control.KINDS[msg.kind], msg.sender, exc)
