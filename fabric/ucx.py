"""UcxBackend: fabric's TransferBackend over UCX (UCP one-sided puts), issue 32.

For clusters without EFA / verbs, and for the TCP and shared-memory paths many operators already
tune UCX for. Selected like a provider: ``FabricConfig(provider="ucx")`` and ``fabric.open_backend``
(or this class). UCX picks its transports itself (tcp, posix / sysv / cma on one host, rc / ud on
InfiniBand where its libraries have them); ``UCX_TLS`` and every other ``UCX_*`` variable pass
through from the environment. ``config.node`` becomes UCX_NET_DEVICES (the interface holding that
address) unless the environment sets it.

Which UCX: the ``libucx-cu12`` wheel, UCX 1.22 (fabric/_ucx_build.py says why: 2.96 GB/s put
bandwidth on this host's loopback TCP against Debian UCX 1.13's 0.65 GB/s, and it installs with
pip); loaded with ``libucx.load_library()`` before the extension.

How a batch maps to UCP (csrc/pdu_core.h): its entries become ucp_put_nbx calls in C (contiguous
entries merged, none longer than max_write_bytes when that is set), no Python object per entry;
then ucp_ep_flush_nbx on the peer's endpoint, and once that completed (every put is in the
target's memory) one eager active message carrying (tag, units): units = 1 with imm_mode "last",
the batch's entry count with "every". The receiver adds the units to the same ImmCounter, so the
expected-count arithmetic of libfabric's immediate data holds unchanged. on_done runs once the
flush and that message completed: unlike libfabric's tcp, on_done means the data is in the
target's memory.

What differs from the libfabric engine (TransferEngine), precisely:
- No writer naming (ImmCounter.names_writers False, as with rxm and shm).
- imm_mode "every" has no per-entry size limit (there is no 8-bit unit field to fill: the count
  travels as 32 bits).
- One endpoint: ``rails`` holds one, ``open_rail`` refuses (UCX spreads over devices itself),
  ``pin_rail`` pins the progress thread. No write_sync spin on the caller's thread
  (TransferBackend's default write_sync: it waits for the callbacks). No ``close_connection`` or
  ``shut_down_sockets``: a receiver cannot end the writer's UCP endpoint, so ``closes_connections``
  is False and the KV messenger's key rotation (which needs them) is not available over UCX.
- A batch costs one flush round trip before its tag is sent.
- UCP has no target-side revocation of a single key once packed: deregister unmaps the memory
  (ucp_mem_unmap), after which the target refuses a late put where the transport checks keys
  (rc, and tcp's software RMA looks the key up); cma writes by virtual address
  (process_vm_writev), so, as with libfabric's shm, memory may be reused only once its writers
  are gone (wait_peer_gone).
- UCX_TLS=tcp between peers on one host: MODE_NONE too, so tcp's zero-copy put (UCX_PROTO_INFO;
  with MODE_PEER it was software emulation); a dead such peer is found by the peer timeout.

Peer death: every outstanding batch of a dead peer gets on_error, and later writes to it are
refused before posting. Peers on other hosts: their endpoint uses UCP_ERR_HANDLING_MODE_PEER, so
a broken connection (a killed process's TCP connection resets at once) fails the peer in the
next progress round. Peers on this host (same PeerDescriptor.host_id): MODE_NONE, because with
MODE_PEER UCX 1.22 chose software-emulated puts over tcp/lo even between processes of one host
(UCX_PROTO_INFO=y; with MODE_NONE: cma zero-copy; measured here 0.45 against 4.3 GB/s at
256 KiB, bench/results/fabric/ucx-loaded.md); their death is found by the peer timeout below and, in wait_peer_gone,
by their pid. For both: a peer holding batches without completing any for config.peer_timeout_s
fails (checked every 50 ms in C), so on_error comes within peer_timeout_s + 0.1 s of the last
completion.

Blocking waits, each bounded: ``connect`` (its timeout, 5 s) and the first write to a peer (the
same handshake), ``write_sync`` (its timeout; None: until the batch completes or fails, which the
peer timeout bounds), ``wait_peer_gone`` (its timeout), ``close`` (outstanding batches:
config.close_timeout_s; the goodbyes: min(1 s, close_timeout_s); the progress thread's stop: 2 s;
pdu_close's endpoint closes: 1 s). The progress thread sleeps on the worker's event fd when idle
(ucp_worker_arm; at most 100 ms, or config.sleep_max_us while batches are outstanding).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fabric import control, stale, ucx_net
from fabric.backend import FabricStats, OnDone, OnError, PageWrites, TransferBackend, as_offsets
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.errors import FabricError
from fabric.imm import IMM_MAX, ImmCounter
from fabric.liveness import host_id, process_alive, process_start_time
from fabric.memory import MemoryRegion, buffer_address
from fabric.ucx_peers import UcxPeer, UcxPeers

logger = logging.getLogger(__name__)

PROVIDER = "ucx"
_EVENTS = 256             # events per pdu_progress call
_IDLE_SLEEP_US = 100_000  # the longest sleep of an idle progress thread (bounds its stop)
_STOP_TIMEOUT_S = 2.0
_DRAIN_POLL_S = 0.002
_BYE_TIMEOUT_S = 1.0
_RKEY_MAX = 4096          # bytes of a packed remote key
_ADDR_MAX = 65536         # bytes of a worker address
# Bytes of posted, unfinished batches per peer (csrc/pdu_core.h pdu_open): a flush completes only
# after everything posted before it, so this bounds how long one batch waits behind the others.
WINDOW_BYTES = 64 << 20
_UCS_ERR_TIMED_OUT = -20
_UCS_ERR_CANCELED = -16


def load_native():
    """fabric._ucx, after the libucx wheel's libraries are loaded (see the module docstring).

    UCX logs to stdout unless told otherwise, which corrupts a program's own output (a peer's
    goodbye can make it log a flush error): UCX_LOG_FILE=stderr unless the environment sets it,
    before UCX reads its global options (when libucs loads)."""
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    try:
        import libucx
    except ImportError:   # a system UCX (Debian libucx0): the loader finds it
        pass
    else:
        libucx.load_library()
    from fabric._ucx import ffi, lib

    return ffi, lib


@dataclass(eq=False)
class _Batch:
    on_done: OnDone
    on_error: OnError
    region: MemoryRegion
    dst: RemoteDescriptor
    n: int


def _errno_of(status: int) -> int:
    return {_UCS_ERR_TIMED_OUT: errno.ETIMEDOUT, _UCS_ERR_CANCELED: errno.ECANCELED}.get(status, errno.ECONNRESET)


class UcxBackend(TransferBackend):
    """UCX implementation of TransferBackend (module docstring; fabric.backend's rules)."""

    def __init__(self, config: FabricConfig | None = None, *,
                 on_message: Callable[[PeerDescriptor, bytes], None] | None = None) -> None:
        self.config = config = config or FabricConfig(provider=PROVIDER)
        if config.resolved_provider() != PROVIDER:
            raise ValueError(f"provider={config.resolved_provider()!r}: UcxBackend needs provider 'ucx'")
        self._ffi, self._lib = ffi, lib = load_native()
        self.provider = PROVIDER
        self.domain = PROVIDER          # one endpoint; UCX picks its devices (TransferEngine.domain's place)
        self.delivery_complete = True   # on_done follows the flush: the data is in the target's memory
        self.engine_id = uuid.uuid4().hex
        devices = ucx_net.net_devices(config.node)
        out = ffi.new("pdu_ctx **")
        errbuf = ffi.new("char[]", 512)
        rc = lib.pdu_open(devices.encode(), int(config.peer_timeout_s * 1e6), WINDOW_BYTES, out, errbuf, 512)
        if rc < 0:
            raise FabricError(errno.ENODEV, f"opening provider 'ucx' (UCX_NET_DEVICES={devices or 'any'}): "
                                            f"{ffi.string(errbuf).decode()}")
        self._h = out[0]
        self.transports = ffi.string(lib.pdu_transports(self._h)).decode()
        addr = ffi.new("uint8_t[]", _ADDR_MAX)
        alen = ffi.new("size_t *")
        if lib.pdu_address(self._h, addr, _ADDR_MAX, alen) != 0:
            lib.pdu_close(self._h)
            raise FabricError(errno.EINVAL, "ucp_worker_get_address failed")
        pid = os.getpid()
        self._me = PeerDescriptor(PROVIDER, bytes(ffi.buffer(addr, alen[0])), self.engine_id, host_id(), pid,
                                  process_start_time(pid))
        self._imm = ImmCounter(names_writers=False)
        self._lock = threading.Lock()   # batches, regions, stats
        self._ids = itertools.count(1)
        self._batches: dict[int, _Batch] = {}
        self._regions: dict[int, MemoryRegion] = {}
        self._revoked: list[int] = []
        self._rkeys: dict[tuple[int, str, int], int] = {}   # (peer index, engine, region) -> pdu rkey
        self._stats = [0, 0, 0, 0]
        self._peers = UcxPeers(ffi, lib, self._h, self._me, self._revoked_ids, on_message)
        self.closed = False
        self._closing = False
        self._stop = False
        self.generation = 0
        self._pinned: tuple[int, ...] = ()
        self._thread = threading.Thread(target=self._run, name=f"ucx-progress-{self.engine_id[:8]}", daemon=True)
        self._thread.start()
        logger.info("ucx backend %s: %s, net devices %s", self.engine_id[:8], self.transports, devices or "any")

    # ------------------------------------------------------------ properties

    @property
    def peer_descriptor(self) -> PeerDescriptor:
        return self._me

    @property
    def imm_counter(self) -> ImmCounter:
        return self._imm

    def stats(self) -> FabricStats:
        """Counts of what ``write`` accepted and posted (writes: puts after merging and splitting)."""
        with self._lock:
            return FabricStats(*self._stats)

    @property
    def writes_ordered(self) -> bool:
        """False: UCP orders no put after another; each batch's tag follows its own data only
        (the flush before its message)."""
        return False

    @property
    def closes_connections(self) -> bool:
        """False: no ``close_connection`` (a receiver cannot end the writer's UCP endpoint)."""
        return False

    @property
    def rails(self) -> tuple:
        """One endpoint (fabric.engine.RailInfo), as a TransferEngine with one NIC domain."""
        from fabric.engine import RailInfo

        return (RailInfo(0, PROVIDER, self.config.node, self._me, self._pinned),)

    def rail_for(self, domain: str | None) -> int | None:
        """0 for ``domain`` None or "ucx" (UCX picks its devices itself), else None."""
        return 0 if domain in (None, PROVIDER) else None

    def open_rail(self, domain: str) -> int:
        """Refused: UCX spreads over devices itself (UCX_NET_DEVICES, UCX_MAX_RNDV_RAILS)."""
        raise ValueError(f"open_rail({domain!r}): provider 'ucx' has one endpoint; UCX picks its devices itself")

    def pin_rail(self, rail: int, cpus: tuple[int, ...]) -> None:
        """Run the progress thread on ``cpus`` (those the process may use; none left: unchanged)."""
        if rail != 0:
            raise ValueError(f"rail={rail!r}: this backend has rail 0 only")
        allowed = tuple(c for c in cpus if c in os.sched_getaffinity(0))
        tid = self._thread.native_id
        if allowed and tid is not None:
            os.sched_setaffinity(tid, allowed)
            self._pinned = allowed

    def progress_mark(self) -> int:
        """The progress thread's round now, after waking it (for ``progressed``)."""
        self._lib.pdu_signal(self._h)
        return self.generation

    def progressed(self, mark: int, rounds: int = 2) -> bool:
        """True once the progress thread ran ``rounds`` rounds since ``mark`` (or has stopped)."""
        if not self._thread.is_alive() or self.generation >= mark + rounds:
            return True
        self._lib.pdu_signal(self._h)
        return False

    def outstanding(self, *, with_sends: bool = True) -> int:
        """Batches and (with_sends) control messages not finished yet."""
        return int(self._lib.pdu_outstanding(self._h, int(with_sends)))

    def _check_open(self) -> None:
        if self.closed or self._closing:
            raise FabricError(errno.ESHUTDOWN, f"ucx backend {self.engine_id[:8]} is closed")

    def _on_progress_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ------------------------------------------------------------ memory

    def register(self, buffer: object | None = None, *, address: int | None = None,
                 length: int | None = None, rail: int = 0) -> MemoryRegion:
        """ucp_mem_map ``buffer`` (writable buffer protocol) or raw ``address`` / ``length``; the
        descriptor carries the packed remote key (RemoteDescriptor.rkey). ``rail``: 0 only."""
        self._check_open()
        if rail != 0:
            raise ValueError(f"rail={rail!r}: this backend has rail 0 only")
        keep = None
        if buffer is not None:
            if address is not None or length is not None:
                raise ValueError("register: pass a buffer or address/length, not both")
            address, length, keep = buffer_address(buffer)
        if not isinstance(address, int) or not isinstance(length, int) or address <= 0 or length <= 0:
            raise ValueError(f"register: address={address!r} length={length!r}: expected positive ints")
        rkey = self._ffi.new("uint8_t[]", _RKEY_MAX)
        rlen = self._ffi.new("size_t *")
        index = self._lib.pdu_mem_map(self._h, address, length, rkey, _RKEY_MAX, rlen)
        if index < 0:
            raise FabricError(errno.ENOMEM, f"ucp_mem_map of {length} bytes: {self._peers._err(index)}")
        region_id = next(self._ids)
        desc = RemoteDescriptor(self._me, region_id, address, 0, length, rkey=bytes(self._ffi.buffer(rkey, rlen[0])))
        region = MemoryRegion(self.engine_id, region_id, address, length, 0, desc, _desc=index, _mr=index,
                              _keepalive=keep)
        with self._lock:
            self._regions[region_id] = region
        return region

    def deregister(self, region: MemoryRegion) -> None:
        """Unmap the region and tell every peer that knows us that its descriptor is stale."""
        self._check_region(region, "deregister")
        with self._lock:
            if region.inflight:
                raise FabricError(errno.EBUSY, f"deregister: region {region.region_id} has {region.inflight} "
                                               f"batches in flight")
            region.closed = True
            self._regions.pop(region.region_id, None)
            self._revoked.append(region.region_id)
        stale.mark_region_revoked(self.engine_id, region.region_id)
        self._lib.pdu_mem_unmap(self._h, region._desc)
        region._keepalive = None
        for p in self._peers.known_peers():
            try:
                self._peers.send_control(p, control.REVOKE, region.region_id)
            except FabricError as exc:
                logger.info("revocation to %r not sent: %s", p.desc, exc)

    def _revoked_ids(self) -> list[int]:
        with self._lock:
            return list(self._revoked)

    def _check_region(self, region: MemoryRegion, what: str) -> None:
        if not isinstance(region, MemoryRegion):
            raise TypeError(f"{what}: expected a MemoryRegion, got {type(region).__name__}")
        if region.engine_id != self.engine_id:
            raise FabricError(errno.EINVAL, f"{what}: region {region.region_id} belongs to engine "
                                            f"{region.engine_id[:8]}, not to {self.engine_id[:8]}")
        if region.closed:
            raise FabricError(errno.EINVAL, f"{what}: region {region.region_id} was deregistered")

    # ------------------------------------------------------------ peers

    def connect(self, peer: PeerDescriptor, timeout: float = 5.0) -> None:
        """An endpoint to ``peer`` and its handshake (fabric.ucx_peers), within ``timeout``."""
        self._check_open()
        p = self._peers.connect(peer, timeout)
        if p.failed:
            raise FabricError(errno.EHOSTUNREACH, f"connect: peer {peer!r} failed")

    def disconnect(self, peer: PeerDescriptor) -> None:
        """Fail ``peer``'s outstanding batches (on_error) and close its endpoint (UCP force close:
        what it still queued is dropped, so nothing more is read from our buffers for it)."""
        p = self._peers.find(peer.engine_id)
        if p is not None:
            self._peers.fail(p, _UCS_ERR_CANCELED)

    def peer_gone(self, peer: PeerDescriptor) -> bool:
        """True if ``peer`` said goodbye, its endpoint failed at the transport, or (same host) its
        process ended. Never blocks."""
        p = self._peers.find(peer.engine_id)
        if p is not None and (p.gone or (p.failed and p.failed != _UCS_ERR_TIMED_OUT)):
            return True
        return peer.host_id == host_id() and not process_alive(peer.pid, peer.start_time)

    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """True once ``peer`` said goodbye, its endpoint failed at the transport, or (same host)
        its process ended; then two progress rounds drain what it had sent. False at ``timeout``."""
        deadline = time.monotonic() + timeout
        if not self._peers.probe_until(peer, deadline, lambda p: self.peer_gone(peer)):
            return False
        start = self.generation
        self._lib.pdu_signal(self._h)
        while self.generation < start + 2 and self._thread.is_alive() and time.monotonic() < deadline + 1.0:
            time.sleep(0.001)
        return True

    # ------------------------------------------------------------ writes

    def write(self, writes: PageWrites, on_done: OnDone, on_error: OnError) -> int:
        """Post ``writes`` (fabric.backend.PageWrites; module docstring for how). Validated before
        anything is posted: ValueError for bad values, FabricError for bad or stale handles."""
        if not callable(on_done) or not callable(on_error):
            raise TypeError("write: on_done and on_error must be callable")
        self._check_open()
        if not isinstance(writes, PageWrites):
            raise TypeError(f"write: expected a PageWrites, got {type(writes).__name__}")
        src_region, dst, imm = writes.src_region, writes.dst, writes.imm
        self._check_region(src_region, "write")
        if not isinstance(dst, RemoteDescriptor):
            raise TypeError(f"write: expected a RemoteDescriptor, got {type(dst).__name__}")
        if dst.peer.provider != PROVIDER or not dst.rkey:
            raise FabricError(errno.EINVAL, f"write: {dst!r} is on provider {dst.peer.provider!r}, not 'ucx'")
        src, dsto, lens = (as_offsets(v, name) for v, name in ((writes.src_offsets, "src_offsets"),
                                                               (writes.dst_offsets, "dst_offsets"),
                                                               (writes.lengths, "lengths")))
        n = src.size
        if n == 0:
            raise ValueError("write: empty batch (no offsets)")
        if dsto.size != n or lens.size != n:
            raise ValueError(f"write: lengths differ: src_offsets={n}, dst_offsets={dsto.size}, lengths={lens.size}")
        mode = writes.imm_mode or self.config.imm_mode
        if mode not in ("last", "every"):
            raise ValueError(f"imm_mode={mode!r}: expected one of ('last', 'every')")
        if imm is not None and (type(imm) is not int or not 0 <= imm <= IMM_MAX):
            raise ValueError(f"imm={imm!r}: expected None or an int in 0..{IMM_MAX}")
        check_offsets(src, dsto, lens, src_region.length, dst.length)
        p = self._peer_for_write(dst)
        rkey = self._rkey(p, dst)
        batch_id = self._open_batch(writes, n, on_done, on_error)
        ffi = self._ffi
        units = 1 if mode == "last" else n
        puts = self._lib.pdu_submit(
            self._h, batch_id, p.index, src_region._desc, src_region.address, rkey, dst.base,
            *(ffi.from_buffer("uint64_t[]", a) for a in (src, dsto, lens)), n, int(imm is not None), imm or 0,
            units, self.config.max_write_bytes, int(self.config.coalesce))
        if puts < 0:
            self._drop_batch(batch_id)
            raise FabricError(errno.EHOSTUNREACH if puts == self._lib.PDU_ERR_PEER_FAILED else errno.EINVAL,
                              f"write batch of {n} entries to {dst!r}: {self._peers._err(int(puts))}")
        self._count(n, int(puts), int(lens.sum()))
        return batch_id

    def _peer_for_write(self, dst: RemoteDescriptor) -> UcxPeer:
        eid = dst.peer.engine_id
        if stale.engine_closed(eid) or self._peers.is_gone(eid):
            raise FabricError(errno.ENOENT, f"write: stale {dst!r}: its engine {eid[:8]} is closed")
        p = self._peers.find(eid)
        if p is None or not p.handshaken:
            p = self._peers.connect(dst.peer, 5.0)
        if p.failed:
            raise FabricError(errno.EHOSTUNREACH, f"write: peer {dst.peer!r} has failed")
        if stale.region_revoked(eid, dst.region_id) or dst.region_id in p.revoked:
            raise FabricError(errno.ENOENT, f"write: stale {dst!r}: region {dst.region_id} was deregistered")
        return p

    def _rkey(self, p: UcxPeer, dst: RemoteDescriptor) -> int:
        key = (p.index, dst.peer.engine_id, dst.region_id)
        with self._lock:
            got = self._rkeys.get(key)
        if got is not None:
            return got
        rk = bytes(dst.rkey)
        index = self._lib.pdu_rkey_unpack(self._h, p.index, rk, len(rk))
        if index < 0:
            raise FabricError(errno.EINVAL, f"write: the remote key of {dst!r}: {self._peers._err(index)}")
        with self._lock:
            return self._rkeys.setdefault(key, index)

    def _open_batch(self, writes: PageWrites, n: int, on_done: OnDone, on_error: OnError) -> int:
        with self._lock:
            batch_id = next(self._ids)
            self._batches[batch_id] = _Batch(on_done, on_error, writes.src_region, writes.dst, n)
            writes.src_region.inflight += 1
        return batch_id

    def _drop_batch(self, batch_id: int) -> _Batch | None:
        with self._lock:
            rec = self._batches.pop(batch_id, None)
            if rec is not None:
                rec.region.inflight -= 1
        return rec

    def _count(self, n: int, puts: int, total: int) -> None:
        with self._lock:
            st = self._stats
            st[0] += 1
            st[1] += n
            st[2] += puts
            st[3] += total

    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        """Send ``payload`` to ``peer``'s on_message handler (best effort, one eager message)."""
        self._check_open()
        if stale.engine_closed(peer.engine_id) or self._peers.is_gone(peer.engine_id):
            raise FabricError(errno.ENOENT, f"send: {peer!r} is closed")
        p = self._peers.find(peer.engine_id) or self._peers.peer(peer)
        self._peers.send_control(p, control.USER, 0, bytes(payload))

    # ------------------------------------------------------------ progress thread

    def _run(self) -> None:
        ffi, lib, h = self._ffi, self._lib, self._h
        evs = ffi.new("pdu_event[]", _EVENTS)
        cfg = self.config
        spin = 1 << 40 if cfg.busy_poll else cfg.spin_us
        busy_spin = max(spin, cfg.busy_spin_us)
        while not self._stop:
            n = lib.pdu_progress(h, evs, _EVENTS, spin, busy_spin, _IDLE_SLEEP_US, cfg.sleep_max_us)
            for i in range(n):
                try:
                    self._dispatch(evs[i])
                except Exception:  # a user callback raised: report it, keep progressing
                    logger.exception("ucx callback for event kind %d id %d raised", evs[i].kind, int(evs[i].id))
            self.generation += 1

    def _dispatch(self, ev) -> None:
        lib, kind = self._lib, ev.kind
        if kind == lib.PDU_EV_IMM:
            self._imm.on_landed(int(ev.id), int(ev.count), None)
        elif kind == lib.PDU_EV_BATCH_DONE:
            rec = self._drop_batch(int(ev.id))
            if rec is not None:
                rec.on_done()
        elif kind == lib.PDU_EV_BATCH_FAILED:
            rec = self._drop_batch(int(ev.id))
            if rec is not None:
                rec.on_error(FabricError(_errno_of(ev.code), f"write batch {int(ev.id)} of {rec.n} entries to "
                                                             f"{rec.dst!r}: {self._peers._err(ev.code)}"))
        elif kind == lib.PDU_EV_MSG:
            data = bytes(self._ffi.buffer(ev.data, ev.count))
            lib.pdu_free_data(ev.data)
            self._peers.on_message(data)
        elif kind == lib.PDU_EV_PEER_FAILED:
            self._peers.on_peer_failed(int(ev.id), int(ev.code))
        elif kind == lib.PDU_EV_SEND_FAILED:
            logger.info("ucx control message to peer %d failed: %s", int(ev.id), self._peers._err(ev.code))

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Drain for up to close_timeout_s, say goodbye, fail the rest, release everything."""
        if self.closed or self._closing:
            return
        if self._on_progress_thread():
            raise RuntimeError("UcxBackend.close() called from a fabric callback")
        self._closing = True
        deadline = time.monotonic() + self.config.close_timeout_s
        # batches only: a message to a peer that went away silently (shared memory) never completes
        while self.outstanding(with_sends=False) and time.monotonic() < deadline:
            time.sleep(_DRAIN_POLL_S)
        for p in self._peers.known_peers():
            try:
                self._peers.send_control(p, control.BYE, 0)
            except FabricError as exc:
                logger.info("goodbye to %r not sent: %s", p.desc, exc)
        bye_deadline = time.monotonic() + min(_BYE_TIMEOUT_S, self.config.close_timeout_s)
        while self.outstanding() and time.monotonic() < bye_deadline:
            time.sleep(_DRAIN_POLL_S)
        self._stop = True
        self._lib.pdu_signal(self._h)
        self._thread.join(_STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("ucx progress thread of %s did not stop within %.0fs; the worker stays open",
                         self.engine_id[:8], _STOP_TIMEOUT_S)
            return
        stale.mark_engine_closed(self.engine_id)
        self._lib.pdu_close(self._h)   # unmaps what is still mapped
        self.closed = True
        with self._lock:
            left = list(self._batches.items())
            self._batches.clear()
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:   # as the libfabric engine does: the buffers are the owner's again
            region.closed = True
            region._keepalive = None
        for batch_id, rec in left:
            rec.region.inflight -= 1
            rec.on_error(FabricError(errno.ECANCELED, f"write batch {batch_id} to {rec.dst!r}: backend closed"))
        logger.info("ucx backend %s closed", self.engine_id[:8])

    def __enter__(self) -> "UcxBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"UcxBackend({self.transports}, engine={self.engine_id[:8]})"


def check_offsets(src: np.ndarray, dsto: np.ndarray, lens: np.ndarray, src_len: int, dst_len: int) -> None:
    """Raise ValueError naming the first entry that is empty or leaves its region (vectorized)."""
    bad = np.flatnonzero(lens == 0)
    if bad.size:
        raise ValueError(f"lengths[{int(bad[0])}]=0: expected >= 1")
    for name, offs, size, which in (("src_offsets", src, src_len, "source"), ("dst_offsets", dsto, dst_len,
                                                                             "destination")):
        over = np.flatnonzero((lens > size) | (offs > size - np.minimum(lens, size)))
        if over.size:
            i = int(over[0])
            off, length = int(offs[i]), int(lens[i])
            raise ValueError(f"{name}[{i}]={off} + lengths[{i}]={length} = {off + length} exceeds {which} "
                             f"region of {size} bytes")


__all__ = ["PROVIDER", "WINDOW_BYTES", "UcxBackend", "check_offsets", "load_native"]
