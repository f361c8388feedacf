"""UcxPeers: the peers of a UcxBackend, their endpoints, and the control protocol between
UCX backends (fabric.control's wire format, carried by pdu_core's PDU_AM_CTRL messages).

A peer is known by its engine id. The first ``connect`` (or the first write) to a peer creates a
UCP endpoint from its worker address (PeerDescriptor.address) and says HELLO; the receiver makes
an endpoint back to the sender and answers PONG with the ids of every region it has revoked, so a
writer knows a stale descriptor before its first write (as fabric.peers does for libfabric).
REVOKE (a region deregistered), BYE (the engine closed), PING / PONG (liveness: the peer answers
while its worker runs) and USER (``send``) complete the set.

A peer fails when its endpoint reports an error (UCP_ERR_HANDLING_MODE_PEER: the connection
broke, e.g. the process died) or when it held batches without completing any for
config.peer_timeout_s (pdu_core check_peers); its batches get on_error then and a later write is
refused. ``disconnect`` fails it on purpose. ``connect`` after a failure makes a new endpoint.

Threads: any thread for the public methods; ``on_message`` / ``on_peer_failed`` on the
progress thread. One lock (``lock``) guards the table, never held while waiting.
Blocking waits: ``connect`` waits at most its ``timeout`` for the PONG.
"""

from __future__ import annotations

import errno
import itertools
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from fabric import control
from fabric.descriptors import PeerDescriptor
from fabric.errors import FabricError

logger = logging.getLogger(__name__)

_PING_EVERY_S = 0.25   # wait_peer_gone: how often it probes a peer that has not said goodbye


@dataclass
class UcxPeer:
    """One remote engine as this backend knows it."""

    desc: PeerDescriptor
    index: int                                   # pdu_core's peer index (its endpoint)
    handshaken: bool = False                     # it answered our HELLO or PING
    known: bool = False                          # it said HELLO to us: it gets our REVOKEs and BYE
    failed: int = 0                              # the ucs status it failed with (0: alive)
    gone: bool = False                           # it said BYE
    revoked: set[int] = field(default_factory=set)
    answered: threading.Event = field(default_factory=threading.Event)


