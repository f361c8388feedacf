"""Key rotation (--rotate-key-after, DecodeNodeConfig.rotate_key_after_s; off by default: a
rotation's failover of every transfer in flight is not yet retried on the same node, issue 33): the
crash-free release of holds whose prefill side went silent, ended unfenced, or was replaced at its
address by another process. A rotation registers
the KV pool, the context landing area and the fence buffer again under new keys, fails over every
transfer in flight under the old ones, closes the old registrations, ends every fabric connection
open now (`TransferEngine.shut_down_sockets`) and drains; then every hold of an older generation is
released. Why that is sound, and where it is measured: docs/transfer-safety.md ("Key rotation").

`KeyRotation` owns the generations: `generation` is what tickets prepared now name (written on the
engine thread, in `swap_keys`, where tickets are prepared), `dead_below` the first generation whose
keys may still land (written on the loop once a rotation finished). Only on tcp;ofi_rxm.

Threads: `swap_keys` on the engine thread (EngineThread.call); the rest on the serving loop.

Blocking waits, with their bounds: the registrations on the engine thread (one engine step's wait),
the fi_close of each old one (a worker thread), the provider's close of the shut-down sockets
(ROTATE_CLOSE_WAIT_S, polled; else retried next round) and a drain (quarantine.drain_arrivals); the
holds are looked at every ROTATE_POLL_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_messenger.decode.client import PrefillClient, TransferTelemetry
from kv_messenger.decode.quarantine import Quarantine, drain_arrivals
from kv_messenger.receiver import KvReceiver
from kv_messenger.transport import MemoryRegion, TransferEngine

if TYPE_CHECKING:
    from pdserve.engine.engine_thread import EngineThread

logger = logging.getLogger(__name__)

# A suggested --rotate-key-after: a hold this old whose prefill side is silent or ended unfenced: long
# enough that a slow but live prefill node answers first (its abort is re-sent with backoff up to
# HOLD_BACKOFF_MAX_S), short enough that a dead host's pages come back within seconds.
SUGGESTED_ROTATE_KEY_AFTER_S = 10.0
ROTATE_POLL_S = 0.5          # --rotate-key-after: the holds are looked at this often
ROTATE_CLOSE_WAIT_S = 5.0    # a rotation's shut-down fabric sockets are closed within this, or it retries


def rotation_supported(transport: TransferEngine) -> bool:
    """Whether a rotation is measured to stop every old write here: tcp;ofi_rxm only (shm checks no
    key; verbs/efa are not measured)."""
    return transport.closes_connections and transport.provider.startswith("tcp")


class KeyRotation:
    """The memory-key generations of one decode node and the rotation that advances them."""

    def __init__(self, transport: TransferEngine, receiver: KvReceiver, telemetry: TransferTelemetry,
                 rotate_after_s: float | None, stall_s: float) -> None:
        self.transport = transport
        self.receiver = receiver
        self.telemetry = telemetry
        self.rotate_after_s = rotate_after_s
        self.stall_s = stall_s
        # Tickets prepared now name generation `generation` (written on the engine thread); every
        # generation below `dead_below` has its registrations closed and every fabric connection
        # open at that close ended, so no write under its keys can land any more.
        self.generation = 0
        self.dead_below = 0
        self._retired_regions: list[MemoryRegion] = []   # registrations replaced by a rotation, not closed yet

    def key_dead(self, key_gen: int) -> bool:
        """No write under the keys of generation `key_gen` can land any more (a rotation finished)."""
        return key_gen < self.dead_below

    def due(self, held: list[Quarantine]) -> list[Quarantine]:
        """The holds that ask for a rotation: older than rotate_after_s, their keys still live
        (or a rotation left unfinished), and either their prefill node unanswering for stall_s (a
        silent death) or their abort ended there unfenced (a fabric-only partition, heavy loss: the
        node answers, but no fence can prove delivery). One rotation releases them all: every hold
        of an older generation is released by it, not only the ones that asked."""
        after = self.rotate_after_s
        assert after is not None
        now = time.monotonic()
        return [q for q in held
                if not self.key_dead(q.key_gen) and now - q.since >= after
                and (q.ended_unfenced or now - q.node.last_answer > self.stall_s)]

    async def run(self, engine: EngineThread, pool: PrefillClient, held: Callable[[], list[Quarantine]]) -> None:
        """The loop's rotation task: one rotation at a time (awaited here, never started twice): a
        hold that asks while one is under way is released by it or, if it was prepared under the
        new key, asks the next round."""
        while True:
            await asyncio.sleep(ROTATE_POLL_S)
            due = self.due(held())
            if not due:
                continue
            try:
                await self.rotate(engine, pool, due)
            except Exception as e:   # never let the loop die: the holds would stay unanswered unseen
                logger.error("KV key rotation for %d holds (request %s attempt %d first) failed (%s: %s); retrying in "
                             "%.1f s", len(due), due[0].request_id, due[0].attempt, type(e).__name__, e,
                             ROTATE_POLL_S)

    def swap_keys(self) -> tuple[MemoryRegion, ...]:
        """Engine thread (where tickets are prepared): new registrations, the next generation."""
        old = self.receiver.rotate_keys()
        self.generation += 1
        return old

    async def rotate(self, engine: EngineThread, pool: PrefillClient, due: list[Quarantine]) -> None:
        """Make every write under the keys up to now unable to land: register the pool again (new
        tickets name it), fail over the transfers in flight under the old keys, close the old
        registrations (the target refuses a write under a closed key as it arrives), then end every
        fabric connection open now (a write whose key was checked before the close may still be
        copying) and drain; then every hold of those generations is released."""
        if self.generation == self.dead_below:   # else a rotation is unfinished: finish it
            self._retired_regions.extend(await engine.call(self.swap_keys))
            now = time.monotonic()
            why = "; ".join(f"request {q.request_id} attempt {q.attempt} quarantined {now - q.since:.1f} s, prefill "
                            f"node {q.node.address} " + ("ended it unfenced" if q.ended_unfenced else "answers nothing")
                            for q in due[:4]) + (f"; and {len(due) - 4} more" if len(due) > 4 else "")
            logger.warning("rotating the KV memory key (generation %d) for %d holds (%s); every transfer in flight "
                           "under the old key fails over", self.generation, len(due), why)
        target = self.generation
        while self._retired_regions:
            await asyncio.to_thread(self.transport.deregister, self._retired_regions[0])   # fi_close
            self._retired_regions.pop(0)
        peers = [n.peer for n in pool.nodes if n.peer is not None]
        shut = await asyncio.to_thread(self.transport.shut_down_sockets, peers)
        end = time.monotonic() + ROTATE_CLOSE_WAIT_S
        while left := shut.still_open():
            if time.monotonic() > end:
                logger.warning("KV key rotation: %d of %d fabric sockets still open %.0f s after their shutdown; "
                               "retrying", len(left), len(shut.inodes), ROTATE_CLOSE_WAIT_S)
                return
            await asyncio.sleep(0.01)
        await drain_arrivals(self.transport)
        self.dead_below = target
        self.telemetry.kv_key_rotations.inc()
        logger.warning("KV memory key rotated (generation %d): old registrations closed, %d fabric connections "
                       "ended; the quarantines held under the old keys are released", target, len(shut.inodes))
