"""Endpoint: one opened libfabric FI_EP_RDM endpoint and the progress thread that serves it.

The native half (csrc/pdf_core.c, declared in csrc/pdf_core.h, inside the cffi extension
``fabric._libfabric``) owns the endpoint, its CQ, AV and domain, and does all posting and
polling. This module opens it (``pdf_open``), holds what the other parts of a TransferEngine
share (the native handle, this engine's identity and attributes, one bookkeeping lock, one id
counter, the open/closing/closed state) and runs the progress thread.

Progress: the thread loops in ``pdf_progress``, which posts queued work, polls the CQ and
returns events; each goes to the ``dispatch`` function given to ``start``. The native side spins
briefly after activity, then sleeps until work arrives, on the CQ's wait fd (tcp, verbs) or, for
shm, on a doorbell: a small shared-memory word per engine (/dev/shm/pdserve-bell-<pid>-<engine>)
that peers on this host ring after posting to it (csrc/pdf_wait.h). An idle engine therefore
costs no CPU and still answers in microseconds.

Threads and waits:
- ``fabric-progress-<engine>``: the progress thread. Each ``pdf_progress`` call returns within
  _PROGRESS_SLICE_US (100 ms) or at once after ``stop``; dispatch runs the callbacks, which
  must not block (fabric.backend's rules).
- ``stop`` joins the thread for at most _JOIN_TIMEOUT_S; a thread still inside a blocking
  callback by then makes ``stop`` raise (the native endpoint is then left open, since freeing
  it under a running thread would be a use after free).
- ``pin`` moves the progress thread to given CPUs at the start of its next round (a rail's thread
  to the CPUs nearest its NIC, fabric.engine.pin_rail); it never waits for that.
- ``lock`` guards the Python bookkeeping of every part (batches, regions, peers, probes,
  sends, stats); it is held only around dictionary and counter updates, never across a wait.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from typing import Callable, Iterator

from fabric import shmclean
from fabric._libfabric import ffi, lib
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor
from fabric.errors import FabricError
from fabric.liveness import host_id, process_start_time

logger = logging.getLogger(__name__)

# Nagle on the tcp provider's sockets delays the small messages rxm answers with
# (acknowledgements, completions): on loopback it made a lone 64 KiB write several times slower
# and halved bandwidth at 64 KiB (the fabric benchmark runs C and Python with this default:
# bench/results/fabric/fabric.md). libfabric reads it when it first initializes its providers, so it is
# set before any engine opens (an explicit setting wins).
os.environ.setdefault("FI_TCP_NODELAY", "1")

EVENT_CAP = 1024  # events one pdf_progress / pdf_fail_* call returns at most
_PROGRESS_SLICE_US = 100_000  # the longest one pdf_progress call blocks
_JOIN_TIMEOUT_S = 10.0  # stop(): the progress thread's last slice and callbacks
_WAIT_MODES = {lib.PDF_WAIT_SLEEP: "sleep", lib.PDF_WAIT_FD: "fd", lib.PDF_WAIT_BELL: "bell"}

Dispatch = Callable[[object], None]  # called with each pdf_event (a cffi struct)


_ORDERS = {"RAR": lib.FI_ORDER_RAR, "RAW": lib.FI_ORDER_RAW, "WAR": lib.FI_ORDER_WAR, "WAW": lib.FI_ORDER_WAW,
           "SAS": lib.FI_ORDER_SAS, "RMA_WAW": lib.FI_ORDER_RMA_WAW}


def _order_names(bits: int) -> frozenset[str]:
    """The FI_ORDER_* names set in `bits` (the ones fabric looks at)."""
    return frozenset(name for name, bit in _ORDERS.items() if bits & bit)


def bell_name(peer: PeerDescriptor) -> str:
    """The shared-memory name of a peer's doorbell (shm engines on one host)."""
    return f"/{shmclean.BELL_PREFIX}{peer.pid}-{peer.engine_id}"


