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
(``_Rail.dispatch``). Primitives: register/deregister, connect/disconnect, write / write_sync
(a PageWrites batch; write_pages / write_pages_sync: the deprecated positional forms), send,
wait_peer_gone, close; plus the receiver's ImmCounter and stats().

Rails (D16): an engine has one endpoint per libfabric domain (NIC) it is asked for, each a
``_Rail`` with all the parts above and its own progress thread. Rail 0 is the endpoint opened as
the config says (today's only one); ``open_rail(domain)`` opens another on the libfabric domain
of that name: the native open asks fi_getinfo for it (hints->domain_attr->name) and takes only
an entry of that name (libfabric 1.17's tcp ignores the hint and lists every interface's domain,
so the name is checked there, not trusted to the provider). efa ("rdmap0s6-rdm") and any
provider whose domain has no address are opened by the name alone; tcp / sockets are also bound
to the interface's IPv4 address (fabric.topology.rail_node: a tcp domain lists an entry per
address family, and the endpoint must be the IPv4 one), verbs to its device interface's where it
has one (else by name only). Only shm is refused: one host, one domain. Every rail shares the
engine's identity (engine id, host, pid; its PeerDescriptor differs only in the endpoint name),
its id counter (region ids are unique across rails, so revocations name regions unambiguously)
and its ImmCounter (a receiver counts what lands on any rail). A region is registered on one
rail (``register(..., rail=i)``, its descriptor names that rail's endpoint) and every write from
it posts on that rail, to whatever endpoint the destination descriptor names; a rail shakes
hands with each remote endpoint it writes to (per endpoint name). What concerns a peer engine as
a whole covers every rail: ``disconnect`` and ``close_connection`` end the connections of all
its known endpoints on all rails, ``wait_peer_gone`` drains every rail, ``close`` closes them
all. Control messages (``send``, ``connect``) use rail 0 unless told. ``pin_rail(rail, cpus)``
moves a rail's progress thread (it posts the rail's writes and reads its completions) to the
CPUs nearest its NIC. With one domain (one NIC, or none) only rail 0 exists and everything is as
it was.

