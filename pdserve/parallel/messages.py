"""The leader -> worker messages of a tensor-parallel engine, over each worker's control pipe.

One message per forward pass (`StepMessage`: the runner's batch, what every rank's layer loop
needs, and how many of the layers: all, or a self-draft's first k) and one to stop. Wire form: an
8-byte little-endian length, then that many bytes of int64 values: [kind, T, S, number of batches,
number of layers or -1 for all, then per batch (max_pages, num_decode, page_size, window or -1)],
then the data: input_ids [T], positions [T], query_start [S + 1], context_lens [S], and
per batch block_tables [S * max_pages], slot_pages [T], slot_offsets [T]. No pickling: a worker
decodes numbers only. kv_rows (which depend on the rank's KV head count) are rebuilt on the rank.

Bounds (every blocking call on the channel):
- `write_message`: the whole message must be taken by the pipe within `timeout_s`
  (MESSAGE_TIMEOUT_S by default; the leader's end is non-blocking and polled). A rank that is
  alive but not reading (wedged, SIGSTOPped, swapped out) lets a message larger than the free
  pipe space block: ChannelTimeout names the rank, the bound and the bytes taken.
- `read_message`: once a message's length has arrived, its body must arrive within `timeout_s`
  (MESSAGE_TIMEOUT_S; the leader writes a message in one go). The wait for the next message to
  begin has no timer by design (an idle engine sends nothing for hours): it ends at the leader's
  death (end of file) and the worker's watchdog (pdserve/parallel/worker.py) bounds it too.
"""

from __future__ import annotations

import os
import select
import struct
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.attention.base import AttentionBatch

KIND_STEP = 1
KIND_STOP = 2
_LEN = struct.Struct("<Q")
# The same bound as a pass's collectives (pdserve/parallel/group.py COLLECTIVE_TIMEOUT_S): a rank
# that cannot take its message within it would fail the pass's first collective anyway.
MESSAGE_TIMEOUT_S = 60.0


class ChannelTimeout(TimeoutError):
    """A control-pipe message to or from a rank did not pass within its bound."""

    def __init__(self, rank: int, what: str, timeout_s: float) -> None:
        super().__init__(f"rank {rank}'s control pipe: {what} within {timeout_s:g} s "
                         f"(the rank is alive but not reading, or its peer stalled mid-message)")
        self.rank, self.timeout_s = rank, timeout_s


@dataclass(frozen=True)
class StepMessage:
    """One forward pass's inputs, as every rank runs them."""

    input_ids: torch.Tensor                # [T] int64
    positions: torch.Tensor                # [T] int64
    batches: tuple[AttentionBatch, ...]    # one per distinct (group, window) of the model's layers
    num_layers: int | None = None          # run only the first num_layers layers (a self-draft's pass)

    def __post_init__(self) -> None:
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"a step message runs at least one layer, not num_layers={self.num_layers}")

    def encode(self) -> bytes:
        b0 = self.batches[0]
        T, S = int(self.input_ids.shape[0]), int(b0.context_lens.shape[0])
        head = [KIND_STEP, T, S, len(self.batches), -1 if self.num_layers is None else self.num_layers]
        for b in self.batches:
            head += [int(b.block_tables.shape[1]), b.num_decode, b.page_size, -1 if b.window is None else b.window]
        parts = [torch.tensor(head, dtype=torch.int64), self.input_ids, self.positions,
                 b0.query_start.to(torch.int64), b0.context_lens.to(torch.int64)]
        for b in self.batches:
            parts += [b.block_tables.to(torch.int64).reshape(-1), b.slot_pages, b.slot_offsets]
        return torch.cat(parts).numpy().tobytes()

    @staticmethod
    def decode(payload: bytes, kv_heads: int) -> StepMessage:
        """The message of `payload` (KIND_STEP), with kv_rows for a pool of `kv_heads` heads per page."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.int64)   # [n]
        kind, T, S, nb, layers = (int(v) for v in flat[:5])
        if kind != KIND_STEP:
            raise ValueError(f"not a step message (kind {kind})")
        metas = [tuple(int(v) for v in flat[5 + 4 * i : 9 + 4 * i]) for i in range(nb)]
        at = 5 + 4 * nb

        def take(n: int) -> torch.Tensor:
            nonlocal at
            t = flat[at : at + n]
            at += n
            return t

        input_ids, positions = take(T), take(T)
        query_start, context_lens = take(S + 1).to(torch.int32), take(S).to(torch.int32)
        q_lens = tuple(int(v) for v in (query_start[1:] - query_start[:-1]))
        ctx_lens = tuple(int(v) for v in context_lens)
        heads = torch.arange(kv_heads)                                          # [H]
        batches = []
        for max_pages, num_decode, page_size, window in metas:
            tables = take(S * max_pages).view(S, max_pages).to(torch.int32)    # [S, max_pages]
            pages, offs = take(T), take(T)                                      # [T] each
            kv_rows = ((pages[:, None] * kv_heads + heads[None, :]) * page_size + offs[:, None]).reshape(-1)
            batches.append(AttentionBatch(query_start=query_start, context_lens=context_lens, block_tables=tables,
                                          slot_pages=pages, slot_offsets=offs, kv_rows=kv_rows,
                                          num_decode=num_decode, q_lens=q_lens, ctx_lens=ctx_lens,
                                          page_size=page_size, window=None if window < 0 else window))
        if at != flat.shape[0]:
            raise ValueError(f"step message has {flat.shape[0]} values, decoded {at}")
        return StepMessage(input_ids, positions, tuple(batches), None if layers < 0 else layers)


def stop_payload() -> bytes:
    return struct.pack("<q", KIND_STOP)


def payload_kind(payload: bytes) -> int:
    return struct.unpack_from("<q", payload)[0]


def write_message(fd: int, payload: bytes, rank: int, timeout_s: float = MESSAGE_TIMEOUT_S) -> None:
    """One message onto rank `rank`'s pipe, all of it within `timeout_s` (ChannelTimeout if not).

    `fd` is made non-blocking (the leader's end only: the two ends of a pipe are separate open files)."""
    os.set_blocking(fd, False)
    data = memoryview(_LEN.pack(len(payload)) + payload)
    total = len(data)
    deadline = time.monotonic() + timeout_s
    poller = select.poll()   # poll, not select: a server's fds may number over FD_SETSIZE
    poller.register(fd, select.POLLOUT)
    while data:
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            n = 0
        data = data[n:]
        if not data:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelTimeout(rank, f"only {total - len(data)} of a {total}-byte message was taken", timeout_s)
        poller.poll(max(1, int(left * 1000)))


def read_message(fd: int, rank: int, timeout_s: float = MESSAGE_TIMEOUT_S) -> bytes | None:
    """The next message from a pipe, or None at end of file (the leader is gone). Waits for a message
    to begin without a timer (module docstring); its body must follow within `timeout_s`."""
    head = _read_exactly(fd, _LEN.size, None, rank, timeout_s)
    if head is None:
        return None
    return _read_exactly(fd, _LEN.unpack(head)[0], time.monotonic() + timeout_s, rank, timeout_s)


def _read_exactly(fd: int, n: int, deadline: float | None, rank: int, timeout_s: float) -> bytes | None:
    """`n` bytes, or None at end of file; deadline None: the clock starts once the first bytes came."""
    chunks, left = [], n
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while left:
        if deadline is None and chunks:
            deadline = time.monotonic() + timeout_s
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not poller.poll(max(1, int(wait * 1000))):
                raise ChannelTimeout(rank, f"{n - left} of a {n}-byte message arrived", timeout_s)
        b = os.read(fd, left)
        if not b:
            return None
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)