class UcxPeers:
    """The peer table and control protocol of one UcxBackend (module docstring)."""

    def __init__(self, ffi, lib, handle, me: PeerDescriptor, revoked_here: Callable[[], list[int]],
                 on_message: Callable[[PeerDescriptor, bytes], None] | None) -> None:
        self._ffi, self._lib, self._h = ffi, lib, handle
        self._me = me
        self._revoked_here = revoked_here
        self._on_message = on_message
        self.lock = threading.Lock()
        self._by_engine: dict[str, UcxPeer] = {}
        self._by_index: dict[int, UcxPeer] = {}
        self._nonces = itertools.count(1)

    # ------------------------------------------------------------ table

    def peer(self, desc: PeerDescriptor, *, fresh_if_failed: bool = False) -> UcxPeer:
        """The peer of ``desc``'s engine, with an endpoint (created now if it has none)."""
        if not isinstance(desc, PeerDescriptor):
            raise TypeError(f"expected a PeerDescriptor, got {type(desc).__name__}")
        if desc.provider != "ucx":
            raise FabricError(errno.EINVAL, f"{desc!r} is on provider {desc.provider!r}, not 'ucx'")
        with self.lock:
            p = self._by_engine.get(desc.engine_id)
            if p is not None and not (p.failed and fresh_if_failed):
                return p
            addr = bytes(desc.address)
            # same host: UCP_ERR_HANDLING_MODE_NONE, so UCX may take shared memory (csrc/pdu_core.h)
            index = self._lib.pdu_connect(self._h, addr, len(addr), int(desc.host_id != self._me.host_id))
            if index < 0:
                raise FabricError(errno.EHOSTUNREACH, f"ucp_ep_create to {desc!r}: {self._err(index)}")
            fresh = UcxPeer(desc, index)
            if p is not None:   # a reset after failure keeps what it told us
                fresh.revoked, fresh.gone = p.revoked, p.gone
            self._by_engine[desc.engine_id] = fresh
            self._by_index[index] = fresh
            return fresh

    def find(self, engine_id: str) -> UcxPeer | None:
        with self.lock:
            return self._by_engine.get(engine_id)

    def known_peers(self) -> list[UcxPeer]:
        with self.lock:
            return [p for p in self._by_engine.values() if (p.known or p.handshaken) and not p.failed]

    def is_gone(self, engine_id: str) -> bool:
        p = self.find(engine_id)
        return p is not None and p.gone

    def is_revoked(self, engine_id: str, region_id: int) -> bool:
        p = self.find(engine_id)
        return p is not None and region_id in p.revoked

    def _err(self, status: int) -> str:
        return self._ffi.string(self._lib.pdu_strerror(status)).decode()

    # ------------------------------------------------------------ sending

    def send_control(self, p: UcxPeer, kind: int, value: int, payload: bytes = b"") -> None:
        msg = control.encode(kind, value, self._me, payload)
        rc = self._lib.pdu_send(self._h, p.index, msg, len(msg))
        if rc < 0:
            raise FabricError(errno.ECONNRESET, f"control message {control.KINDS[kind]} to {p.desc!r}: "
                                                f"{self._err(rc)}")

    def connect(self, desc: PeerDescriptor, timeout: float) -> UcxPeer:
        """An endpoint to ``desc`` and its PONG (module docstring), within ``timeout`` seconds."""
        p = self.peer(desc, fresh_if_failed=True)
        if p.handshaken:
            return p
        p.answered.clear()
        self.send_control(p, control.HELLO, next(self._nonces))
        if not p.answered.wait(timeout):
            raise FabricError(errno.ETIMEDOUT, f"connect to {desc!r}: no answer within {timeout}s")
        return p

    def ping(self, p: UcxPeer) -> None:
        self.send_control(p, control.PING, next(self._nonces))

    def fail(self, p: UcxPeer, status: int) -> None:
        """Fail the peer's batches now and close its endpoint (pdu_peer_fail)."""
        self._lib.pdu_peer_fail(self._h, p.index, status)

    # ------------------------------------------------------------ events (progress thread)

    def on_peer_failed(self, index: int, status: int) -> None:
        with self.lock:
            p = self._by_index.get(index)
            if p is not None:
                p.failed = status or -1
        if p is not None:
            logger.info("ucx peer %r failed: %s", p.desc, self._err(status))
            p.answered.set()   # a waiting connect sees the failure

    def on_message(self, data: bytes) -> None:
        try:
            msg = control.decode(data)
        except ValueError as exc:
            logger.warning("ucx control message dropped: %s", exc)
            return
        sender = msg.sender
        if sender.provider != "ucx":
            logger.warning("ucx control message from provider %r dropped", sender.provider)
            return
        kind = msg.kind
        if kind in (control.HELLO, control.PING):
            p = self.peer(sender, fresh_if_failed=True)
            p.known = p.known or kind == control.HELLO
            ids = self._revoked_here()
            self.send_control(p, control.PONG, msg.value, struct.pack(f"<{len(ids)}Q", *ids))
            return
        p = self.find(sender.engine_id)
        if kind == control.USER:
            if self._on_message is not None:
                self._on_message(sender, msg.payload)
            return
        if p is None:
            logger.info("ucx %s from unknown engine %s dropped", control.KINDS[kind], sender.engine_id[:8])
            return
        if kind == control.PONG:
            n = len(msg.payload) // 8
            p.revoked.update(struct.unpack(f"<{n}Q", msg.payload[: 8 * n]))
            p.handshaken = True
            p.answered.set()
        elif kind == control.REVOKE:
            p.revoked.add(msg.value)
        elif kind == control.BYE:
            p.gone = True
            p.answered.set()

    def probe_until(self, desc: PeerDescriptor, deadline: float, gone: Callable[[UcxPeer], bool]) -> bool:
        """Ping ``desc`` every _PING_EVERY_S until ``gone(peer)`` or ``deadline`` (monotonic)."""
        p = self.peer(desc)
        next_ping = 0.0
        while True:
            p = self.find(desc.engine_id) or p
            if gone(p):
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if now >= next_ping and not p.failed:
                next_ping = now + _PING_EVERY_S
                try:
                    self.ping(p)
                except FabricError as exc:
                    logger.info("ping to %r not sent: %s", desc, exc)
            time.sleep(min(0.01, max(0.0, deadline - now)))
