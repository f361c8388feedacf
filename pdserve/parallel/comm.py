"""The ranks' collectives: torch.distributed over gloo on loopback (NCCL would sit behind the same
four methods on GPU; not built here).

The leader (rank 0) opens the rendezvous store on a free port (port 0: the kernel picks one) and
hands the port to the workers. Every collective of a pass (the row-parallel fold's sends,
receives and broadcasts, pdserve/model/layers.py RowLinear) is bounded by `timeout_s`, gloo's
process-group timeout: a rank that died makes its peers' next collective fail (at once when its
sockets close, else after the timeout) instead of hanging.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


def open_store(size: int, timeout_s: float) -> dist.TCPStore:
    """The leader's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore(HOST, 0, size, True, timedelta(seconds=timeout_s), wait_for_workers=False)


class GlooComm:
    """One rank's member of the engine's gloo group (pdserve.model.tp.TPComm)."""

    def __init__(self, rank: int, size: int, port: int, timeout_s: float,
                 store: dist.TCPStore | None = None) -> None:
        if store is None:
            store = dist.TCPStore(HOST, port, size, False, timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._store = store

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, src)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        dist.broadcast(t, src)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
