"""TransferEngine: one-sided writes over a libfabric FI_EP_RDM endpoint.

The native half (csrc/pdf_core.c, inside the cffi extension
``fabric._libfabric``) owns the endpoint and does all posting and polling;
this module validates requests, keeps the Python-side bookkeeping (callbacks
per batch, peers, regions) and runs the progress thread that dispatches
events. Primitives: register/deregister, connect/disconnect, write_pages,
write_pages_sync, send, wait_peer_gone, close; plus the receiver's
ImmCounter and stats().

Two ways to learn that writes completed: write_pages (batches, callbacks on
the progress thread: the KV messenger's path, for throughput) and
write_pages_sync (one batch, the calling thread polls the completion queue
itself for up to config.sync_spin_us with the GIL released, then sleeps
while the progress thread finishes: for lone latency-bound writes, it saves
the two thread wake-ups of progress thread -> callback -> waiter).

Progress: the thread spins briefly after activity, then sleeps until work
arrives, on the CQ's wait fd (tcp, verbs) or, for shm, on a doorbell: a small
shared-memory word per engine (/dev/shm/pdserve-bell-<pid>-<engine>) that
peers on this host ring after posting to it (csrc/pdf_wait.h). An idle
engine therefore costs no CPU and still answers in microseconds.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from fabric import control, shmclean
from fabric._libfabric import ffi, lib
from fabric.backend import OnDone, OnError, SyncResult, TransferBackend
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor, RemoteDescriptor
from fabric.errors import FabricError
from fabric.imm import IMM_MAX, ImmCounter
from fabric.liveness import host_id, process_alive, process_start_time
from fabric.memory import MemoryRegion, buffer_address

logger = logging.getLogger(__name__)

# Nagle on the tcp provider's sockets delays the small messages rxm answers
# with (acknowledgements, completions): measured on loopback, a lone 64 KiB
# write took ~550 us with it and ~150 us without, and bandwidth at 64 KiB
# doubled. libfabric reads this when it first initializes its providers, so
# it is set before any engine opens (an explicit setting wins).
os.environ.setdefault("FI_TCP_NODELAY", "1")

_EVENT_CAP = 1024
_PROGRESS_SLICE_US = 100_000
_IMM_MODES = {"last": lib.PDF_IMM_LAST, "every": lib.PDF_IMM_EVERY}
_WAIT_MODES = {lib.PDF_WAIT_SLEEP: "sleep", lib.PDF_WAIT_FD: "fd", lib.PDF_WAIT_BELL: "bell"}
_SHORT = 64  # offsets lists up to this long take _as_offsets' direct conversion
_MAX_REVOKED_TOLD = 1024  # deregistered regions told to engines that shake hands later

# Process-wide memory of what is stale, so that descriptors of engines and
# regions closed in this process are refused before anything is posted.
_CLOSED_ENGINES: set[str] = set()
_REVOKED_REGIONS: set[tuple[str, int]] = set()
_STALE_LOCK = threading.Lock()


@dataclass
class _Batch:
    on_done: OnDone
    on_error: OnError
    region: MemoryRegion
    dst: RemoteDescriptor
    writes: int


@dataclass
class _Prepared:
    """A validated batch, ready for the native side (engine-internal)."""

    region: MemoryRegion
    dst: RemoteDescriptor
    fi_addr: int
    n: int  # entries
    total: int  # bytes
    imm: int
    imm_flag: int
    src_c: object  # cffi uint64_t[n] views of the arrays below
    dst_c: object
    lens_c: object
    keepalive: tuple  # (src_offsets, dst_offsets, lengths), each np.uint64 [n]


def _detached_done() -> None:
    """A write_pages_sync batch that timed out completed later: nothing to tell anyone."""


def _detached_error(err: FabricError) -> None:
    logger.info("a write_pages_sync batch that had timed out failed later: %s", err)


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


def bell_name(peer: PeerDescriptor) -> str:
    """The shared-memory name of a peer's doorbell (shm engines on one host)."""
    return f"/{shmclean.BELL_PREFIX}{peer.pid}-{peer.engine_id}"


@dataclass
class _Probe:
    event: threading.Event
    alive: bool = False
    failed: bool = False