class Endpoint:
    """An open native endpoint: handle, identity, attributes and the progress thread.

    Attributes (set once at open): rail (its index in its TransferEngine), node (the bind address
    asked for, None: the provider's choice), asked_domain (the domain name asked for, None: the
    provider's choice), provider, domain (the one it opened on), mr_mode, tx_credits, max_msg_size,
    wait_mode ("fd", "bell" or "sleep"), delivery_complete (granted, see FabricConfig), source_addr
    (FI_SOURCE granted: receive completions name their sender), tx_order / rx_order (the FI_ORDER_*
    names granted, e.g. "SAS", "WAW"),
    engine_id, me (this endpoint's PeerDescriptor), max_write (the largest single write).
    """

    def __init__(self, config: FabricConfig, *, node: str | None = None, domain: str | None = None,
                 engine_id: str | None = None, ids: Iterator[int] | None = None, rail: int = 0) -> None:
        """Open the endpoint. A TransferEngine's first endpoint (rail 0) takes only ``config``;
        its further rails (fabric.engine) pass the libfabric ``domain`` name (the native open asks
        fi_getinfo for it and takes only an entry of that name: efa, verbs) and, where the
        provider also needs one, the bind address ``node`` (tcp: the interface's IPv4 address,
        which picks the IPv4 entry among the domain's); given a domain, ``node`` is exactly what
        is passed (no fallback to config.node, whose address is rail 0's). They share rail 0's
        ``engine_id`` and id counter ``ids`` (one identity, and region, batch and send ids unique
        across the engine's rails). FabricError when it does not open (no domain of that name:
        the message names it and the provider's domains)."""
        self.config = config
        self.rail = rail
        provider = config.resolved_provider()
        if domain is not None and (not isinstance(domain, str) or not domain or provider == "shm"):
            raise ValueError(f"Endpoint: domain={domain!r}: expected a domain name (and a provider other than shm, "
                             f"not {provider!r})")
        if domain is None:
            node = (node or config.node) if provider != "shm" else None
        self.node = node
        self.asked_domain = domain
        self.engine_id = engine_id or uuid.uuid4().hex
        shmclean.sweep()  # files of killed processes: memory, and pid clashes for shm
        me = PeerDescriptor(provider, b"", self.engine_id, host_id(), os.getpid(), process_start_time(os.getpid()))
        out = ffi.new("pdf_engine **")
        errbuf = ffi.new("char[384]")
        rc = lib.pdf_open(
            provider.encode(),
            node.encode() if node else ffi.NULL,
            domain.encode() if domain else ffi.NULL,
            config.tx_depth,
            config.control_slots,
            config.control_msg_size,
            config.spin_us,
            config.busy_spin_us,
            config.sleep_max_us,
            int(config.peer_timeout_s * 1000),
            int(config.wants_delivery_complete(provider)),
            int(config.busy_poll),
            bell_name(me).encode(),
            out,
            errbuf,
            len(errbuf),
        )
        if rc:
            where = f"node={node!r}" + (f", domain={domain!r}" if domain else "")
            raise FabricError(rc, f"opening provider {provider!r} ({where}) failed at "
                                  f"{ffi.string(errbuf).decode()}")
        self.h = out[0]
        info = ffi.new("pdf_info *")
        rc = lib.pdf_get_info(self.h, info)
        if rc:
            lib.pdf_close(self.h)
            raise FabricError(rc, "fi_getname")
        self.provider: str = ffi.string(info.provider).decode()
        self.domain: str = ffi.string(info.domain).decode()
        self.mr_mode: int = int(info.mr_mode)
        self.tx_credits: int = int(info.tx_credits)
        self.max_msg_size: int = int(info.max_msg_size)
        self.wait_mode: str = _WAIT_MODES.get(int(info.wait_mode), str(int(info.wait_mode)))
        self.delivery_complete: bool = bool(info.delivery_complete)
        # FI_SOURCE granted: a received control message names its sender's AV address (fabric.protocol)
        self.source_addr: bool = bool(info.source_addr)
        # the message orders the provider granted (open_info asks SAS + WAW, WAW given up last):
        # the prefill node's delivery fence is trusted only where both sides have "WAW"
        self.tx_order: frozenset[str] = _order_names(int(info.tx_msg_order))
        self.rx_order: frozenset[str] = _order_names(int(info.rx_msg_order))
        self.me = PeerDescriptor(
            provider=self.provider,
            address=bytes(ffi.buffer(info.addr, info.addrlen)),
            engine_id=self.engine_id,
            host_id=host_id(),
            pid=os.getpid(),
            start_time=process_start_time(os.getpid()),
        )
        self.max_write = config.max_write_bytes or min(self.max_msg_size, 1 << 62)
        self.lock = threading.Lock()
        # one counter: region, batch, send ids and probe nonces (shared by an engine's rails)
        self.ids: Iterator[int] = ids if ids is not None else itertools.count(1)
        self.closing = False
        self.closed = False
        self._generation = 0  # progress rounds completed (wait_peer_gone's drain fence)
        self._dispatch: Dispatch | None = None
        self._pin: tuple[int, ...] | None = None   # CPUs the progress thread moves to at its next round
        self.pinned: tuple[int, ...] = ()          # the CPUs it was pinned to (): never pinned
        name = f"fabric-progress-{self.engine_id[:8]}" + (f"-rail{rail}" if rail else "")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def next_id(self) -> int:
        return next(self.ids)

    def check_open(self) -> None:
        if self.closing or self.closed:
            raise FabricError(lib.FI_ESHUTDOWN, f"engine {self.engine_id[:8]} is closed")

    # ------------------------------------------------------------ progress

    def start(self, dispatch: Dispatch) -> None:
        """Start the progress thread; every event (also those of fail_peer / fail_all) goes to ``dispatch``."""
        self._dispatch = dispatch
        self._thread.start()

    def on_progress_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def progress_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def generation(self) -> int:
        return self._generation

    def _run(self) -> None:
        evs = ffi.new("pdf_event[]", EVENT_CAP)
        while True:
            if self._pin is not None:
                self._apply_pin()
            n = lib.pdf_progress(self.h, evs, EVENT_CAP, _PROGRESS_SLICE_US)
            for i in range(n):
                self._dispatch(evs[i])
            self._generation += 1
            if self.closed:
                return

    def pin(self, cpus: tuple[int, ...]) -> None:
        """Move the progress thread to ``cpus`` (those of them it may use now: a pin never widens
        what the process was given) before its next round; () or none in common: left alone."""
        self._pin = tuple(cpus)
        self.poke()

    def _apply_pin(self) -> None:
        cpus, self._pin = self._pin, None
        target = set(cpus) & os.sched_getaffinity(0)
        if not target:
            logger.info("engine %s rail %d: progress thread not pinned: CPUs %s not among its allowed %s",
                        self.engine_id[:8], self.rail, sorted(cpus), sorted(os.sched_getaffinity(0)))
            return
        os.sched_setaffinity(0, target)   # this thread only (Linux: per thread)
        self.pinned = tuple(sorted(target))
        logger.info("engine %s rail %d: progress thread pinned to CPUs %s", self.engine_id[:8], self.rail,
                    list(self.pinned))

    def poke(self) -> None:
        """Make the progress thread run one more round now."""
        if not self.closed:
            lib.pdf_poke(self.h)

    def fail_peer(self, fi_addr: int, code: int) -> None:
        """Fail everything queued and outstanding to ``fi_addr``; its events are dispatched here."""
        evs = ffi.new("pdf_event[]", EVENT_CAP)
        n = lib.pdf_fail_peer(self.h, fi_addr, code, evs, EVENT_CAP)
        for i in range(n):
            self._dispatch(evs[i])

    def outstanding(self) -> int:
        """Batches and sends not finished yet, plus operations the provider holds."""
        return int(lib.pdf_outstanding(self.h)) if not self.closed else 0

    def locks_released(self) -> int:
        return int(lib.pdf_locks_released(self.h)) if not self.closed else 0

    def stop(self) -> None:
        """Mark the endpoint closed, stop the progress thread, then fail (and dispatch) what is left."""
        self.closed = True
        lib.pdf_stop(self.h)
        self._thread.join(_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            raise FabricError(
                lib.FI_ETIMEDOUT,
                f"engine {self.engine_id[:8]}: progress thread still running {_JOIN_TIMEOUT_S}s after stop "
                f"(a callback blocks); the native endpoint stays open",
            )
        evs = ffi.new("pdf_event[]", EVENT_CAP)
        while True:
            n = lib.pdf_fail_all(self.h, lib.FI_ECANCELED, evs, EVENT_CAP)
            for i in range(n):
                self._dispatch(evs[i])
            if n < EVENT_CAP - 1:
                break

    def close_ep(self) -> None:
        """Close the endpoint itself (before the MRs it used)."""
        lib.pdf_close_ep(self.h)

    def release(self) -> None:
        """Free the native engine (after stop and close_ep)."""
        lib.pdf_close(self.h)
        self.h = ffi.NULL
