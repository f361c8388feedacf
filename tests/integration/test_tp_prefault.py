"""A TP worker rank prefaults its own KV pool after pinning itself (D16, pdserve/parallel/worker.py).

With GroupSpec.kv_populate the pool of rank 1 must be faulted in by rank 1, from its own cores, so
that first touch puts its pages on that rank's NUMA node; the leader, which creates and maps the
file, must touch none of them. Observable from outside on any host: after the start every page
of the file is in memory (mincore on the leader's mapping: the shared page cache), the leader's
own page tables hold none of it (its smaps Rss for the mapping is 0: it faulted nothing), the
worker's hold all of it, and the worker runs on exactly its cores. On a multi-node host the pages
are on the node of those cores (numa_node_of; on this one-node machine that is node 0).
"""

from __future__ import annotations

import ctypes
import mmap
import os

from support.tiny_models import make_tiny_checkpoint

from fabric.topology import numa_node_of, read_topology
from pdserve.engine.cache.hostmem import resident_bytes
from pdserve.model.loader import load_config, resolve_model
from pdserve.model.tp import plan_tensor_parallel
from pdserve.parallel.group import TensorParallelGroup
from pdserve.parallel.worker import GroupSpec


def _in_memory(addr: int, nbytes: int) -> int:
    """Pages of [addr, addr + nbytes) in memory (mincore: for a shared file, the page cache)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(addr), nbytes, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


def _worker_rss(pid: int, file_name: str) -> int:
    """Bytes of the pool file `file_name` mapped in process `pid`'s page tables (its smaps Rss)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = file_name in line
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def test_worker_prefaults_its_pool_after_pinning(tmp_path):
    path = str(make_tiny_checkpoint("llama", tmp_path / "tiny"))
    cfg = load_config(resolve_model(path))
    plan = plan_tensor_parallel(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, 2)
    spec = GroupSpec(model_path=path, dtype="float32", kv_dtype="float32", max_model_len=128,
                     small_batch_max_tokens=16, tp_invariant=True, attention_backend="torch", num_blocks=64,
                     page_size=16, num_layers=cfg.num_hidden_layers, head_dim=cfg.head_dim, kv_element_size=4,
                     kv_populate=True)
    group = TensorParallelGroup.start(plan, spec)
    try:
        (worker,) = group._workers
        (pid,) = group.worker_pids
        pool = group.pool_tensors()[0]          # [layers, 2, pages, kv_heads_1, page_size, head_dim]
        addr, nbytes = pool.data_ptr(), pool.numel() * pool.element_size()
        assert _in_memory(addr, nbytes) == -(-nbytes // mmap.PAGESIZE)   # every page faulted in ...
        assert resident_bytes(addr, addr + nbytes) == 0                   # ... none of them by the leader
        assert _worker_rss(pid, worker.pool.file.name) >= nbytes          # ... all by the worker
        cpus = group.cpus[1]
        if cpus:
            assert os.sched_getaffinity(pid) == set(cpus)
            where = numa_node_of(addr, nbytes)
            nodes = [n.id for n in read_topology().nodes if set(n.cpus) & set(cpus)]
            if where.node is not None and len(nodes) == 1:
                assert where.node == nodes[0], where.reason
        assert not pool.any()                   # populated, never written
    finally:
        group.close()
