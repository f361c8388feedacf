"""WritePath: paged one-sided writes, validated, posted, and counted until they complete.

A batch is ``n`` entries (src offset, dst offset, length) from one local region to one remote
region. ``prepare`` validates everything before anything is posted (bad values raise
ValueError, bad or stale handles FabricError) and resolves the destination peer, connecting
on first use; the native side (``pdf_submit_writes`` / ``pdf_write_sync``) coalesces entries
contiguous at both ends, splits long ones, posts within the tx credits and tags the writes with
immediate data (fabric.imm). Each batch keeps its region busy (``inflight``) until its outcome.

A batch arrives as one ``PageWrites`` (fabric.backend: the request typed once). Two ways to
learn that writes completed: ``write`` (batches, callbacks on the progress
thread: the KV messenger's path, for throughput) and ``write_sync`` (one batch, the
calling thread polls the completion queue itself for up to config.sync_spin_us with the GIL
released, then sleeps while the progress thread finishes: for lone latency-bound writes, it
saves the two thread wake-ups of progress thread -> callback -> waiter).

A failed batch (``on_error``) means its peer failed (csrc/pdf_core.c peer_fail fails every batch
of that peer at once), not that the provider let go of its writes: with a shared endpoint
(tcp;ofi_rxm, verbs;ofi_rxm) the operations may still sit in the provider's queue of that peer's
connection and be sent later, reading the source region. So the source memory of a failed batch
may be reused only after ``TransferEngine.disconnect(peer)``, which closes that connection and
drops what it queued (FI_AV_REMOVE_CLEANUP: FabricConfig.av_remove_cleanup); shm closes the peer's own
transmit endpoint at peer_fail already. The prefill node does so before freeing its pages.

Threads: write / write_sync from any thread but the progress thread's callbacks
(write_sync refuses it: it may wait for that thread); ``on_batch_*`` on the progress
thread. Blocking waits: write never waits (the first write to a peer waits for its
handshake, see fabric.peers.PeerTable.connect); write_sync waits at most its
``timeout`` (None: until the batch completes or fails, which the peer timeout
config.peer_timeout_s bounds unless it is 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from fabric import stale
from fabric._libfabric import ffi, lib
from fabric.backend import FabricStats, OnDone, OnError, PageWrites, SyncResult, as_offsets
from fabric.descriptors import RemoteDescriptor
from fabric.endpoint import Endpoint
from fabric.errors import FabricError
from fabric.imm import IMM_MAX
from fabric.memory import MemoryRegion
from fabric.peers import PeerTable
from fabric.regions import RegionTable

logger = logging.getLogger(__name__)

_IMM_MODES = {"last": lib.PDF_IMM_LAST, "every": lib.PDF_IMM_EVERY}


@dataclass
class _Batch:
    on_done: OnDone
    on_error: OnError
    region: MemoryRegion
    dst: RemoteDescriptor
    writes: int


@dataclass
class _Prepared:
    """A validated batch, ready for the native side."""

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


_as_offsets = as_offsets


class WritePath:
    """Posts write batches of one endpoint and tracks them until their outcome."""

    def __init__(self, ep: Endpoint, regions: RegionTable, peers: PeerTable) -> None:
        self._ep = ep
        self._regions = regions
        self._peers = peers
        self._batches: dict[int, _Batch] = {}
        self._stats = [0, 0, 0, 0]  # batches, entries, writes, bytes

    def write(self, writes: PageWrites, on_done: OnDone, on_error: OnError) -> int:
        if not callable(on_done) or not callable(on_error):
            raise TypeError("write_pages: on_done and on_error must be callable")
        ep = self._ep
        w = self._prepare("write_pages", writes)
        batch_id = self._open_batch(w, on_done, on_error)
        src_region, dst = writes.src_region, writes.dst
        rc = lib.pdf_submit_writes(
            ep.h, batch_id, w.fi_addr, src_region.address, src_region._desc, dst.base, dst.key,
            w.src_c, w.dst_c, w.lens_c, w.n, w.imm, w.imm_flag, ep.max_write, int(ep.config.coalesce),
        )
        if rc < 0:
            self._drop_batch(batch_id, src_region)
            raise FabricError(int(rc), f"write_pages batch of {w.n} writes to {dst!r}")
        self._count(w, int(rc))
        return batch_id

    def write_sync(self, writes: PageWrites, timeout: float | None, spin_us: int | None) -> SyncResult:
        ep = self._ep
        if ep.on_progress_thread():
            raise RuntimeError("write_pages_sync called from a fabric callback (it may wait for that thread)")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout={timeout!r}: expected None or seconds >= 0")
        spin = ep.config.sync_spin_us if spin_us is None else spin_us
        if not isinstance(spin, int) or not 0 <= spin <= 1_000_000:
            raise ValueError(f"spin_us={spin!r}: expected an int in 0..1000000")
        w = self._prepare("write_pages_sync", writes)
        batch_id = self._open_batch(w, _detached_done, _detached_error)
        src_region, dst = writes.src_region, writes.dst
        res = ffi.new("pdf_sync_result *")
        rc = lib.pdf_write_sync(
            ep.h, batch_id, w.fi_addr, src_region.address, src_region._desc, dst.base, dst.key,
            w.src_c, w.dst_c, w.lens_c, w.n, w.imm, w.imm_flag, ep.max_write, int(ep.config.coalesce),
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

    def stats(self) -> FabricStats:
        with self._ep.lock:
            return FabricStats(*self._stats)

    def check_remote(self, dst: RemoteDescriptor) -> None:
        """Refuse a destination that is stale (its engine closed, its region revoked) or on another provider."""
        if not isinstance(dst, RemoteDescriptor):
            raise TypeError(f"write_pages: expected a RemoteDescriptor, got {type(dst).__name__}")
        eid = dst.peer.engine_id
        if stale.engine_closed(eid) or self._peers.is_gone(eid):
            raise FabricError(lib.FI_ENOENT, f"write_pages: stale {dst!r}: its engine {eid[:8]} is closed")
        if stale.region_revoked(eid, dst.region_id) or self._peers.is_revoked(eid, dst.region_id):
            raise FabricError(lib.FI_ENOENT, f"write_pages: stale {dst!r}: region {dst.region_id} was deregistered")
        provider = self._ep.provider
        if dst.peer.provider != provider:
            raise FabricError(
                lib.FI_EINVAL, f"write_pages: {dst!r} is on provider {dst.peer.provider!r}, not {provider!r}"
            )

    # ------------------------------------------------------------ events (progress thread)

    def on_batch_done(self, ev) -> None:
        rec = self._finish_batch(int(ev.id))
        if rec is not None:
            rec.on_done()

    def on_batch_failed(self, ev) -> None:
        rec = self._finish_batch(int(ev.id))
        if rec is not None:
            rec.on_error(
                FabricError(
                    ev.code,
                    f"write_pages batch {int(ev.id)} to {rec.dst!r}: {int(ev.count)} of "
                    f"{int(ev.aux)} writes not completed",
                )
            )

    # ------------------------------------------------------------ internals

    def _prepare(self, what: str, writes: PageWrites) -> _Prepared:
        """Validate a batch (nothing is posted if anything is wrong) and resolve its peer."""
        ep = self._ep
        ep.check_open()
        if not isinstance(writes, PageWrites):
            raise TypeError(f"{what}: expected a PageWrites, got {type(writes).__name__}")
        src_region, dst, imm = writes.src_region, writes.dst, writes.imm
        self._regions.check(src_region, what)
        self.check_remote(dst)
        src = _as_offsets(writes.src_offsets, "src_offsets")
        dsto = _as_offsets(writes.dst_offsets, "dst_offsets")
        lens = _as_offsets(writes.lengths, "lengths")
        n = src.size
        if n == 0:
            raise ValueError(f"{what}: empty batch (no offsets)")
        if dsto.size != n or lens.size != n:
            raise ValueError(
                f"{what}: lengths differ: src_offsets={n}, dst_offsets={dsto.size}, lengths={lens.size}"
            )
        mode = writes.imm_mode or ep.config.imm_mode
        if mode not in _IMM_MODES:
            raise ValueError(f"imm_mode={mode!r}: expected one of {tuple(_IMM_MODES)}")
        if imm is not None and (not isinstance(imm, int) or not 0 <= imm <= IMM_MAX):
            raise ValueError(f"imm={imm!r}: expected None or an int in 0..{IMM_MAX}")
        src_c = ffi.from_buffer("uint64_t[]", src)
        dst_c = ffi.from_buffer("uint64_t[]", dsto)
        lens_c = ffi.from_buffer("uint64_t[]", lens)
        bad_what = ffi.new("int *")
        total = ffi.new("uint64_t *")
        max_len = ep.max_write if mode == "every" else 0
        bad = lib.pdf_check_writes(src_c, dst_c, lens_c, n, src_region.length, dst.length, max_len, bad_what, total)
        if bad >= 0:
            _refuse(int(bad), int(bad_what[0]), src, dsto, lens, src_region, dst, max_len)
        if not self._peers.handshaken(dst.peer):
            self._peers.connect(dst.peer)
            self.check_remote(dst)  # the handshake brings the peer's revocations
        fi_addr = self._peers.resolve(dst.peer)
        imm_flag = lib.PDF_IMM_NONE if imm is None else _IMM_MODES[mode]
        # the numpy arrays ride along: the cffi views borrow their memory
        return _Prepared(src_region, dst, fi_addr, n, int(total[0]), imm or 0, imm_flag,
                         src_c, dst_c, lens_c, (src, dsto, lens))

    def _open_batch(self, w: _Prepared, on_done: OnDone, on_error: OnError) -> int:
        ep = self._ep
        with ep.lock:
            if self._peers.is_failed(w.fi_addr):
                raise FabricError(lib.FI_EHOSTUNREACH, f"write_pages: peer {w.dst.peer!r} has failed")
            batch_id = ep.next_id()
            self._batches[batch_id] = _Batch(on_done, on_error, w.region, w.dst, w.n)
            w.region.inflight += 1
        return batch_id

    def _drop_batch(self, batch_id: int, region: MemoryRegion) -> None:
        with self._ep.lock:
            if self._batches.pop(batch_id, None) is not None:
                region.inflight -= 1

    def _finish_batch(self, batch_id: int) -> _Batch | None:
        with self._ep.lock:
            rec = self._batches.pop(batch_id, None)
            if rec is not None:
                rec.region.inflight -= 1
        return rec

    def _count(self, w: _Prepared, writes: int) -> None:
        with self._ep.lock:
            st = self._stats
            st[0] += 1
            st[1] += w.n
            st[2] += writes
            st[3] += w.total


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
