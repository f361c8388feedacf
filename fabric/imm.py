"""ImmCounter: receiver-side counting of writes by their 32-bit immediate data.

Wire format of the immediate data (declared in csrc/pdf_core.h, packed and
unpacked only in csrc/pdf_core.c): the high 24 bits are the tag
(0..IMM_TAG_MAX), the low 8 bits a unit count. This module stays pure Python,
so it restates the 24 (tests/fabric/test_native_interface.py checks it). A
write that coalesces k of the caller's entries carries k units (imm_mode
"every"); the one tagged write of a batch carries 1 (imm_mode "last"). So
the counter counts the caller's entries, whatever the transport merged.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

IMM_TAG_BITS = 24
IMM_TAG_MAX = (1 << IMM_TAG_BITS) - 1
IMM_MAX = IMM_TAG_MAX  # the largest tag a caller may use
_MAX_TOMBSTONES = 65536


@dataclass
class _Expectation:
    count: int
    on_complete: Callable[[int], None]


class ImmCounter:
    """Counts landed units per tag (see the module docstring for units).

    ``expect(tag, count, on_complete)`` fires ``on_complete(tag)`` exactly
    once, when ``count`` units carrying ``tag`` have landed, in any order.
    Writes may land before ``expect``: counts for unknown tags are kept until
    claimed. ``cancel(tag)`` forgets the tag; writes for it that land later
    are dropped (they do not count towards a later ``expect`` of the tag)
    until the tag is expected again.

    Thread rules: any thread may call ``expect``/``cancel``/``landed``; the
    engine's progress thread reports arrivals. ``on_complete`` runs on the
    progress thread, or on the caller's thread when ``expect`` finds the count
    already reached; it must be short and must not block.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._landed: dict[int, int] = {}
        self._expect: dict[int, _Expectation] = {}
        self._cancelled: OrderedDict[int, int] = OrderedDict()
        self.dropped = 0  # writes that landed for cancelled tags
        # Called as on_orphan(tag, count), on the progress thread, for arrivals of a tag no expect
        # is waiting for (cancelled, or never expected / already completed), after they are
        # recorded as above; None: nobody is told.
        self.on_orphan: Callable[[int, int], None] | None = None

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not isinstance(tag, int) or not 0 <= tag <= IMM_MAX:
            raise ValueError(f"tag={tag!r}: expected an int in 0..{IMM_MAX}")

    def expect(self, tag: int, count: int, on_complete: Callable[[int], None]) -> None:
        """Call ``on_complete(tag)`` once ``count`` writes with ``tag`` landed."""
        self._check_tag(tag)
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"count={count!r} for tag {tag}: expected an int >= 1")
        if not callable(on_complete):
            raise TypeError(f"on_complete for tag {tag} is not callable: {on_complete!r}")
        with self._lock:
            if tag in self._expect:
                raise ValueError(f"tag {tag} is already expected ({self._expect[tag].count} writes)")
            self._cancelled.pop(tag, None)
            landed = self._landed.get(tag, 0)
            if landed < count:
                self._expect[tag] = _Expectation(count, on_complete)
                return
            self._settle(tag, landed - count)
        on_complete(tag)

    def cancel(self, tag: int) -> int:
        """Forget ``tag``; return how many of its writes had landed.

        The memory those writes target may be reused only once no write can
        still land: see ``TransferEngine.wait_peer_gone``.
        """
        self._check_tag(tag)
        with self._lock:
            self._expect.pop(tag, None)
            landed = self._landed.pop(tag, 0)
            self._cancelled[tag] = landed
            self._cancelled.move_to_end(tag)
            while len(self._cancelled) > _MAX_TOMBSTONES:
                self._cancelled.popitem(last=False)
        return landed

    def landed(self, tag: int) -> int:
        """Writes with ``tag`` landed and not yet claimed by a completed expect."""
        with self._lock:
            return self._landed.get(tag, 0)

    def _settle(self, tag: int, surplus: int) -> None:
        if surplus:
            logger.warning("tag %d: %d more writes landed than expected; kept as unclaimed", tag, surplus)
            self._landed[tag] = surplus
        else:
            self._landed.pop(tag, None)

    def on_landed(self, tag: int, count: int) -> None:
        """Record ``count`` arrivals of ``tag`` (called by the progress thread)."""
        fire: _Expectation | None = None
        with self._lock:
            exp = self._expect.get(tag)
            if tag in self._cancelled:
                self.dropped += count
            else:
                landed = self._landed.get(tag, 0) + count
                if exp is not None and landed >= exp.count:
                    del self._expect[tag]
                    self._settle(tag, landed - exp.count)
                    fire = exp
                else:
                    self._landed[tag] = landed
        if exp is None and self.on_orphan is not None:
            self.on_orphan(tag, count)
        if fire is not None:
            fire.on_complete(tag)
