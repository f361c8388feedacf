"""The KV sender's context records on their way out (D12, D19, S7, S8): the registered staging slots
a record waits in until its write completed, its encoding from the transfer's ticket, its hash, and
the test-only damage a fault plan asks for.

Owns `ContextStaging`: a bounded SlotPool (KvSender's `staging_slots`: a prefill that finds it
full fails alone with StagingFullError, RESOURCE_EXHAUSTED, never the engine step), the staging
buffer and codec the pool registration made (kv_messenger.pool), and the fault plan's
`bad_context` (pdserve.engine.faults; a prefill node's entry point reads it from
$PDSERVE_TEST_ONLY_BAD_CONTEXT="PREFIX:KIND:N[,...]"): the records of attempts 0 .. N-1 of every
request whose id starts with PREFIX are damaged after encoding and before they are hashed and
posted, one way (KIND, ContextCodec.damage: "flip" a body byte, a wrong "version", or another
request's "identity"), logged as a warning (TEST ONLY), for the tests that prove the decode side
rejects them (tests/integration/test_context_record_cluster.py). Without a plan: no effect.

Threads: `take` / `give` under the sender's lock (the engine thread at prefill done; the messenger
or progress thread once the record's write completed); `encode` on the engine thread and `crc` on
the messenger thread, each on a slot only its holder touches. Nothing here blocks.
"""

from __future__ import annotations

import logging

import numpy as np

from fabric import MemoryRegion
from kv_messenger import checksum
from kv_messenger.context import DAMAGES, ContextCodec, SlotPool, Staging, TransferIdentity
from kv_messenger.ticket import TransferTicket
from pdserve.engine.faults import BAD_CONTEXT_ENV, NO_FAULTS, BadContext, FaultPlan
from pdserve.engine.kv_connector import PrefillDone

logger = logging.getLogger(__name__)


def checked_damages(entries: tuple[BadContext, ...]) -> tuple[BadContext, ...]:
    """ValueError naming an entry whose KIND is not one of context.DAMAGES."""
    for b in entries:
        if b.kind not in DAMAGES:
            raise ValueError(f"{BAD_CONTEXT_ENV}: expected PREFIX:KIND:N entries with KIND one of {DAMAGES}, "
                             f"got {b.prefix}:{b.kind}:{b.attempts}")
    return entries


def _identity(target: TransferTicket) -> TransferIdentity:
    """The transfer a record names (D20): the request, the decode engine, the attempt and its tag."""
    return TransferIdentity(target.request_id, target.context.peer.engine_id, target.attempt, target.imm_tag)


class ContextStaging:
    """The sender's outgoing context records; `attach` the codec and buffer once the pool is registered."""

    def __init__(self, slots: SlotPool, faults: FaultPlan = NO_FAULTS) -> None:
        self.slots = slots
        self.codec: ContextCodec | None = None
        self._staging: Staging | None = None
        self._faults = faults
        if checked_damages(faults.bad_context):
            logger.warning("TEST ONLY: %r: those requests' attempts get a damaged context record", faults.bad_context)

    def attach(self, codec: ContextCodec, staging: Staging) -> None:
        self.codec, self._staging = codec, staging

    @property
    def region(self) -> MemoryRegion:
        """The staging buffer's registration (the source of every record's write)."""
        return self._staging.region

    def take(self, transfer_key: str) -> int:
        """A free slot (under the sender's lock); StagingFullError naming the transfer when none is."""
        return self.slots.take(transfer_key)

    def give(self, slot: int) -> None:
        """The slot's record was written, or never will be (under the sender's lock)."""
        self.slots.give(slot)

    def encode(self, slot: int, target: TransferTicket, done: PrefillDone) -> None:
        """Write the record of `done` for `target`'s transfer into `slot`; ValueError for a hidden
        state or logits of the wrong shape (the caller fails that transfer alone)."""
        # done.hidden: [hidden_size] of position num_prefill_tokens - 1; done.logits: [vocab]
        self.codec.encode_into(self._staging, slot, done.hidden, done.logits, _identity(target),
                               target.num_prefill_tokens - 1)

    def extent(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """The slot's byte offset in the staging buffer and its length: ([1], [1]) uint64."""
        return (np.asarray([self.codec.slot_offset(slot)], dtype=np.uint64),
                np.asarray([self.codec.slot_nbytes], dtype=np.uint64))

    def crc(self, slot: int) -> int:
        """S7: CRC32C of the record as it will be posted."""
        off, lengths = self.extent(slot)
        region = self._staging.region
        return int(checksum.crc32c_runs_at(region.address, region.length, off, lengths)[0])

    def test_damage(self, slot: int, target: TransferTicket) -> None:
        """TEST ONLY (FaultPlan.bad_context): damage the record just encoded. No effect without a plan."""
        kind = self._faults.context_damage(target.request_id, target.attempt)
        if kind is not None:
            ident = _identity(target)
            other = TransferIdentity(f"{ident.request_id}~other", ident.decode_engine_id, ident.attempt,
                                     ident.imm_tag)
            how = self.codec.damage(self._staging, slot, kind, other)
            logger.warning("TEST ONLY (%s): request %s attempt %d: context record damaged: %s",
                           BAD_CONTEXT_ENV, target.request_id, target.attempt, how)
