"""A prefill-side KvSender and a decode-side landing area over real libfabric (shm) in one
process, for tests that drive the sender with hand-made scheduler passes (no engine). Used by
tests/integration/test_kv_messenger.py and test_prefill_transfers.py. Test thread only; waits are
the callers' (each bounded there)."""

from __future__ import annotations

import queue

import numpy as np
import torch

from fabric import FabricConfig, TransferEngine
from kv_messenger import ContextCodec, KvLayout, KvSender, ShardingScheme, TransferTicket
from kv_messenger.plan import expected_writes
from pdserve.engine.cache.hostmem import alloc_buffer, alloc_tensor
from pdserve.engine.cache.kv_cache import KVCacheShape
from pdserve.engine.kv_connector import AttentionGroupSpec, KvCacheSpec, PrefillDone
from pdserve.engine.request import Request
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput

SMALL = KvLayout(num_layers=3, num_pages=32, kv_heads=2, page_size=4, head_dim=8, dtype="float32")


class SenderPair:
    """A prefill-side KvSender and a decode-side landing area, over shm in one process."""

    def __init__(self, src_pages: list[int]) -> None:
        cfg = FabricConfig(provider="shm")
        self.fab_p, self.fab_d = TransferEngine(cfg), TransferEngine(cfg)
        self.src_pages = tuple(src_pages)
        # src: [layers, 2, pages, kv_heads, page_size, head_dim], random bytes, as an engine's pool
        shape = KVCacheShape(SMALL.num_layers, SMALL.num_pages, SMALL.kv_heads, SMALL.page_size, SMALL.head_dim)
        src = alloc_tensor((shape.num_layers, 2, shape.num_pages, shape.kv_heads, shape.page_size, shape.head_dim),
                           torch.float32, huge_pages=False)
        self.src = src.view(-1).view(torch.uint8).numpy()                      # [nbytes]
        self.src[:] = np.random.default_rng(7).integers(0, 256, SMALL.nbytes, dtype=np.uint8)
        self.dst_buf = alloc_buffer(SMALL.nbytes, huge_pages=False)
        self.dst = self.dst_buf.numpy()                                          # [nbytes]
        self.codec = ContextCodec(hidden_size=16)
        self.landing = self.codec.alloc_staging(self.fab_d, slots=1)
        self.released: list[str] = []
        self.sender = KvSender(self.fab_p)
        self.sender.register_kv_cache(KvCacheSpec(
            buffer=src, shape=shape, dtype=torch.float32, groups=(AttentionGroupSpec("full", (0, 1, 2), None),),
            hidden_size=16, model_name="test"))
        self.dst_region = self.fab_d.register(self.dst_buf.view)
        self.fired: queue.SimpleQueue = queue.SimpleQueue()

    def target(self, rid: str, dst_pages: tuple[int, ...], n_prefill: int, tag: int) -> TransferTicket:
        count = expected_writes(n_prefill, SMALL, ShardingScheme(), ShardingScheme())
        self.fab_d.imm_counter.expect(tag, count, self.fired.put)
        return TransferTicket(rid, self.dst_region.descriptor, SMALL, dst_pages, self.landing.region.descriptor, 0,
                              tag, count, n_prefill)

    def add(self, ticket: TransferTicket):
        fut = self.sender.add(ticket)
        fut.add_done_callback(lambda _f: self.released.append(ticket.request_id))
        return fut

    def run_pass(self, chunks: list[ScheduledChunk]) -> None:
        self.sender.on_schedule(SchedulerOutput(tuple(chunks)), {c.request_id: (self.src_pages,) for c in chunks})
        for layer in range(SMALL.num_layers):
            self.sender.on_layer_done(layer)

    def prefill_done(self, req: Request, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        self.sender.on_prefill_done(PrefillDone(req.request_id, self.src_pages, hidden, logits))

    def page_bytes(self, buf, layer: int, kv: int, page: int) -> bytes:
        k, v = SMALL.page_offsets(layer, np.asarray([page]))
        off = int((k if kv == 0 else v)[0])
        return bytes(buf[off : off + SMALL.page_nbytes])

    def close(self) -> None:
        self.sender.close()
        self.fab_p.close()
        self.fab_d.close()
