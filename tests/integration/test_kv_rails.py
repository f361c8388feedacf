"""D16 rails end to end in the KV messenger: a TP 2 -> TP 2 transfer whose rank 1 sits on a second
rail on both sides, over real tcp;ofi_rxm engines in one process, the sender driven by hand-made
scheduler passes (as test_kv_messenger's sender tests).

Both nodes' hosts are a fake sysfs tree with two NUMA nodes and a NIC on each ("lo" on node 0,
this machine's other IPv4 interface, eth0 here, on node 1) and rank r's pool on node r, so each
engine opens rail 0 on lo (its --fabric-node 127.0.0.1) and rail 1 on eth0, and registers rank 1's
pool there (kv_messenger.pool). The ticket's rank-1 descriptor then names the decode node's rail-1
endpoint; the sender posts rank 1's runs from its rail 1 into it and rank 0's (and the context)
on rail 0. Checked: every decode rank's pool byte-equal to the prefill rank's, the immediate
count exact, each rail's entries, which endpoints each rail talked to, and that a fence into
such a decode engine is refused (one connection's fence says nothing of the other's).
"""

from __future__ import annotations

import dataclasses
import queue

import numpy as np
import pytest
import torch

from fabric import FabricConfig, FabricError, TransferEngine
from fabric.topology import read_topology
from kv_messenger.placement import shard_placements
from kv_messenger.plan import ShardingScheme
from kv_messenger.pool import register_pool
from kv_messenger.sender import KvSender
from kv_messenger.ticket import TransferTicket
from pdserve.engine.cache.kv_cache import KVCacheShape
from pdserve.engine.kv_connector import AttentionGroupSpec, KvCacheSpec, KvShardPool, PrefillDone
from pdserve.engine.request import Request, TransferRole
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from tests.unit.test_shard_placement import on_nodes
from tests.unit.test_shard_rails import _second_interface, two_nics_host

LAYERS, PAGES, PAGE, HEAD_DIM, HIDDEN = 2, 8, 4, 8, 16


def _spec(pools: list[torch.Tensor]) -> KvCacheSpec:
    # pools: [layers, 2, pages, 1 kv head, page_size, head_dim] per rank (rank r holds head r)
    shape = KVCacheShape(num_layers=LAYERS, num_pages=PAGES, kv_heads=1, page_size=PAGE, head_dim=HEAD_DIM)
    shards = tuple(KvShardPool(r, b, (r,)) for r, b in enumerate(pools))
    return KvCacheSpec(pools[0], shape, torch.float32, (AttentionGroupSpec("full", tuple(range(LAYERS)), None),),
                       HIDDEN, "m", shards)


def test_each_ranks_writes_go_rail_to_rail(tmp_path):
    second = _second_interface()
    if second is None:
        pytest.skip("no interface besides lo with an IPv4 address: one tcp domain only")
    topo = read_topology(two_nics_host(tmp_path, second))
    cfg = FabricConfig(provider="tcp;ofi_rxm", node="127.0.0.1")
    rng = np.random.default_rng(16)
    src = [torch.from_numpy(rng.standard_normal((LAYERS, 2, PAGES, 1, PAGE, HEAD_DIM), dtype=np.float32))
           for _ in range(2)]
    dst = [torch.zeros(LAYERS, 2, PAGES, 1, PAGE, HEAD_DIM) for _ in range(2)]

    def place(pools):
        where = on_nodes({pools[0].data_ptr(): 0, pools[1].data_ptr(): 1})
        return lambda spec, provider: shard_placements(spec, provider, topo, locate=where)

    fab_p, fab_d = TransferEngine(cfg), TransferEngine(cfg)
    sender = KvSender(fab_p, place=place(src))
    try:
        sender.register_kv_cache(_spec(src))
        pool_d = register_pool(fab_d, _spec(dst), 1, place=place(dst))
        for fab in (fab_p, fab_d):
            assert [(r.index, r.domain) for r in fab.rails] == [(0, "lo"), (1, second)]
        assert [r.rail for r in sender.kv_regions] == [r.rail for r in pool_d.regions] == [0, 1]
        kv = tuple(r.descriptor for r in pool_d.regions)
        assert kv[1].peer == fab_d.rails[1].peer != kv[0].peer
        src_pages, dst_pages, n_prefill, tag = (5, 1, 6), (2, 3, 7), 10, 0x2B2B
        ticket = TransferTicket("r", kv[0], pool_d.layout, dst_pages, pool_d.context.region.descriptor, 0, tag, 1,
                                n_prefill, sharding=ShardingScheme(tp_size=2), kv_ranks=kv)
        ticket = dataclasses.replace(ticket, expected_writes=sender.expected_writes(ticket))
        assert ticket.expected_writes == 2 * LAYERS * 2 * len(dst_pages) + 1   # 1:1 runs, K and V, + context
        fired: queue.SimpleQueue = queue.SimpleQueue()
        fab_d.imm_counter.expect(tag, ticket.expected_writes, fired.put)
        before = [fab_p.rail_stats(i).entries for i in (0, 1)]
        fut = sender.add(ticket)
        req = Request("r", list(range(1, n_prefill + 2)), SamplingParams(max_tokens=1), max_total_tokens=4096,
                      role=TransferRole.PREFILL)
        sender.on_schedule(SchedulerOutput((ScheduledChunk(req, start=0, num_tokens=n_prefill, samples=False),)),
                           {"r": (src_pages,)})
        for layer in range(LAYERS):
            sender.on_layer_done(layer)
        sender.on_prefill_done(PrefillDone("r", src_pages, torch.zeros(HIDDEN), torch.zeros(32)))
        assert fired.get(timeout=10) == tag
        result = fut.result(timeout=10)
        assert result.num_writes == ticket.expected_writes
        for rank in (0, 1):   # [layers, 2, pages, ...]: the pages sent, byte for byte; nothing else
            assert torch.equal(dst[rank][:, :, list(dst_pages)], src[rank][:, :, list(src_pages)]), rank
            others = sorted(set(range(PAGES)) - set(dst_pages))
            assert not dst[rank][:, :, others].any()
        after = [fab_p.rail_stats(i).entries for i in (0, 1)]
        per_rank = LAYERS * 2 * len(dst_pages)
        assert [after[i] - before[i] for i in (0, 1)] == [per_rank + 1, per_rank]   # rail 0: + the context
        # rail 1 spoke only to the decode node's rail-1 endpoint, rail 0 only to its rail-0 one
        assert fab_p._rails[1]._peers.addresses_of(fab_d.engine_id) == [fab_d.rails[1].peer]
        assert fab_p._rails[0]._peers.addresses_of(fab_d.engine_id) == [fab_d.peer_descriptor]
        assert not fab_p.writes_ordered
        fence = fab_d.register(bytearray(8))
        with pytest.raises(FabricError, match="sit on several endpoints"):
            sender.fence(fence.descriptor, 7)
    finally:
        sender.close()
        fab_p.close()
        fab_d.close()