Threads: each rail's progress thread (fabric.endpoint) runs the callbacks of its own writes,
sends and landings (so with several rails, callbacks and ImmCounter completions come from more
than one thread); the public methods may be called from any thread (fabric.backend's rules).
Blocking waits, each bounded: ``connect`` and the first write from a rail to a remote endpoint
(the handshake, ``timeout`` / 5 s), ``open_rail`` (the native open: fi_getinfo and endpoint setup,
no peer involved; ``pin_rail`` never waits), ``wait_peer_gone`` (its ``timeout``, then at most
1.05 s of draining per other rail, fabric.peers), ``write_pages_sync`` (its ``timeout``, see fabric.writes), ``close``
(outstanding work of all rails: config.close_timeout_s; the goodbyes: min(1 s,
close_timeout_s); each progress thread's stop: fabric.endpoint).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

from fabric import control, stale, topology
from fabric._libfabric import lib
from fabric.backend import OnDone, OnError, PageWrites, SyncResult, TransferBackend
from fabric.config import FabricConfig
from fabric.descriptors import PeerDescriptor
from fabric.endpoint import Endpoint
from fabric.errors import FabricError
from fabric.imm import ImmCounter, provider_names_writers, writer_id
from fabric.memory import MemoryRegion
from fabric.peers import PeerTable
from fabric.protocol import ControlChannel, ControlProtocol
from fabric.regions import RegionTable
from fabric.sockets import SocketShutdown, endpoint_of, fabric_sockets, shut_down
from fabric.writes import FabricStats, WritePath

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.002  # close(): how often it looks whether outstanding work finished
_BYE_TIMEOUT_S = 1.0  # close(): the longest wait for the goodbyes to leave
_MAX_MARKS = 1024  # progress_mark(): marks remembered (the oldest forgotten: progressed() then True)

@dataclass(frozen=True)
class RailInfo:
    """One endpoint of a TransferEngine (see the module docstring)."""

    index: int                # 0: the endpoint the config opened
    domain: str               # its libfabric domain (tcp: the interface; verbs: the device)
    node: str | None          # the address it was bound to (None: the provider's choice)
    peer: PeerDescriptor      # its endpoint, as regions registered on it name it
    cpus: tuple[int, ...] = ()   # the CPUs its progress thread was pinned to (pin_rail); (): not pinned


class _Rail:
    """One endpoint and the parts that serve it (module docstring); events of its progress thread
    go to ``dispatch``."""

    def __init__(self, ep: Endpoint, imm: ImmCounter,
                 on_message: Callable[[PeerDescriptor, bytes], None] | None) -> None:
        self._ep = ep
        self._imm = imm
        self._regions = RegionTable(ep)
        self._channel = ControlChannel(ep)
        self._peers = PeerTable(ep, self._channel)
        self._writes = WritePath(ep, self._regions, self._peers)
        self._control = ControlProtocol(ep, self._peers, self._regions, on_message)

    def info(self) -> RailInfo:
        ep = self._ep
        return RailInfo(ep.rail, ep.domain, ep.node, ep.me, ep.pinned)

    def dispatch(self, ev) -> None:
        """Route one native event to its part (progress thread, or a fail_* call's caller)."""
        kind = ev.kind
        try:
            if kind == lib.PDF_EV_IMM:
                # the writer, where the provider names it (fabric.imm): the peer at its source address
                self._imm.on_landed(int(ev.id), int(ev.count),
                                    writer_id(self._peers.peer_at(int(ev.aux))) if self._imm.names_writers else None)
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


class TransferEngine(TransferBackend):
    """libfabric implementation of TransferBackend (see its rules).

    One endpoint, one CQ, one progress thread per rail (rail 0 always; more with ``open_rail``).
    ``on_message(peer, payload)`` receives messages sent with ``send`` by other engines.

    Attributes: config, engine_id, provider, domain, mr_mode, tx_credits, max_msg_size,
    wait_mode, delivery_complete (rail 0's fabric.endpoint.Endpoint).
    """

    def __init__(
        self,
        config: FabricConfig | None = None,
        *,
        on_message: Callable[[PeerDescriptor, bytes], None] | None = None,
    ) -> None:
        self.config = config or FabricConfig()
        self._on_message = on_message
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
        self._imm = ImmCounter(names_writers=provider_names_writers(ep.provider, ep.source_addr))
        rail0 = _Rail(ep, self._imm, on_message)
        # rail 0's parts under their own names (fabric's tests look at them)
        self._regions, self._channel, self._peers = rail0._regions, rail0._channel, rail0._peers
        self._writes, self._control = rail0._writes, rail0._control
        self._rails: list[_Rail] = [rail0]
        self._rails_lock = threading.Lock()   # open_rail / close; readers index the list (append-only)
        self._marks: OrderedDict[int, tuple[int, ...]] = OrderedDict()   # progress_mark -> each rail's round
        self._mark_ids = 0
        ep.start(rail0.dispatch)
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
        only where both ends have this. False once the engine has several rails: a write on one
        rail's connection says nothing of the others'."""
        sides = (self.tx_order, self.rx_order)
        return len(self._rails) == 1 and all(bool({"WAW", "RMA_WAW"} & side) for side in sides)

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

    @property
    def rails(self) -> tuple[RailInfo, ...]:
        """Every endpoint of this engine, rail 0 first."""
        return tuple(r.info() for r in self._rails)

    def stats(self) -> FabricStats:
        """Counts of what write_pages accepted and posted since the engine opened (all rails)."""
        per = [r._writes.stats() for r in self._rails]
        return FabricStats(*(sum(getattr(st, f) for st in per) for f in ("batches", "entries", "writes", "bytes")))

    def rail_stats(self, rail: int) -> FabricStats:
        """``stats`` of one rail."""
        return self._rail(rail)._writes.stats()

    def outstanding(self) -> int:
        """Batches and sends not finished yet, plus operations the provider holds (all rails)."""
        return sum(r._ep.outstanding() for r in self._rails)

    # ---------------------------------------------------------------- rails

    def _rail(self, rail: int) -> _Rail:
        rails = self._rails
        if not isinstance(rail, int) or not 0 <= rail < len(rails):
            raise ValueError(f"rail={rail!r}: this engine has rails 0..{len(rails) - 1}")
        return rails[rail]

    def _rail_of(self, region: MemoryRegion, what: str) -> _Rail:
        if not isinstance(region, MemoryRegion):
            raise TypeError(f"{what}: expected a MemoryRegion, got {type(region).__name__}")
        if region.engine_id != self.engine_id or not 0 <= region.rail < len(self._rails):
            raise FabricError(lib.FI_EINVAL, f"{what}: region {region.region_id} belongs to engine "
                                             f"{region.engine_id[:8]} rail {region.rail}, not to {self.engine_id[:8]}")
        return self._rails[region.rail]

    def pin_rail(self, rail: int, cpus: tuple[int, ...]) -> None:
        """Run ``rail``'s progress thread (which posts its writes and reads its completions) on
        ``cpus``, those nearest its NIC (kv_messenger.pool), from its next round on; CPUs outside
        what the process may use are dropped, and none left leaves it where it is."""
        self._rail(rail)._ep.pin(tuple(cpus))

    def rail_for(self, domain: str | None) -> int | None:
        """The index of the open rail on ``domain`` (None: none open there; ``domain`` None: 0)."""
        if domain is None:
            return 0
        for r in self._rails:
            if r._ep.domain == domain:
                return r._ep.rail
        return None

    def open_rail(self, domain: str) -> int:
        """The rail on libfabric domain ``domain``, opening it unless one is open there already
        (an endpoint on the domain of that name, bound where the provider needs it to the address
        fabric.topology.rail_node gives: the module docstring); rail 0 when it is rail 0's.
        ValueError for shm (one domain), multi_rail=False, or a tcp / sockets ``domain`` that is no
        interface with an IPv4 address; FabricError when the provider has no domain of that name
        (naming it and the ones it has) or the endpoint does not open."""
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"open_rail: domain={domain!r}: expected a domain name")
        with self._rails_lock:
            self._ep.check_open()
            found = self.rail_for(domain)
            if found is not None:
                return found
            provider = self.provider
            if not self.config.multi_rail:
                raise ValueError(f"open_rail({domain!r}): this engine's config says multi_rail=False (one endpoint, "
                                 f"on {self.domain!r})")
            if provider == "shm":
                raise ValueError(f"open_rail({domain!r}): provider shm has one domain (rail 0's, {self.domain!r})")
            node = topology.rail_node(provider, domain)   # None for efa: chosen by name alone
            if node is None and provider.split(";")[0] in ("tcp", "sockets"):
                raise ValueError(f"open_rail({domain!r}): no local address opens provider {provider!r} on domain "
                                 f"{domain!r} (tcp: an interface with an IPv4 address)")
            index = len(self._rails)
            ep = Endpoint(self.config, node=node, domain=domain, engine_id=self.engine_id, ids=self._ep.ids,
                          rail=index)
            if ep.domain != domain or ep.provider != provider:
                got = (ep.provider, ep.domain)
                ep.close_ep()
                ep.release()
                raise FabricError(lib.FI_EINVAL, f"open_rail({domain!r}): node {node}, provider {provider!r} "
                                                 f"opened {got[0]!r} on domain {got[1]!r}")
            rail = _Rail(ep, self._imm, self._on_message)
            self._rails.append(rail)
            ep.start(rail.dispatch)
        logger.info("engine %s: rail %d on domain %s (node %s)", self.engine_id[:8], index, domain, node)
        return index

    # --------------------------------------------------------------- memory

    def register(
        self, buffer: object | None = None, *, address: int | None = None, length: int | None = None,
        rail: int = 0,
    ) -> MemoryRegion:
        """Register ``buffer`` (writable buffer protocol) or raw ``address``/``length`` on ``rail``.

        fabric never allocates: the owner passes a buffer (e.g. a host buffer's
        ``view``) or, for memory it keeps alive itself, e.g. a torch tensor, its
        ``data_ptr()`` and ``nbytes``. The region's descriptor names that rail's endpoint, and
        writes from it post on that rail.
        """
        return self._rail(rail)._regions.register(buffer, address=address, length=length)

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
        rail = self._rail_of(region, "deregister")
        rail._regions.deregister(region)
        for peer in rail._peers.known_peers():   # the endpoints that shook hands with its rail
            rail._peers.send_control(peer, control.REVOKE, region.region_id)

    # ---------------------------------------------------------------- peers

    def connect(self, peer: PeerDescriptor, timeout: float = 5.0, *, rail: int = 0) -> None:
        """Insert ``peer`` into ``rail``'s AV and shake hands: when this returns, the
        peer knows us (so it can tell us about revoked regions, say goodbye
        and answer probes). A failed peer is reset. write_pages connects on
        first use (from the source region's rail). Raises FabricError(FI_ETIMEDOUT) if the peer
        does not answer within ``timeout``."""
        self._rail(rail)._peers.connect(peer, timeout)

    def disconnect(self, peer: PeerDescriptor) -> None:
        """Remove ``peer`` from the AV; its outstanding work is failed, and (rxm) its connection
        is closed with what the provider still queued on it: after this returns nothing more is
        sent to it from our buffers. shm has no connection: its per-peer transmit endpoint went
        when the peer failed (csrc/pdf_core.c peer_fail). With several rails: every endpoint of
        ``peer``'s engine known on any rail (the writes of a transfer may have used each)."""
        self._peers.disconnect(peer)
        for rail in self._rails:
            for other in rail._peers.addresses_of(peer.engine_id):
                rail._peers.disconnect(other)

    def close_connection(self, peer: PeerDescriptor) -> None:
        """End every connection this endpoint has with ``peer`` (ofi_rxm: the one its AV entry
        names, opened by either side), inserting its address first if we never did (a peer that
        only wrote to us): ``disconnect`` with the address known. Afterwards nothing ``peer``
        posted before can be read from those connections (see ``closes_connections``); a later
        write or send either way opens a new one. What was already read is handled by the
        progress thread within two rounds (``progress_mark`` / ``progressed``). With several
        rails, the connections of every endpoint of ``peer``'s engine known on any rail end too."""
        self._peers.close_connection(peer)
        for rail in self._rails:
            for other in rail._peers.addresses_of(peer.engine_id):
                rail._peers.disconnect(other)

    def shut_down_sockets(self, peers: Iterable[PeerDescriptor]) -> SocketShutdown:
        """End every TCP connection of this engine's endpoints (every rail's) from outside
        libfabric: shutdown(2) of each socket whose local port is one of ours or whose remote end
        is one of ``peers``' fabric endpoints (fabric.sockets). The provider then reads
        end-of-stream and closes them as for a dead peer; poll the result's ``still_open`` for
        that. Never fi_av_remove (rxm 1.17 crashes on a half-received write there). tcp only:
        other address formats name no socket, so nothing is shut. Reads /proc; does not block."""
        own = {e for e in (endpoint_of(r.peer.address) for r in self.rails) if e is not None}
        remote = {e for e in (endpoint_of(p.address) for p in peers) if e is not None}
        return SocketShutdown(frozenset(shut_down(fabric_sockets(own, remote))))

    def progress_mark(self) -> int:
        """A mark of every rail's progress round now (for ``progressed``), after waking them.
        Opaque; the last _MAX_MARKS are remembered."""
        rounds = []
        for rail in self._rails:
            rail._ep.poke()
            rounds.append(rail._ep.generation)
        with self._rails_lock:
            self._mark_ids += 1
            self._marks[self._mark_ids] = tuple(rounds)
            while len(self._marks) > _MAX_MARKS:
                self._marks.popitem(last=False)
            return self._mark_ids

    def progressed(self, mark: int, rounds: int = 2) -> bool:
        """True once every rail's progress thread ran ``rounds`` full rounds since ``mark`` (so what
        had arrived by then was handled), or has stopped (a forgotten mark: True). Never blocks:
        for callers that poll, as an asyncio loop does after ``peer_gone`` (the blocking
        ``wait_peer_gone`` does it itself)."""
        with self._rails_lock:
            at = self._marks.get(mark)
        if at is None:
            return True
        # a rail opened after the mark had nothing to handle before it (strict=False)
        behind = [r._ep for r, start in zip(self._rails, at, strict=False) if r._ep.progress_alive()
                  and r._ep.generation < start + rounds]
        for ep in behind:
            ep.poke()
        if not behind:
            with self._rails_lock:
                self._marks.pop(mark, None)
        return not behind

    def peer_gone(self, peer: PeerDescriptor) -> bool:
        """True if ``peer`` said goodbye (on any rail), or (same host) its process has ended."""
        return any(rail._peers.peer_gone(peer) for rail in self._rails)

    def wait_peer_gone(self, peer: PeerDescriptor, timeout: float) -> bool:
        """Wait until no write from ``peer`` can land here any more.

        True when ``peer`` closed its engine (goodbye message), its process
        ended (same host), or a probe to it failed at the transport (its
        endpoint no longer exists); then what it had already sent has been
        drained by our progress thread. False when ``timeout`` passes while
        the peer still answers or cannot be judged: its writes may still land,
        so memory it targets must stay reserved (or be deregistered). With several rails the
        probes go on rail 0 and, once the peer is gone, every other rail is drained too.
        """
        others = self._rails[1:]
        if others and any(rail._peers.is_gone(peer.engine_id) for rail in others):
            self._peers.mark_gone(peer.engine_id)   # its goodbye came on another rail
        gone = self._peers.wait_peer_gone(peer, timeout)
        if gone:
            for rail in others:
                rail._peers.mark_gone(peer.engine_id)
                rail._peers.quiesce()
        return gone

    # -------------------------------------------------------------- writes

    def write(self, writes: PageWrites, on_done: OnDone, on_error: OnError) -> int:
        """Post ``writes`` (see PageWrites): entry i moves ``lengths[i]`` bytes from
        ``src_region + src_offsets[i]`` to ``dst + dst_offsets[i]``.

        ``imm`` (a tag, 0..IMM_TAG_MAX) is delivered to the receiver's
        ImmCounter: one unit per call with imm_mode "last", one unit per
        entry with "every" (config default), however entries contiguous at
        both ends were coalesced into fewer writes (config.coalesce).
        ``imm=None`` sends no immediate data. Exactly one of
        ``on_done()`` / ``on_error(FabricError)`` runs later on the progress
        thread. Everything is validated before anything is posted: bad
        values raise ValueError, bad handles FabricError. Returns the batch id (unique across
        rails). Posted on ``src_region``'s rail, to the endpoint ``dst`` names.
        """
        return self._rail_of(writes.src_region, "write_pages")._writes.write(writes, on_done, on_error)

    def write_sync(self, writes: PageWrites, *, timeout: float | None = None,
                   spin_us: int | None = None) -> SyncResult:
        """``write``, waiting for completion on the calling thread.

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
        fails). Validation as in write (and the rail: ``src_region``'s).
        """
        return self._rail_of(writes.src_region, "write_pages_sync")._writes.write_sync(writes, timeout, spin_us)

    # ------------------------------------------------------------ messages

    def send(self, peer: PeerDescriptor, payload: bytes) -> None:
        """Send ``payload`` to ``peer``'s ``on_message`` handler (best effort, ordered)."""
        self._ep.check_open()
        self._peers.send_control(peer, control.USER, 0, bytes(payload))

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Drain for up to close_timeout_s, say goodbye, fail the rest, release everything (every rail)."""
        ep = self._ep
        if ep.closed or ep.closing:
            return
        if any(r._ep.on_progress_thread() for r in self._rails):
            raise RuntimeError("TransferEngine.close() called from a fabric callback")
        with self._rails_lock:   # no rail opens from now on
            ep.closing = True
            rails = list(self._rails)
        for rail in rails[1:]:
            rail._ep.closing = True
        deadline = time.monotonic() + self.config.close_timeout_s
        while self.outstanding() and time.monotonic() < deadline:
            time.sleep(_DRAIN_POLL_S)
        for rail in rails:
            for peer in rail._peers.known_peers():
                try:
                    rail._peers.send_control(peer, control.BYE, 0)
                except FabricError as exc:
                    logger.info("goodbye to %r not sent: %s", peer, exc)
        bye_deadline = time.monotonic() + min(_BYE_TIMEOUT_S, self.config.close_timeout_s)
        while self.outstanding() and time.monotonic() < bye_deadline:
            time.sleep(_DRAIN_POLL_S)
        for rail in rails:
            rail._ep.stop()
        stale.mark_engine_closed(self.engine_id)
        for rail in rails:
            rail._ep.close_ep()  # the endpoint goes first, then the MRs it used
            rail._regions.close_all()
            rail._ep.release()
        logger.info("engine %s closed (%d rail%s)", self.engine_id[:8], len(rails), "s" if len(rails) > 1 else "")

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine({self.provider}, engine={self.engine_id[:8]})"

