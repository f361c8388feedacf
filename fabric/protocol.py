"""The control protocol between engines: posting control messages and handling those that arrive.

Messages (wire format in fabric.control): HELLO introduces an engine (first contact, and
``connect``'s handshake, answered with PONG after the REVOKEs of the regions this engine
deregistered, so the peer knows them before its connect returns); BYE says an engine closes
(its peer fails what is queued to it and treats it as gone); REVOKE names a deregistered
region; PING / PONG are liveness probes (fabric.peers); USER carries a caller's payload to the
``on_message(peer, payload)`` handler. Messages to one peer arrive in the order sent
(FI_ORDER_SAS, csrc/pdf_core.c).

ControlChannel posts one encoded message to a resolved peer address and reports its
completion; ControlProtocol handles what arrives. Which peers may be sent to, and their
addresses, is the peer table's business (fabric.peers.PeerTable.send_control).

Threads: ``post`` runs on any thread and never waits (the send is queued to the native side);
``on_recv`` and the send-completion callbacks run on the progress thread and never block.
"""

from __future__ import annotations

import logging
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

    def on_recv(self, ev) -> None:
        """PDF_EV_RECV: copy the message out of its receive slot, repost the slot, handle it."""
        h = self._ep.h
        data = bytes(ffi.buffer(lib.pdf_recv_buf(h, ev.id), ev.count))
        lib.pdf_recv_release(h, ev.id)
        self.handle(data)

    def handle(self, data: bytes) -> None:
        try:
            msg = control.decode(data)
        except ValueError as exc:
            logger.warning("dropping malformed control message (%d bytes): %s", len(data), exc)
            return
        if msg.sender.provider != self._ep.provider:
            logger.warning("dropping control message from provider %s", msg.sender.provider)
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