def _as_offsets(values: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """Validate a 1-D sequence of non-negative ints; return it as contiguous uint64."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint64 and values.ndim == 1:
        return values if values.flags.c_contiguous else np.ascontiguousarray(values)
    if type(values) in (list, tuple) and len(values) <= _SHORT and all(type(v) is int for v in values):
        # short lists of ints (a lone write's [0]): one conversion, ~1 us instead of ~7
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


class TransferEngine(TransferBackend):
    """libfabric implementation of TransferBackend (see its rules).

    One endpoint, one CQ, one progress thread. ``on_message(peer, payload)``
    receives messages sent with ``send`` by other engines.
    """

    def __init__(
        self,
        config: FabricConfig | None = None,
        *,
        on_message: Callable[[PeerDescriptor, bytes], None] | None = None,
    ) -> None:
        self.config = config or FabricConfig()
        provider = self.config.resolved_provider()
        node = self.config.node if provider != "shm" else None
        self.engine_id = uuid.uuid4().hex
        shmclean.sweep()  # files of killed processes: memory, and pid clashes for shm
        me = PeerDescriptor(provider, b"", self.engine_id, host_id(), os.getpid(), process_start_time(os.getpid()))
        out = ffi.new("pdf_engine **")
        errbuf = ffi.new("char[256]")
        rc = lib.pdf_open(
            provider.encode(),
            node.encode() if node else ffi.NULL,
            self.config.tx_depth,
            self.config.control_slots,
            self.config.control_msg_size,
            self.config.spin_us,
            self.config.busy_spin_us,
            self.config.sleep_max_us,
            int(self.config.peer_timeout_s * 1000),
            int(self.config.wants_delivery_complete(provider)),
            int(self.config.busy_poll),
            bell_name(me).encode(),
            out,
            errbuf,
            len(errbuf),
        )
        if rc:
            raise FabricError(rc, f"opening provider {provider!r} (node={node!r}) failed at {ffi.string(errbuf).decode()}")
        self._h = out[0]
        info = ffi.new("pdf_info *")
        rc = lib.pdf_get_info(self._h, info)
        if rc:
            lib.pdf_close(self._h)
            raise FabricError(rc, "fi_getname")
        self.provider: str = ffi.string(info.provider).decode()
        self.domain: str = ffi.string(info.domain).decode()
        self.mr_mode: int = int(info.mr_mode)
        self.tx_credits: int = int(info.tx_credits)
        self.max_msg_size: int = int(info.max_msg_size)
        self.wait_mode: str = _WAIT_MODES.get(int(info.wait_mode), str(int(info.wait_mode)))
        self.delivery_complete: bool = bool(info.delivery_complete)
        self._peer = PeerDescriptor(
            provider=self.provider,
            address=bytes(ffi.buffer(info.addr, info.addrlen)),
            engine_id=self.engine_id,
            host_id=host_id(),
            pid=os.getpid(),
            start_time=process_start_time(os.getpid()),
        )
        self._max_write = self.config.max_write_bytes or min(self.max_msg_size, 1 << 62)
        self._on_message = on_message
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._batches: dict[int, _Batch] = {}
        self._regions: dict[int, MemoryRegion] = {}
        self._fi_addr: dict[bytes, int] = {}
        self._peers: dict[int, PeerDescriptor] = {}
        self._failed: set[int] = set()
        self._gone: set[str] = set()
        self._revoked: set[tuple[str, int]] = set()
        self._revoked_here: OrderedDict[int, None] = OrderedDict()  # our deregistered regions
        self._probes: dict[int, _Probe] = {}
        self._handshaken: set[str] = set()
        self._sends: dict[int, Callable[[FabricError | None], None]] = {}
        self._imm = ImmCounter()
        self._closing = False
        self._closed = False
        self._generation = 0
        self._stats = [0, 0, 0, 0]  # batches, entries, writes, bytes
        self._thread = threading.Thread(
            target=self._run, name=f"fabric-progress-{self.engine_id[:8]}", daemon=True
        )
        self._thread.start()
        logger.info(
            "engine %s: provider=%s domain=%s mr_mode=0x%x tx_credits=%d wait=%s delivery_complete=%s",
            self.engine_id[:8], self.provider, self.domain, self.mr_mode, self.tx_credits,
            self.wait_mode, self.delivery_complete,
        )

    # ------------------------------------------------------------ properties

    @property
    def peer_descriptor(self) -> PeerDescriptor:
        return self._peer

    @property
    def imm_counter(self) -> ImmCounter:
        return self._imm

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closing or self._closed:
            raise FabricError(lib.FI_ESHUTDOWN, f"engine {self.engine_id[:8]} is closed")

    # --------------------------------------------------------------- memory

    def register(
        self, buffer: object | None = None, *, address: int | None = None, length: int | None = None
    ) -> MemoryRegion:
        """Register ``buffer`` (writable buffer protocol) or raw ``address``/``length``.

        Raw registration is for memory the caller keeps alive itself, e.g. a
        torch tensor's ``data_ptr()`` and ``nbytes``.
        """
        self._check_open()
        if buffer is not None:
            if address is not None or length is not None:
                raise ValueError("register: pass either a buffer or address/length, not both")
            addr, nbytes, keepalive = buffer_address(buffer)
        else:
            if not isinstance(address, int) or address <= 0:
                raise ValueError(f"register: address={address!r}: expected a positive int")
            if not isinstance(length, int) or length <= 0:
                raise ValueError(f"register: length={length!r}: expected a positive int")
            addr, nbytes, keepalive = address, length, None
        key = ffi.new("uint64_t *")
        desc = ffi.new("uint64_t *")
        mr = ffi.new("uint64_t *")
        rc = lib.pdf_mr_reg(self._h, addr, nbytes, key, desc, mr)
        if rc:
            raise FabricError(rc, f"fi_mr_reg(address=0x{addr:x}, length={nbytes})")
        region_id = next(self._ids)
        base = addr if self.mr_mode & lib.FI_MR_VIRT_ADDR else 0
        remote = RemoteDescriptor(peer=self._peer, region_id=region_id, base=base, key=int(key[0]), length=nbytes)
        region = MemoryRegion(
            engine_id=self.engine_id, region_id=region_id, address=addr, length=nbytes, key=int(key[0]),
            descriptor=remote, _desc=int(desc[0]), _mr=int(mr[0]), _keepalive=keepalive,
        )
        with self._lock:
            self._regions[region_id] = region
        logger.debug("registered region %d: %d bytes at 0x%x key=%d", region_id, nbytes, addr, region.key)
        return region

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
        self._check_region(region, "deregister")
        with self._lock:
            if region.inflight:
                raise FabricError(
                    lib.FI_EBUSY, f"deregister region {region.region_id}: {region.inflight} write batches in flight"
                )
            region.closed = True
            del self._regions[region.region_id]
        with _STALE_LOCK:
            _REVOKED_REGIONS.add((self.engine_id, region.region_id))
        self._revoked_here[region.region_id] = None
        while len(self._revoked_here) > _MAX_REVOKED_TOLD:
            self._revoked_here.popitem(last=False)
        rc = lib.pdf_mr_close(self._h, region._mr)
        region._keepalive = None
        if rc:
            raise FabricError(rc, f"fi_close(mr of region {region.region_id})")
        for peer in self._known_peers():
            self._send_control(peer, control.REVOKE, region.region_id)

    def _check_region(self, region: MemoryRegion, what: str) -> None:
        if not isinstance(region, MemoryRegion):
            raise TypeError(f"{what}: expected a MemoryRegion, got {type(region).__name__}")
        if region.engine_id != self.engine_id:
            raise FabricError(
                lib.FI_EINVAL,
                f"{what}: region {region.region_id} belongs to engine {region.engine_id[:8]}, "
                f"not {self.engine_id[:8]}",
            )
        if region.closed:
            raise FabricError(lib.FI_ENOENT, f"{what}: region {region.region_id} is deregistered")

    # ---------------------------------------------------------------- peers

    def connect(self, peer: PeerDescriptor, timeout: float = 5.0) -> None:
        """Insert ``peer`` into the AV and shake hands: when this returns, the
        peer knows us (so it can tell us about revoked regions, say goodbye
        and answer probes). A failed peer is reset. write_pages connects on
        first use. Raises FabricError(FI_ETIMEDOUT) if the peer does not
        answer within ``timeout``."""
        self._check_open()
        self._resolve(peer, hello=False, reset=True)
        if peer.engine_id == self.engine_id or peer.engine_id in self._handshaken:
            return
        if threading.current_thread() is self._thread:
            self._send_control(peer, control.HELLO, 0)  # cannot wait for the answer here
            return
        nonce = next(self._ids)
        probe = _Probe(threading.Event())
        with self._lock:
            self._probes[nonce] = probe
        try:
            self._send_control(peer, control.HELLO, nonce, on_result=lambda err: self._probe_sent(nonce, err))
            answered = probe.event.wait(timeout)
        finally:
            with self._lock:
                self._probes.pop(nonce, None)
        if not answered or not probe.alive:
            raise FabricError(lib.FI_ETIMEDOUT, f"connect to {peer!r}: no answer within {timeout}s")
        self._handshaken.add(peer.engine_id)

    def disconnect(self, peer: PeerDescriptor) -> None:
        """Remove ``peer`` from the AV; its outstanding work is failed."""
        with self._lock:
            fi_addr = self._fi_addr.pop(peer.address, None)
            if fi_addr is None:
                return
            self._peers.pop(fi_addr, None)
        self._fail_peer(fi_addr, lib.FI_ECANCELED)
        rc = lib.pdf_av_remove(self._h, fi_addr)
        if rc:
            raise FabricError(rc, f"fi_av_remove({peer!r})")

    def _resolve(self, peer: PeerDescriptor, hello: bool = True, reset: bool = False) -> int:
        if peer.provider != self.provider:
            raise FabricError(
                lib.FI_EINVAL, f"peer {peer!r} uses provider {peer.provider!r}, this engine {self.provider!r}"
            )
        with self._lock:
            fi_addr = self._fi_addr.get(peer.address)
            if fi_addr is not None and not (reset and fi_addr in self._failed):
                return fi_addr  # a failed peer stays failed until connect()
        addr = ffi.new("uint8_t[]", peer.address)
        out = ffi.new("uint64_t *")
        rc = lib.pdf_av_insert(self._h, addr, out)
        if rc:
            raise FabricError(rc, f"fi_av_insert({peer!r})")
        fi_addr = int(out[0])
        with self._lock:
            self._fi_addr[peer.address] = fi_addr
            self._peers[fi_addr] = peer
            self._failed.discard(fi_addr)
        if peer.host_id == self._peer.host_id and peer.engine_id != self.engine_id:
            # same host (and pid namespace): watch its process, ring its doorbell (shm)
            rc = lib.pdf_peer_local(self._h, fi_addr, peer.pid, bell_name(peer).encode())
            if rc:
                logger.info("peer %r: no pidfd or doorbell (%s); it may be judged late", peer,
                            FabricError(rc, "pdf_peer_local"))
        if hello and peer.engine_id != self.engine_id:
            # first contact: introduce ourselves, so the peer can say goodbye
            # to us, revoke regions and answer probes
            self._send_control(peer, control.HELLO, 0)
        return fi_addr

    def _known_peers(self) -> list[PeerDescriptor]:
        """Peers that may still listen (a closed peer must never be sent to:
        shm dereferences the peer's region, which is gone in this process)."""
        with _STALE_LOCK:
            closed = set(_CLOSED_ENGINES)
        with self._lock:
            return [
                p
                for a, p in self._peers.items()
                if a not in self._failed
                and p.engine_id != self.engine_id
                and p.engine_id not in self._gone
                and p.engine_id not in closed
            ]

    def _fail_peer(self, fi_addr: int, code: int) -> None:
        evs = ffi.new("pdf_event[]", _EVENT_CAP)
        n = lib.pdf_fail_peer(self._h, fi_addr, code, evs, _EVENT_CAP)
        for i in range(n):
            self._dispatch(evs[i])

    def peer_gone(self, peer: PeerDescriptor) -> bool:
        """True if ``peer`` said goodbye, or (same host) its process has ended."""
        if peer.engine_id in self._gone:
            return True
        if peer.host_id == self._peer.host_id and not process_alive(peer.pid, peer.start_time):
            return True
        return False

    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """Wait until no write from ``peer`` can land here any more.

        True when ``peer`` closed its engine (goodbye message), its process
        ended (same host), or a probe to it failed at the transport (its
        endpoint no longer exists); then what it had already sent has been
        drained by our progress thread. False when ``timeout`` passes while
        the peer still answers or cannot be judged: its writes may still land,
        so memory it targets must stay reserved (or be deregistered).
        """
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout={timeout!r}: expected seconds >= 0")
        deadline = time.monotonic() + timeout
        while True:
            if self.peer_gone(peer):
                self._quiesce()
                self._gone.add(peer.engine_id)
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            probe = self._probe(peer, min(remaining, 0.5))
            if probe is not None and probe.failed:
                self._quiesce()
                self._gone.add(peer.engine_id)
                return True
            if probe is not None and probe.alive:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _probe(self, peer: PeerDescriptor, timeout: float) -> _Probe | None:
        nonce = next(self._ids)
        probe = _Probe(threading.Event())
        with self._lock:
            self._probes[nonce] = probe
        try:
            self._send_control(peer, control.PING, nonce, on_result=lambda err: self._probe_sent(nonce, err))
        except FabricError as exc:
            logger.info("probe of %r not sent: %s", peer, exc)
            probe.failed = True
            return probe
        probe.event.wait(timeout)
        with self._lock:
            self._probes.pop(nonce, None)
        return probe if probe.event.is_set() else None

    def _probe_sent(self, nonce: int, err: FabricError | None) -> None:
        if err is None:
            return
        with self._lock:
            probe = self._probes.get(nonce)
        if probe is not None:
            probe.failed = True
            probe.event.set()

    def _quiesce(self) -> None:
        """Let the progress thread drain what already arrived (two full passes)."""
        time.sleep(0.05)  # bytes a dead peer left in our socket buffers become readable
        start = self._generation
        deadline = time.monotonic() + 1.0
        while self._generation < start + 2 and time.monotonic() < deadline and self._thread.is_alive():
            if not self._closed:
                lib.pdf_poke(self._h)
            time.sleep(0.001)

    # -------------------------------------------------------------- writes

    def write_pages(
        self,
        src_region: MemoryRegion,
        src_offsets: Sequence[int] | np.ndarray,
        dst: RemoteDescriptor,
        dst_offsets: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
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
        if not callable(on_done) or not callable(on_error):
            raise TypeError("write_pages: on_done and on_error must be callable")
        w = self._prepare("write_pages", src_region, src_offsets, dst, dst_offsets, lengths, imm, imm_mode)
        batch_id = self._open_batch(w, on_done, on_error)
        rc = lib.pdf_submit_writes(
            self._h, batch_id, w.fi_addr, src_region.address, src_region._desc, dst.base, dst.key,
            w.src_c, w.dst_c, w.lens_c, w.n, w.imm, w.imm_flag, self._max_write, int(self.config.coalesce),
        )
        if rc < 0:
            self._drop_batch(batch_id, src_region)
            raise FabricError(int(rc), f"write_pages batch of {w.n} writes to {dst!r}")
        self._count(w, int(rc))
        return batch_id

    def write_pages_sync(
        self,
        src_region: MemoryRegion,
        src_offsets: Sequence[int] | np.ndarray,
        dst: RemoteDescriptor,
        dst_offsets: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
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
        if threading.current_thread() is self._thread:
            raise RuntimeError("write_pages_sync called from a fabric callback (it may wait for that thread)")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout={timeout!r}: expected None or seconds >= 0")
        spin = self.config.sync_spin_us if spin_us is None else spin_us
        if not isinstance(spin, int) or not 0 <= spin <= 1_000_000:
            raise ValueError(f"spin_us={spin!r}: expected an int in 0..1000000")
        w = self._prepare("write_pages_sync", src_region, src_offsets, dst, dst_offsets, lengths, imm, imm_mode)
        batch_id = self._open_batch(w, _detached_done, _detached_error)
        res = ffi.new("pdf_sync_result *")
        rc = lib.pdf_write_sync(
            self._h, batch_id, w.fi_addr, src_region.address, src_region._desc, dst.base, dst.key,
            w.src_c, w.dst_c, w.lens_c, w.n, w.imm, w.imm_flag, self._max_write, int(self.config.coalesce),
            spin, -1 if timeout is None else int(timeout * 1e6), res,
        )
        if rc < 0:
            self._drop_batch(batch_id, src_region)
            raise FabricError(int(rc), f"write_pages_sync batch of {w.n} writes to {dst!r}")
        self._count(w, int(res.writes))
        status = int(res.status)
        if status == lib.PDF_SYNC_TIMEOUT:
            # detached: its outcome comes back as an event (_detached_*), the region stays busy until then
            raise FabricError(lib.FI_ETIMEDOUT, f"write_pages_sync batch {batch_id} to {dst!r}: not completed "
                                                f"within {timeout}s (still in flight)")
        self._drop_batch(batch_id, src_region)
        if status == lib.PDF_SYNC_FAILED:
            raise FabricError(int(res.code), f"write_pages_sync batch {batch_id} to {dst!r}: {int(res.missing)} "
                                             f"of {int(res.writes)} writes not completed")
        return SyncResult(batch_id=batch_id, writes=int(res.writes), spin_us=int(res.spin_ns) / 1000.0,
                          rounds=int(res.rounds), slept=bool(res.slept))

    def _prepare(
        self,
        what: str,
        src_region: MemoryRegion,
        src_offsets: Sequence[int] | np.ndarray,
        dst: RemoteDescriptor,
        dst_offsets: Sequence[int] | np.ndarray,
        lengths: Sequence[int] | np.ndarray,
        imm: int | None,
        imm_mode: str | None,
    ) -> _Prepared:
        """Validate a batch (nothing is posted if anything is wrong) and resolve its peer."""
        self._check_open()
        self._check_region(src_region, what)
        self._check_remote(dst)
        src = _as_offsets(src_offsets, "src_offsets")
        dsto = _as_offsets(dst_offsets, "dst_offsets")
        lens = _as_offsets(lengths, "lengths")
        n = src.size
        if n == 0:
            raise ValueError(f"{what}: empty batch (no offsets)")
        if dsto.size != n or lens.size != n:
            raise ValueError(
                f"{what}: lengths differ: src_offsets={n}, dst_offsets={dsto.size}, lengths={lens.size}"
            )
        mode = imm_mode or self.config.imm_mode
        if mode not in _IMM_MODES:
            raise ValueError(f"imm_mode={mode!r}: expected one of {tuple(_IMM_MODES)}")
        if imm is not None and (not isinstance(imm, int) or not 0 <= imm <= IMM_MAX):
            raise ValueError(f"imm={imm!r}: expected None or an int in 0..{IMM_MAX}")
        src_c = ffi.from_buffer("uint64_t[]", src)
        dst_c = ffi.from_buffer("uint64_t[]", dsto)
        lens_c = ffi.from_buffer("uint64_t[]", lens)
        bad_what = ffi.new("int *")
        total = ffi.new("uint64_t *")
        max_len = self._max_write if mode == "every" else 0
        bad = lib.pdf_check_writes(src_c, dst_c, lens_c, n, src_region.length, dst.length, max_len, bad_what, total)
        if bad >= 0:
            self._refuse(int(bad), int(bad_what[0]), src, dsto, lens, src_region, dst, max_len)
        if dst.peer.engine_id not in self._handshaken:
            self.connect(dst.peer)
            self._check_remote(dst)  # the handshake brings the peer's revocations
        fi_addr = self._resolve(dst.peer)
        imm_flag = lib.PDF_IMM_NONE if imm is None else _IMM_MODES[mode]
        # the numpy arrays ride along: the cffi views borrow their memory
        return _Prepared(src_region, dst, fi_addr, n, int(total[0]), imm or 0, imm_flag,
                         src_c, dst_c, lens_c, (src, dsto, lens))

    def _open_batch(self, w: _Prepared, on_done: OnDone, on_error: OnError) -> int:
        with self._lock:
            if w.fi_addr in self._failed:
                raise FabricError(lib.FI_EHOSTUNREACH, f"write_pages: peer {w.dst.peer!r} has failed")
            batch_id = next(self._ids)
            self._batches[batch_id] = _Batch(on_done, on_error, w.region, w.dst, w.n)
            w.region.inflight += 1
        return batch_id

    def _drop_batch(self, batch_id: int, region: MemoryRegion) -> None:
        with self._lock:
            if self._batches.pop(batch_id, None) is not None:
                region.inflight -= 1

    def _count(self, w: _Prepared, writes: int) -> None:
        with self._lock:
            st = self._stats
            st[0] += 1
            st[1] += w.n
            st[2] += writes
            st[3] += w.total

    @property
    def shm_locks_released(self) -> int:
        """Region locks of dead shm peers the watchdog released (csrc/pdf_shm.h)."""
        return int(lib.pdf_locks_released(self._h)) if not self._closed else 0

    def stats(self) -> FabricStats:
        """Counts of what write_pages accepted and posted since the engine opened."""
        with self._lock:
            return FabricStats(*self._stats)

    def _check_remote(self, dst: RemoteDescriptor) -> None:
        if not isinstance(dst, RemoteDescriptor):
            raise TypeError(f"write_pages: expected a RemoteDescriptor, got {type(dst).__name__}")
        eid = dst.peer.engine_id
        with _STALE_LOCK:
            stale_engine = eid in _CLOSED_ENGINES
            stale_region = (eid, dst.region_id) in _REVOKED_REGIONS
        if stale_engine or eid in self._gone:
            raise FabricError(lib.FI_ENOENT, f"write_pages: stale {dst!r}: its engine {eid[:8]} is closed")
        if stale_region or (eid, dst.region_id) in self._revoked:
            raise FabricError(lib.FI_ENOENT, f"write_pages: stale {dst!r}: region {dst.region_id} was deregistered")
        if dst.peer.provider != self.provider:
            raise FabricError(
                lib.FI_EINVAL, f"write_pages: {dst!r} is on provider {dst.peer.provider!r}, not {self.provider!r}"
            )

    @staticmethod
    def _refuse(i: int, what: int, src: np.ndarray, dsto: np.ndarray, lens: np.ndarray,
                src_region: MemoryRegion, dst: RemoteDescriptor, max_len: int) -> None:
        """Raise the ValueError for entry ``i``, which pdf_check_writes found bad (``what``)."""
        length = int(lens[i])
        if what == lib.PDF_BAD_SHORT:
            raise ValueError(f"lengths[{i}]={length}: expected >= 1")
        if what == lib.PDF_BAD_LONG:
            raise ValueError(f"lengths[{i}]={length}: expected in 1..{max_len} (imm_mode 'every' never splits "
                             f"an entry: its immediate data counts it once)")
        name, offs, size, region = (
            ("src_offsets", src, src_region.length, f"source region {src_region.region_id}")
            if what == lib.PDF_BAD_SRC
            else ("dst_offsets", dsto, dst.length, f"destination region {dst.region_id}")
        )
        off = int(offs[i])
        raise ValueError(f"{name}[{i}]={off} + lengths[{i}]={length} = {off + length} exceeds {region} of "
                         f"{size} bytes")

    # ------------------------------------------------------------ messages

    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        """Send ``payload`` to ``peer``'s ``on_message`` handler (best effort, ordered)."""
        self._check_open()
        self._send_control(peer, control.USER, 0, bytes(payload))

    def _send_control(
        self,
        peer: PeerDescriptor,
        kind: int,
        value: int,
        payload: bytes = b"",
        on_result: Callable[[FabricError | None], None] | None = None,
    ) -> None:
        data = control.encode(kind, value, self._peer, payload)
        if len(data) > self.config.control_msg_size:
            raise ValueError(
                f"message of {len(payload)} bytes too large: {len(data)} > control_msg_size "
                f"{self.config.control_msg_size}"
            )
        with _STALE_LOCK:
            closed = peer.engine_id in _CLOSED_ENGINES
        if closed or peer.engine_id in self._gone:
            raise FabricError(lib.FI_ESHUTDOWN, f"send {control.KINDS[kind]}: {peer!r} is closed")
        fi_addr = self._resolve(peer)
        send_id = next(self._ids)
        if on_result is not None:
            with self._lock:
                self._sends[send_id] = on_result
        buf = ffi.from_buffer("uint8_t[]", data)
        rc = lib.pdf_submit_send(self._h, send_id, fi_addr, buf, len(data))
        if rc:
            with self._lock:
                self._sends.pop(send_id, None)
            raise FabricError(rc, f"send {control.KINDS[kind]} to {peer!r}")

    def _on_control(self, data: bytes) -> None:
        try:
            msg = control.decode(data)
        except ValueError as exc:
            logger.warning("dropping malformed control message (%d bytes): %s", len(data), exc)
            return
        if msg.sender.provider != self.provider:
            logger.warning("dropping control message from provider %s", msg.sender.provider)
            return
        if msg.kind == control.BYE:
            logger.info("peer %r said goodbye", msg.sender)
            self._gone.add(msg.sender.engine_id)
            with self._lock:
                fi_addr = self._fi_addr.get(msg.sender.address)
            if fi_addr is not None:
                self._fail_peer(fi_addr, lib.FI_ESHUTDOWN)
            return
        if msg.kind == control.REVOKE:
            self._revoked.add((msg.sender.engine_id, msg.value))
            return
        if msg.kind == control.PONG:
            with self._lock:
                probe = self._probes.get(msg.value)
            if probe is not None:
                probe.alive = True
                probe.event.set()
            return
        try:
            if msg.kind == control.PING:
                self._send_control(msg.sender, control.PONG, msg.value)
            elif msg.kind == control.HELLO:
                self._resolve(msg.sender, hello=False)
                # revocations first: messages arrive in order, so the peer knows
                # them before its connect() returns
                for region_id in list(self._revoked_here):
                    self._send_control(msg.sender, control.REVOKE, region_id)
                if msg.value:
                    self._send_control(msg.sender, control.PONG, msg.value)
            elif msg.kind == control.USER and self._on_message is not None:
                self._on_message(msg.sender, msg.payload)
        except FabricError as exc:
            logger.warning("control message %s from %r not handled: %s", control.KINDS[msg.kind], msg.sender, exc)

    # ------------------------------------------------------------ progress

    def _run(self) -> None:
        evs = ffi.new("pdf_event[]", _EVENT_CAP)
        while True:
            n = lib.pdf_progress(self._h, evs, _EVENT_CAP, _PROGRESS_SLICE_US)
            for i in range(n):
                self._dispatch(evs[i])
            self._generation += 1
            if self._closed:
                return

    def _dispatch(self, ev) -> None:
        kind = ev.kind
        try:
            if kind == lib.PDF_EV_IMM:
                self._imm.on_landed(int(ev.id), int(ev.count))
            elif kind == lib.PDF_EV_BATCH_DONE:
                rec = self._finish_batch(int(ev.id))
                if rec is not None:
                    rec.on_done()
            elif kind == lib.PDF_EV_BATCH_FAILED:
                rec = self._finish_batch(int(ev.id))
                if rec is not None:
                    rec.on_error(
                        FabricError(
                            ev.code,
                            f"write_pages batch {int(ev.id)} to {rec.dst!r}: {int(ev.count)} of "
                            f"{int(ev.aux)} writes not completed",
                        )
                    )
            elif kind == lib.PDF_EV_RECV:
                data = bytes(ffi.buffer(lib.pdf_recv_buf(self._h, ev.id), ev.count))
                lib.pdf_recv_release(self._h, ev.id)
                self._on_control(data)
            elif kind in (lib.PDF_EV_SEND_DONE, lib.PDF_EV_SEND_FAILED):
                with self._lock:
                    cb = self._sends.pop(int(ev.id), None)
                err = None
                if kind == lib.PDF_EV_SEND_FAILED:
                    err = FabricError(ev.code, f"send {int(ev.id)} to fi_addr {int(ev.aux)}")
                    logger.info("%s", err)
                if cb is not None:
                    cb(err)
            elif kind == lib.PDF_EV_PEER_FAILED:
                with self._lock:
                    self._failed.add(int(ev.id))
                    peer = self._peers.get(int(ev.id))
                level = logging.INFO if ev.code == lib.FI_ESHUTDOWN else logging.WARNING
                logger.log(level, "peer %r failed: %s", peer, FabricError(ev.code, "transport"))
            elif kind == lib.PDF_EV_CQ_ERROR:
                logger.error("completion queue error: %s (prov_errno %d)", FabricError(ev.code, "fi_cq_read"), ev.count)
        except Exception:  # a user callback raised: report it, keep progressing
            logger.exception("fabric callback for event kind %d id %d raised", kind, int(ev.id))

    def _finish_batch(self, batch_id: int) -> _Batch | None:
        with self._lock:
            rec = self._batches.pop(batch_id, None)
            if rec is not None:
                rec.region.inflight -= 1
        return rec

    # ------------------------------------------------------------ shutdown

    def outstanding(self) -> int:
        """Batches and sends not finished yet, plus operations the provider holds."""
        return int(lib.pdf_outstanding(self._h)) if not self._closed else 0

    def close(self) -> None:
        """Drain for up to close_timeout_s, say goodbye, fail the rest, release everything."""
        if self._closed or self._closing:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("TransferEngine.close() called from a fabric callback")
        self._closing = True
        deadline = time.monotonic() + self.config.close_timeout_s
        while lib.pdf_outstanding(self._h) and time.monotonic() < deadline:
            time.sleep(0.002)
        peers = self._known_peers()
        for peer in peers:
            try:
                self._send_control(peer, control.BYE, 0)
            except FabricError as exc:
                logger.info("goodbye to %r not sent: %s", peer, exc)
        bye_deadline = time.monotonic() + min(1.0, self.config.close_timeout_s)
        while lib.pdf_outstanding(self._h) and time.monotonic() < bye_deadline:
            time.sleep(0.002)
        self._closed = True
        lib.pdf_stop(self._h)
        self._thread.join()
        evs = ffi.new("pdf_event[]", _EVENT_CAP)
        while True:
            n = lib.pdf_fail_all(self._h, lib.FI_ECANCELED, evs, _EVENT_CAP)
            for i in range(n):
                self._dispatch(evs[i])
            if n < _EVENT_CAP - 1:
                break
        with _STALE_LOCK:
            _CLOSED_ENGINES.add(self.engine_id)
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        lib.pdf_close_ep(self._h)  # the endpoint goes first, then the MRs it used
        for region in regions:
            region.closed = True
            rc = lib.pdf_mr_close(self._h, region._mr)
            if rc:
                logger.warning("%s", FabricError(rc, f"fi_close(mr of region {region.region_id})"))
            region._keepalive = None
        lib.pdf_close(self._h)
        self._h = ffi.NULL
        logger.info("engine %s closed", self.engine_id[:8])

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine({self.provider}, engine={self.engine_id[:8]})"
