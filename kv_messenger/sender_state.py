"""The KV sender's bookkeeping (kv_messenger.sender): one transfer it took on (`OutgoingTransfer`),
the forward passes that compute its chunks (`ForwardPass`, `PassItem`), what a finished transfer
reports (`TransferResult`) and the two ways a transfer fails inside the sender (`PassFailedError`,
`PostError`). Plain data: the sender's lock guards every object here (engine thread, messenger
thread, fabric progress thread, the owner's loop); nothing here blocks or locks.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import numpy as np

from fabric import FabricError
from kv_messenger import checksum
from kv_messenger.context import ContextEncodeError, StagingFullError
from kv_messenger.shard_plan import ShardPlan
from kv_messenger.ticket import TransferTicket


class PassFailedError(RuntimeError):
    """The forward pass computing a chunk of this transfer failed before its last layer (the step
    raised): the chunk's later layers will never be written. Not a StatusError: the prefill node
    answers with the engine's own error for the step (EngineThread fails every request of it)."""


class PostError(RuntimeError):
    """Posting a transfer's writes raised something other than a fabric error (a bug, not the
    network): the transfer fails with it (once its posted writes settle) and the messenger thread
    goes on with the others."""


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    num_writes: int
    bytes_written: int
    first_post_time: float          # time.monotonic() of the first posted write
    last_layer_time: float          # when the last layer of the last chunk finished computing
    done_time: float                # when the last write completed locally
    layer_post_times: tuple[float, ...]  # first post time of each layer (overlap evidence)
    kv_checksums: bytes = b""       # with ticket.kv_checksum: checksum.pack of every run, canonical order
    num_kv_checksums: int = 0


@dataclass
class OutgoingTransfer:
    """One transfer the sender took on (KvSender.add), until its future resolves."""

    target: TransferTicket
    future: concurrent.futures.Future
    plan: ShardPlan            # which runs of each page go from which of our ranks to which decode rank
    key: str = ""              # the engine's request id for the transfer (KvSender.add)
    # per attention group (KvCacheSpec.groups order), the request's pages: filled at schedule time
    src_tables: list[list[int]] = field(default_factory=list)
    # per layer: (first request page sent, its destination pages), from the ticket
    layer_targets: tuple[tuple[int, tuple[int, ...]], ...] = ()
    posted_writes: int = 0
    posted_bytes: int = 0
    outstanding: int = 0       # write batches not yet completed
    all_posted: bool = False
    error: FabricError | StagingFullError | ContextEncodeError | PassFailedError | PostError | None = None
    aborted: bool = False
    first_post: float = 0.0
    last_layer: float = 0.0
    layer_posts: dict[int, float] = field(default_factory=dict)
    # Request pages [0, pages_claimed) belong to a pass already: every later pass starts here.
    # A prompt whose leading pages were prefix-cache hits starts computing mid-prompt; those
    # pages hold valid KV at every layer, so the first pass sends them too.
    pages_claimed: int = 0
    # S7: per layer, [plan runs, 2 (K, V), pages that layer sends] CRC32C of each posted entry; and
    # of the context record
    checksums: list[np.ndarray] | None = None
    context_crc: int = 0

    def result(self, num_layers: int, done_time: float) -> TransferResult:
        """What the transfer did, once every write of it completed locally (at `done_time`)."""
        posts = tuple(self.layer_posts.get(i, 0.0) for i in range(num_layers))
        sums, n_sums = b"", 0
        if self.checksums is not None:
            values = np.concatenate([c.reshape(-1) for c in self.checksums]
                                    + [np.asarray([self.context_crc], np.uint32)])   # [entries + 1]
            sums, n_sums = checksum.pack(values), int(values.size)
        return TransferResult(self.key, self.posted_writes, self.posted_bytes, self.first_post, self.last_layer,
                              done_time, posts, sums, n_sums)


@dataclass
class PassItem:
    """The pages one chunk of a forward pass completes, for one transfer."""

    transfer: OutgoingTransfer
    pages: range               # request-relative page indices this chunk completes
    last_chunk: bool


@dataclass
class ForwardPass:
    """A forward pass that computes chunks of transfers, and how far it was computed and posted."""

    items: list[PassItem]
    layers_done: int = 0
    layers_posted: int = 0
    cut_short: bool = False    # its forward failed before its last layer: no more layers will come
