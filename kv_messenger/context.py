"""The context handed from prefill to decode (D12, D17): the final hidden state of the last
prefilled position and the top-k of its next-token distribution, in a fixed-size slot.

slot: [hidden_size float32][k int32 token ids][k float32 logprobs]

The sender's staging slots are a bounded pool (`SlotPool`): a prefill that finds it full fails on
its own with StagingFullError (RESOURCE_EXHAUSTED), never the engine step that finished it (S8).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch

from fabric import MemoryRegion
from pdserve.engine.cache.hostmem import HostBuffer, alloc_buffer
from pdserve_api.servers import StatusError

if TYPE_CHECKING:  # the engine class needs the compiled extension; this module does not
    from fabric import TransferEngine


@dataclass(frozen=True)
class Context:
    hidden: torch.Tensor          # [hidden_size] float32
    top_ids: torch.Tensor         # [k] int32
    top_logprobs: torch.Tensor    # [k] float32


class StagingFullError(StatusError):
    """Every context staging slot holds a context whose write has not completed: this prefill
    fails (RESOURCE_EXHAUSTED: the caller may retry elsewhere or later), the others go on."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class SlotPool:
    """`capacity` context slots, handed out and back (not thread-safe: the owner's lock guards it)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a context slot pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self._free: deque[int] = deque(range(capacity))

    def take(self, request_id: str) -> int:
        """A free slot; StagingFullError naming the request and the capacity when none is."""
        if not self._free:
            raise StagingFullError(f"request {request_id}: all {self.capacity} context staging slots hold "
                                   f"contexts still being written; retry later")
        return self._free.popleft()

    def give(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} outside 0..{self.capacity - 1}")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass
class Staging:
    buffer: HostBuffer            # owned here; the fabric registers its view
    region: MemoryRegion          # the registration of buffer.view
    array: np.ndarray             # uint8 view


class ContextCodec:
    def __init__(self, hidden_size: int, top_k: int = 32) -> None:
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.slot_nbytes = hidden_size * 4 + top_k * 8

    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_nbytes

    def alloc_staging(self, fabric_engine: TransferEngine, slots: int) -> Staging:
        """A registered buffer of `slots` context slots (sender staging or receiver landing area)."""
        buf = alloc_buffer(slots * self.slot_nbytes, huge_pages=False)
        region = fabric_engine.register(buf.view)
        return Staging(buf, region, buf.numpy())

    def encode_into(self, staging: Staging, slot: int, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        # hidden: [hidden_size]; logits: [vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logprobs, self.top_k)
        h = self.hidden_size
        raw = staging.array[self.slot_offset(slot) : self.slot_offset(slot) + self.slot_nbytes]
        raw[: h * 4] = np.frombuffer(hidden.float().numpy().tobytes(), dtype=np.uint8)
        raw[h * 4 : h * 4 + self.top_k * 4] = np.frombuffer(top.indices.to(torch.int32).numpy().tobytes(),
                                                             dtype=np.uint8)
        raw[h * 4 + self.top_k * 4 :] = np.frombuffer(top.values.numpy().tobytes(), dtype=np.uint8)

    def decode(self, staging: Staging, slot: int) -> Context:
        h, k = self.hidden_size, self.top_k
        raw = staging.array[self.slot_offset(slot) : self.slot_offset(slot) + self.slot_nbytes].copy()
        return Context(
            hidden=torch.from_numpy(raw[: h * 4].view(np.float32).copy()),
            top_ids=torch.from_numpy(raw[h * 4 : h * 4 + k * 4].view(np.int32).copy()),
            top_logprobs=torch.from_numpy(raw[h * 4 + k * 4 :].view(np.float32).copy()),
        )
