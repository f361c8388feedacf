"""The leader -> worker messages of a tensor-parallel engine, over each worker's control pipe.

One message per forward pass (`StepMessage`: the runner's batch, what every rank's layer loop
needs) and one to stop. Wire form: an 8-byte little-endian length, then that many bytes of int64
values: [kind, T, S, number of batches, then per batch (max_pages, num_decode, page_size, window
or -1)], then the data: input_ids [T], positions [T], query_start [S + 1], context_lens [S], and
per batch block_tables [S * max_pages], slot_pages [T], slot_offsets [T]. No pickling: a worker
decodes numbers only. kv_rows (which depend on the rank's KV head count) are rebuilt on the rank.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

from pdserve.kernels.attention.base import AttentionBatch

KIND_STEP = 1
KIND_STOP = 2
_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class StepMessage:
    """One forward pass's inputs, as every rank runs them."""

    input_ids: torch.Tensor                # [T] int64
    positions: torch.Tensor                # [T] int64
    batches: tuple[AttentionBatch, ...]    # one per distinct (group, window) of the model's layers

    def encode(self) -> bytes:
        b0 = self.batches[0]
        T, S = int(self.input_ids.shape[0]), int(b0.context_lens.shape[0])
        head = [KIND_STEP, T, S, len(self.batches)]
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
        kind, T, S, nb = (int(v) for v in flat[:4])
        if kind != KIND_STEP:
            raise ValueError(f"not a step message (kind {kind})")
        metas = [tuple(int(v) for v in flat[4 + 4 * i : 8 + 4 * i]) for i in range(nb)]
        at = 4 + 4 * nb

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
        return StepMessage(input_ids, positions, tuple(batches))


def stop_payload() -> bytes:
    return struct.pack("<q", KIND_STOP)


def payload_kind(payload: bytes) -> int:
    return struct.unpack_from("<q", payload)[0]


def write_message(fd: int, payload: bytes) -> None:
    """One message onto a pipe (blocks while the pipe is full: the worker reads it at once)."""
    data = memoryview(_LEN.pack(len(payload)) + payload)
    while data:
        n = os.write(fd, data)
        data = data[n:]


def read_message(fd: int) -> bytes | None:
    """The next message from a pipe, or None at end of file (the leader is gone)."""
    head = _read_exactly(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exactly(fd, _LEN.unpack(head)[0])
    if body is None:
        return None
    return body


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        b = os.read(fd, left)
        if not b:
            return None
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)
