"""ImmCounter: receiver-side counting of writes by their 32-bit immediate data.

Wire format of the immediate data (declared in csrc/pdf_core.h, packed and
unpacked only in csrc/pdf_core.c): the high 24 bits are the tag
(0..IMM_TAG_MAX), the low 8 bits a unit count. This module stays pure Python,
so it restates the 24 (tests/fabric/test_native_interface.py checks it). A
write that coalesces k of the caller's entries carries k units (imm_mode
"every"); the one tagged write of a batch carries 1 (imm_mode "last"). So
the counter counts the caller's entries, whatever the transport merged.

Who wrote (issue 15 item 6, S9): every immediate-data event carries the writer's address as the
provider reports it (fi_cq_readfrom, FI_SOURCE; csrc PDF_EV_IMM's aux), which each rail of the
engine maps to the peer inserted there in its AV (``writer_id``). Where the provider names the writer of a remote write
(``names_writers``), an ``expect`` bound to a writer counts only that engine's writes; any other
engine's, and a writer not in the AV (FI_ADDR_NOTAVAIL: WRITER_UNKNOWN), never count toward it and
are reported to ``on_foreign``. Which providers name writers (``provider_names_writers``), from
their libfabric sources and checked here (tests/fabric/test_imm_source.py):
- efa: yes. Its RDMA-write-with-immediate completion looks the writer up by the source QP the
  NIC reports (prov/efa/src/rdm/efa_rdm_cq.c, efa_av_reverse_lookup_rdm + ofi_cq_write_src; 1.17:
  rxr_cq.c writes rx_entry->addr). Not run on this machine (no EFA NIC).
- tcp;ofi_rxm, verbs;ofi_rxm: no. rxm writes a remote write's completion without a source (1.17
  prov/rxm/src/rxm_cq.c rxm_handle_remote_write: rxm_cq_write, no address, so fi_cq_readfrom
  returns whatever the CQ's address slot last held; libfabric main passes FI_ADDR_NOTAVAIL
  explicitly). Measured here: writes of three engines all report address 0.
- shm: no. Its RMA completion reports the command's header id unconverted (1.17
  prov/shm/src/smr_progress.c smr_progress_cmd_rma -> smr_complete_rx(..., cmd->msg.hdr.id ...)),
  not our AV's address for the writer; measured: three writers all report 0. (shm cannot be
  protected at the target anyway: any process on the host that can reach it can write its
  memory, process_vm_writev.)
Where writers are not named, expectations count every write with their tag, as before: a third
engine that knows a region's key and a live tag is indistinguishable from the engine it was sent
to (the target-side defence there is the memory key: rotate it, kv_messenger.decode.rotation).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fabric.descriptors import PeerDescriptor

logger = logging.getLogger(__name__)

IMM_TAG_BITS = 24
IMM_TAG_MAX = (1 << IMM_TAG_BITS) - 1
IMM_MAX = IMM_TAG_MAX  # the largest tag a caller may use
_MAX_TOMBSTONES = 65536
# The writer of a write whose source address is in no AV entry (FI_ADDR_NOTAVAIL), where the
# provider names writers. Never an engine id (those are hex).
WRITER_UNKNOWN = "<not in the AV>"
# Providers whose remote-write completions name the writer (see the module docstring), matched
# against the provider name's components ("efa", "efa-direct"...; "tcp;ofi_rxm" is rxm's).
_WRITER_NAMING = ("efa",)


def provider_names_writers(provider: str, source_addr: bool) -> bool:
    """Whether an endpoint of `provider` that was granted FI_SOURCE (`source_addr`) learns the
    writer of every remote write with immediate data (see the module docstring)."""
    if not source_addr:
        return False
    parts = [p.strip() for p in provider.split(";")]
    if any(p.startswith("ofi_rxm") or p == "shm" for p in parts):
        return False
    return any(p.startswith(w) for p in parts for w in _WRITER_NAMING)


def writer_id(peer: PeerDescriptor | None) -> str:
    """The writer to report for the peer found at a write's source address (a PeerDescriptor, or
    None when no AV entry is there: WRITER_UNKNOWN)."""
    return WRITER_UNKNOWN if peer is None else peer.engine_id


# on_foreign(tag, count, writer, expected): `count` writes of `tag` came from `writer` (an engine
# id, or WRITER_UNKNOWN), not from the engine `expected` the tag's expectation is bound to.
OnForeign = Callable[[int, int, str, str], None]


@dataclass
class _Expectation:
    count: int
    on_complete: Callable[[int], None]
    writer: str | None = None   # only this engine's writes count (where writers are named)


class ImmCounter:
    """Counts landed units per tag (see the module docstring for units and writers).

    ``expect(tag, count, on_complete, writer=None)`` fires ``on_complete(tag)`` exactly once, when
    ``count`` units carrying ``tag`` have landed, in any order (with ``writer``, where writers are
    named: units written by that engine). Writes may land before ``expect``: counts for unknown
    tags are kept, by writer, until claimed (a claim bound to a writer reports the others as
    foreign). ``cancel(tag)`` forgets the tag; writes for it that land later are dropped (they do
    not count towards a later ``expect`` of the tag) until the tag is expected again.

    ``names_writers``: the transport names the writer of every arrival (``on_landed``'s
    ``writer``: an engine id, or WRITER_UNKNOWN); False (the default): it does not, and every
    write counts whoever sent it.

    Thread rules: any thread may call ``expect``/``cancel``/``landed``; the
    engine's progress thread reports arrivals. ``on_complete``, ``on_orphan`` and ``on_foreign``
    run on the progress thread, or on the caller's thread when ``expect`` finds the count
    already reached (or foreign writes among those kept); they must be short and must not block.
    """

    def __init__(self, names_writers: bool = False) -> None:
        self._lock = threading.Lock()
        self._names_writers = bool(names_writers)
        self._landed: dict[int, dict[str | None, int]] = {}   # tag -> writer (None: not named) -> units
        self._expect: dict[int, _Expectation] = {}
        self._cancelled: OrderedDict[int, int] = OrderedDict()
        self.dropped = 0  # writes that landed for cancelled tags
        self.foreign = 0  # writes of an expected tag from another engine than the one it is bound to
        # Called as on_orphan(tag, count, writer), on the progress thread, for arrivals of a tag no
        # expect is waiting for (cancelled, or never expected / already completed), after they are
        # recorded as above; writer: an engine id, WRITER_UNKNOWN, or None (writers not named).
        # None: nobody is told.
        self.on_orphan: Callable[[int, int, str | None], None] | None = None
        # Called for writes that did not count because another engine wrote them (OnForeign);
        # None: they are only counted in `foreign`.
        self.on_foreign: OnForeign | None = None

    @property
    def names_writers(self) -> bool:
        """Each arrival names its writer, so ``expect(..., writer=...)`` is enforced."""
        return self._names_writers

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not isinstance(tag, int) or not 0 <= tag <= IMM_MAX:
            raise ValueError(f"tag={tag!r}: expected an int in 0..{IMM_MAX}")

    def expect(self, tag: int, count: int, on_complete: Callable[[int], None], writer: str | None = None) -> None:
        """Call ``on_complete(tag)`` once ``count`` writes with ``tag`` landed (from ``writer``
        only, an engine id, where writers are named; None: from anyone)."""
        self._check_tag(tag)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r} for tag {tag}: expected an int >= 1")
        if not callable(on_complete):
            raise TypeError(f"on_complete for tag {tag} is not callable: {on_complete!r}")
        if writer is not None and (not isinstance(writer, str) or not writer or writer == WRITER_UNKNOWN):
            raise ValueError(f"writer={writer!r} for tag {tag}: expected an engine id or None")
        bound = writer if self.names_writers else None
        foreign: dict[str, int] = {}
        with self._lock:
            if tag in self._expect:
                raise ValueError(f"tag {tag} is already expected ({self._expect[tag].count} writes)")
            self._cancelled.pop(tag, None)
            kept = self._landed.pop(tag, {})
            if bound is not None:
                foreign = {w: n for w, n in kept.items() if w != bound}
                self.foreign += sum(foreign.values())
                landed = kept.get(bound, 0)
            else:
                landed = sum(kept.values())
            if landed < count:
                if landed:
                    self._landed[tag] = {bound: landed}
                self._expect[tag] = _Expectation(count, on_complete, bound)
            else:
                self._settle(tag, bound, landed - count)
        self._report_foreign(tag, foreign, bound)
        if landed >= count:
            on_complete(tag)

    def cancel(self, tag: int) -> int:
        """Forget ``tag``; return how many of its writes had landed.

        The memory those writes target may be reused only once no write can
        still land: see ``TransferEngine.wait_peer_gone``.
        """
        self._check_tag(tag)
        with self._lock:
            self._expect.pop(tag, None)
            landed = sum(self._landed.pop(tag, {}).values())
            self._cancelled[tag] = landed
            self._cancelled.move_to_end(tag)
            while len(self._cancelled) > _MAX_TOMBSTONES:
                self._cancelled.popitem(last=False)
        return landed

    def landed(self, tag: int) -> int:
        """Writes with ``tag`` landed and not yet claimed by a completed expect (foreign ones
        excluded once the tag is expected)."""
        with self._lock:
            return sum(self._landed.get(tag, {}).values())

    def _settle(self, tag: int, writer: str | None, surplus: int) -> None:
        if surplus:
            logger.warning("tag %d: %d more writes landed than expected; kept as unclaimed", tag, surplus)
            self._landed[tag] = {writer: surplus}
        else:
            self._landed.pop(tag, None)

    def _report_foreign(self, tag: int, foreign: dict[str, int], expected: str | None) -> None:
        if expected is None or self.on_foreign is None:
            return
        for writer, n in foreign.items():
            self.on_foreign(tag, n, writer, expected)

    def on_landed(self, tag: int, count: int, writer: str | None = None) -> None:
        """Record ``count`` arrivals of ``tag`` written by engine ``writer`` (WRITER_UNKNOWN: an
        address in no AV entry; None: not named), called by the progress thread."""
        if not self._names_writers:
            writer = None
        fire: _Expectation | None = None
        foreign = False
        with self._lock:
            exp = self._expect.get(tag)
            if tag in self._cancelled:
                self.dropped += count
            elif exp is not None and exp.writer is not None and writer != exp.writer:
                self.foreign += count   # never counted toward the expectation
                foreign = True
            else:
                per = self._landed.setdefault(tag, {})
                per[writer] = per.get(writer, 0) + count
                landed = per[writer] if exp is not None and exp.writer is not None else sum(per.values())
                if exp is not None and landed >= exp.count:
                    del self._expect[tag]
                    self._landed.pop(tag, None)
                    self._settle(tag, writer, landed - exp.count)
                    fire = exp
        if foreign:
            assert exp is not None and exp.writer is not None and writer is not None
            self._report_foreign(tag, {writer: count}, exp.writer)
            return
        if exp is None and self.on_orphan is not None:
            self.on_orphan(tag, count, writer)
        if fire is not None:
            fire.on_complete(tag)
