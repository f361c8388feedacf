"""Benchmark: C paged-attention kernel vs torch gather + SDPA (CPU).

Shapes follow SmolLM2-135M (Hq=9, Hkv=3, D=64, P=16). Decode: batch 1/8/32 x context
128/512/2048, one query per sequence, pages scattered at random through a pool of 8192 pages.
Prefill: one sequence, chunk of 128/512 queries with 0/512 earlier tokens in the cache; torch
gets an explicit causal mask (the chunk's rows are the last rows of the context).

Dtypes: rows are labelled "q / kv": the query (and output) dtype and the K/V pool dtype.
float32 / bfloat16 is a float32 model with kv_cache_dtype="bfloat16" (torch's side then widens
the gathered K/V to float32 before SDPA).

Cache state: a model has ~30 layers, each with its own pool, so a layer's pages are normally
not in cache when its attention runs. The benchmark therefore cycles through several pools
("layers") whose total size is well above the L3 cache, and for decode also rotates disjoint
page sets, for both implementations. Pools are anonymous mappings on transparent huge pages
(pdserve.engine.cache.hostmem), as the engine allocates its KV pool.

KV-cache dtype section: batch-32 decode at context 320 and 512 over 30 distinct layers' pools
per dtype, the three dtype pairs called round-robin (one call each per round, so load and
bandwidth drift hit all three alike); per-call min / median and the median of the per-round
ratios float32-pool time / this time.

Run, from the repository root:
    python -m bench.engine.attention_kernels [--threads 2] [--results-dir DIR]
writes attention_kernels.md (default into bench/results/engine/; --quick writes only with an
explicit --results-dir). Nothing waits but the kernels' own work.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common.machine import cpu_flags
from bench.common.results import RESULTS_DIR, write_results
from pdserve.engine.cache.hostmem import alloc_tensor
from pdserve.kernels.attention import cpu_kernels

logger = logging.getLogger(__name__)

HQ, HKV, D, P = 9, 3, 64, 16
POOL_PAGES = 8192  # >= 4000 and >= 2x the pages of the largest decode case (32 x 2048 / 16)
POOL_BYTES_TARGET = 512 << 20  # pools cycled per measurement: >> 32 MiB L3
F32, BF16 = torch.float32, torch.bfloat16
DTYPE_PAIRS = ((F32, F32), (F32, BF16), (BF16, BF16))  # (q / out, K/V pool)
KV_LAYERS = 30         # KV-cache dtype section: distinct per-layer pools per dtype
KV_LAYER_PAGES = 2048  # pages per layer pool there (2 disjoint batch-32 x 512 page sets)
BANDWIDTH_BYTES = 256 << 20


def use_quick_sizes() -> None:
    """--quick (the suite's smoke run): pools far smaller than L3-busting, 2 layers' pools, 32 MiB
    bandwidth buffers. Its numbers say nothing about the kernels; it only shows that every part runs."""
    global POOL_PAGES, POOL_BYTES_TARGET, KV_LAYERS, KV_LAYER_PAGES, BANDWIDTH_BYTES
    POOL_PAGES, POOL_BYTES_TARGET, KV_LAYERS, KV_LAYER_PAGES, BANDWIDTH_BYTES = 2048, 0, 2, 1024, 32 << 20


def timeit(fn, reps: int, warmup: int = 2) -> tuple[float, float]:
    """(min, median) seconds per call of fn(i) over `reps` calls (i = call index, for pools).

    Both are reported because a shared machine's load inflates the median (a preempted OpenMP
    thread stalls the whole call); the minimum is the uncontended estimate.
    """
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def pool_tensor(n_pages: int, dtype: torch.dtype) -> torch.Tensor:
    """[n_pages, Hkv, P, D] of randn values, on transparent huge pages like the engine's pool."""
    t = alloc_tensor((n_pages, HKV, P, D), dtype, huge_pages=True)
    t.copy_(torch.randn(n_pages, HKV, P, D))
    return t


def pair_name(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    return f"{str(q_dtype).replace('torch.', '')} / {str(kv_dtype).replace('torch.', '')}"


def bandwidth() -> tuple[float, float]:
    """(memcpy GB/s counting read + write bytes, read-only GB/s via sum), BANDWIDTH_BYTES buffers."""
    n = BANDWIDTH_BYTES // 4
    src = torch.randn(n)                                                   # [n]
    dst = torch.empty_like(src)                                            # [n]
    t_copy = timeit(lambda i: dst.copy_(src), reps=10)[0]
    t_read = timeit(lambda i: src.sum(), reps=10)[0]
    return 2 * src.numel() * 4 / t_copy / 1e9, src.numel() * 4 / t_read / 1e9


_POOLS: dict[torch.dtype, "Pools"] = {}


def pools_for(dtype: torch.dtype) -> "Pools":
    """One set of pools per dtype, shared by all cases (allocating 0.5 GB per case is slow)."""
    if dtype not in _POOLS:
        _POOLS[dtype] = Pools(POOL_PAGES, dtype)
    return _POOLS[dtype]


class Pools:
    """Several per-"layer" K/V pools ([N, Hkv, P, D] each) cycled so reads come from DRAM."""

    def __init__(self, n_pages: int, dtype: torch.dtype) -> None:
        page_bytes = 2 * HKV * P * D * torch.tensor([], dtype=dtype).element_size()
        self.count = max(2, POOL_BYTES_TARGET // (n_pages * page_bytes))
        self.k = [pool_tensor(n_pages, dtype) for _ in range(self.count)]
        self.v = [pool_tensor(n_pages, dtype) for _ in range(self.count)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i % self.count], self.v[i % self.count]


def torch_decode(q, k_pool, v_pool, block_tables, ctx: int, scale: float) -> torch.Tensor:
    """Gather + SDPA for equal-length decode (K/V widened to q's dtype). q: [B, Hq, D]."""
    b = q.shape[0]
    k = k_pool[block_tables.long()].to(q.dtype)           # [B, pages, Hkv, P, D]
    v = v_pool[block_tables.long()].to(q.dtype)           # [B, pages, Hkv, P, D]
    k = k.permute(0, 2, 1, 3, 4).reshape(b, HKV, -1, D)[:, :, :ctx]   # [B, Hkv, ctx, D]
    v = v.permute(0, 2, 1, 3, 4).reshape(b, HKV, -1, D)[:, :, :ctx]   # [B, Hkv, ctx, D]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
    return o.squeeze(2)                                   # [B, Hq, D]


def torch_prefill(q, k_pool, v_pool, pages, ctx: int, mask, scale: float) -> torch.Tensor:
    """Gather + SDPA with an explicit causal mask. q: [q_len, Hq, D] -> [q_len, Hq, D]."""
    k = k_pool[pages].to(q.dtype).permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :ctx]  # [Hkv, ctx, D]
    v = v_pool[pages].to(q.dtype).permute(1, 0, 2, 3).reshape(HKV, -1, D)[:, :ctx]  # [Hkv, ctx, D]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=True)                 # [Hq, q_len, D]
    return o.transpose(0, 1)


def bench_decode(batch: int, ctx: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                 threads: int) -> dict:
    pages_per_seq = -(-ctx // P)
    n_pages = POOL_PAGES
    pools = pools_for(kv_dtype)
    gen = torch.Generator().manual_seed(batch * 7919 + ctx)
    # Disjoint page sets, rotated with the pools, so small batches do not stay in L3 either.
    n_sets = max(1, min(16, n_pages // (batch * pages_per_seq)))
    perm = torch.randperm(n_pages, generator=gen)[: n_sets * batch * pages_per_seq]
    tables = [t.reshape(batch, pages_per_seq).to(torch.int32).contiguous()      # [B, pages]
              for t in perm.chunk(n_sets)]
    query_start = torch.arange(batch + 1, dtype=torch.int32)                       # [B + 1]
    context_lens = torch.full((batch,), ctx, dtype=torch.int32)                     # [B]
    q = torch.randn(batch, HQ, D).to(q_dtype)                                       # [B, Hq, D]
    out = torch.empty_like(q)                                                       # [B, Hq, D]
    scale = D ** -0.5
    reps = max(20, min(200, int(2e8 / (batch * ctx * HKV * D * 8))))

    def kernel(i: int) -> None:
        k_pool, v_pool = pools.layer(i)
        cpu_kernels.paged_attention(out, q, k_pool, v_pool, tables[(i // pools.count) % n_sets],
                                    query_start, context_lens, scale, num_threads=threads)

    def reference(i: int) -> torch.Tensor:
        k_pool, v_pool = pools.layer(i)
        return torch_decode(q, k_pool, v_pool, tables[(i // pools.count) % n_sets], ctx, scale)

    kernel(0)
    expected = reference(0)
    err = (out.float() - expected.float()).abs().max().item()
    t_kernel = timeit(kernel, reps)
    t_torch = timeit(reference, max(5, reps // 4))
    kv_bytes = 2 * batch * ctx * HKV * D * torch.empty((), dtype=kv_dtype).element_size()
    return dict(batch=batch, ctx=ctx, dtype=pair_name(q_dtype, kv_dtype), t_kernel=t_kernel,
                t_torch=t_torch, gbps=kv_bytes / t_kernel[0] / 1e9, kv_mb=kv_bytes / 1e6, err=err)


def bench_prefill(q_len: int, earlier: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                  threads: int) -> dict:
    ctx = earlier + q_len
    pages_per_seq = -(-ctx // P)
    n_pages = POOL_PAGES
    pools = pools_for(kv_dtype)
    gen = torch.Generator().manual_seed(q_len * 31 + earlier)
    pages = torch.randperm(n_pages, generator=gen)[:pages_per_seq]                # [pages]
    block_tables = pages.to(torch.int32).unsqueeze(0).contiguous()                 # [1, pages]
    query_start = torch.tensor([0, q_len], dtype=torch.int32)                      # [2]
    context_lens = torch.tensor([ctx], dtype=torch.int32)                          # [1]
    q = torch.randn(q_len, HQ, D).to(q_dtype)                                      # [q_len, Hq, D]
    out = torch.empty_like(q)
    pos = torch.arange(earlier, ctx).unsqueeze(1)                                  # [q_len, 1]
    mask = torch.arange(ctx).unsqueeze(0) <= pos                                   # [q_len, ctx]
    scale = D ** -0.5
    reps = 10 if q_len >= 512 else 20

    def kernel(i: int) -> None:
        k_pool, v_pool = pools.layer(i)
        cpu_kernels.paged_attention(out, q, k_pool, v_pool, block_tables, query_start,
                                    context_lens, scale, num_threads=threads)

    def reference(i: int) -> torch.Tensor:
        k_pool, v_pool = pools.layer(i)
        return torch_prefill(q, k_pool, v_pool, pages, ctx, mask, scale)

    kernel(0)
    err = (out.float() - reference(0).float()).abs().max().item()
    t_kernel = timeit(kernel, reps)
    t_torch = timeit(reference, reps)
    # causal attention FLOPs: 2 matmuls x 2 FLOP x Hq x D x (visible keys summed over rows)
    visible = q_len * earlier + q_len * (q_len + 1) // 2
    gflops = 4 * HQ * D * visible / t_kernel[0] / 1e9
    return dict(q_len=q_len, earlier=earlier, dtype=pair_name(q_dtype, kv_dtype),
                t_kernel=t_kernel, t_torch=t_torch, gflops=gflops, err=err)


def bench_kv_dtypes(batch: int, ctx: int, threads: int, rounds: int) -> dict:
    """Batch decode over KV_LAYERS distinct pools per K/V dtype, the DTYPE_PAIRS called
    round-robin. Returns per pair: call times (s) and the per-round ratios vs float32 / float32."""
    pages_per_seq = -(-ctx // P)
    n_sets = KV_LAYER_PAGES // (batch * pages_per_seq)
    if n_sets < 1:
        raise ValueError(f"batch {batch} x ctx {ctx} needs {batch * pages_per_seq} pages, "
                         f"more than the {KV_LAYER_PAGES} of a layer pool")
    gen = torch.Generator().manual_seed(batch * 31 + ctx)
    perm = torch.randperm(KV_LAYER_PAGES, generator=gen)[: n_sets * batch * pages_per_seq]
    tables = [t.reshape(batch, pages_per_seq).to(torch.int32).contiguous()      # [B, pages]
              for t in perm.chunk(n_sets)]
    query_start = torch.arange(batch + 1, dtype=torch.int32)                       # [B + 1]
    context_lens = torch.full((batch,), ctx, dtype=torch.int32)                     # [B]
    layers = {kv: [(pool_tensor(KV_LAYER_PAGES, kv), pool_tensor(KV_LAYER_PAGES, kv))
                   for _ in range(KV_LAYERS)] for kv in (F32, BF16)}
    q32 = torch.randn(batch, HQ, D)                                                  # [B, Hq, D]
    qs = {F32: q32, BF16: q32.to(BF16)}
    outs = {pair: torch.empty_like(qs[pair[0]]) for pair in DTYPE_PAIRS}
    times: dict = {pair: [] for pair in DTYPE_PAIRS}
    warmup = 3
    for i in range(warmup + rounds):
        for j, (q_dtype, kv_dtype) in enumerate(DTYPE_PAIRS):
            k_pool, v_pool = layers[kv_dtype][(i * len(DTYPE_PAIRS) + j) % KV_LAYERS]
            bt = tables[(i // KV_LAYERS) % n_sets]
            t0 = time.perf_counter()
            cpu_kernels.paged_attention(outs[(q_dtype, kv_dtype)], qs[q_dtype], k_pool, v_pool,
                                        bt, query_start, context_lens, D ** -0.5,
                                        num_threads=threads)
            if i >= warmup:
                times[(q_dtype, kv_dtype)].append(time.perf_counter() - t0)
    base = times[(F32, F32)]
    result = {}
    for pair, t in times.items():
        kv_bytes = 2 * batch * ctx * HKV * D * torch.empty((), dtype=pair[1]).element_size()
        result[pair] = dict(t=t, ratio=statistics.median(a / b for a, b in zip(base, t, strict=True)),
                            gbps=kv_bytes / min(t) / 1e9)
    del layers
    return result


def ms(t: tuple[float, float]) -> str:
    """'min / median' in milliseconds."""
    return f"{t[0] * 1e3:.3f} / {t[1] * 1e3:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="2,1",
                        help="comma-separated thread counts; one set of tables per count")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where attention_kernels.md goes (default bench/results/engine; with --quick: nowhere)")
    parser.add_argument("--quick", action="store_true", help="fewer cases (smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cpu_kernels.available():
        raise SystemExit(f"CPU kernels not built: {cpu_kernels.unavailable_reason()}")
    thread_counts = [int(x) for x in args.threads.split(",")]
    if args.quick:
        use_quick_sizes()

    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    emit("# Attention kernels: C paged attention vs torch gather + SDPA")
    emit()
    emit(f"- CPU flags: {cpu_flags()} (commit, date and machine at the end)")
    emit(f"- torch {torch.__version__}, kernel OpenMP={cpu_kernels.has_openmp()}")
    emit(f"- shapes: Hq={HQ}, Hkv={HKV}, D={D}, P={P}; pools cycled (> L3) so K/V come from DRAM")
    emit(f"- load average at start (other processes share this machine): "
         f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    emit("- dtype column: q (and out) dtype / K/V pool dtype")
    emit("- times per call (one layer): min / median over the reps; ratio and GB/s use the mins")
    for threads in thread_counts:
        run_tables(threads, args.quick, emit)
    emit()
    emit(f"- load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    out = args.results_dir if args.results_dir is not None or args.quick else RESULTS_DIR / "engine"
    if out is not None:
        write_results(out, "attention_kernels", lines=lines)


def run_tables(threads: int, quick: bool, emit) -> None:
    """Decode and prefill tables for one thread count (kernel and torch both use `threads`)."""
    torch.set_num_threads(threads)
    copy_gbps, read_gbps = bandwidth()
    emit()
    emit(f"## {threads} thread(s)")
    emit()
    emit(f"- memory bandwidth ({threads} threads, {BANDWIDTH_BYTES >> 20} MiB, best of 10): memcpy {copy_gbps:.1f} "
         f"GB/s (read + write bytes), read-only (sum) {read_gbps:.1f} GB/s")
    emit()
    rounds = 5 if quick else 300
    emit(f"### KV-cache dtype: batch-32 decode, {KV_LAYERS} layers' pools per dtype, "
         f"{threads} thread(s)")
    emit()
    emit(f"Pairs called round-robin, {rounds} rounds; ratio = median over rounds of "
         f"(float32 / float32 time) / (this time).")
    emit()
    emit("| dtype | ctx | kernel ms min / med | ratio vs f32 / f32 (paired median) "
         "| K+V GB/s at min |")
    emit("|---|---|---|---|---|")
    for ctx in (320, 512):
        res = bench_kv_dtypes(32, ctx, threads, rounds)
        for pair, r in res.items():
            t = (min(r["t"]), statistics.median(r["t"]))
            emit(f"| {pair_name(*pair)} | {ctx} | {ms(t)} | {r['ratio']:.2f}x | {r['gbps']:.1f} |")
    emit()
    emit(f"### Decode (one query per sequence), {threads} thread(s)")
    emit()
    emit("| dtype | batch | ctx | K+V MB | kernel ms min / med | torch ms min / med | ratio "
         "| kernel GB/s | % memcpy | % read | max err |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [(b, c) for b in (1, 8, 32) for c in (128, 512, 2048)]
    if quick:
        cases = [(32, 512)]
    for q_dtype, kv_dtype in DTYPE_PAIRS:
        for b, c in cases:
            if q_dtype == BF16 and (b, c) not in ((32, 512), (32, 2048), (1, 2048)):
                continue
            r = bench_decode(b, c, q_dtype, kv_dtype, threads)
            emit(f"| {r['dtype']} | {b} | {c} | {r['kv_mb']:.1f} | {ms(r['t_kernel'])} "
                 f"| {ms(r['t_torch'])} | {r['t_torch'][0] / r['t_kernel'][0]:.1f}x "
                 f"| {r['gbps']:.1f} | {100 * r['gbps'] / copy_gbps:.0f}% "
                 f"| {100 * r['gbps'] / read_gbps:.0f}% | {r['err']:.1e} |")
    emit()
    emit(f"### Prefill chunk (one sequence; torch with explicit causal mask), {threads} thread(s)")
    emit()
    emit("| dtype | q_len | earlier ctx | kernel ms min / med | torch ms min / med | ratio "
         "| kernel GFLOP/s | max err |")
    emit("|---|---|---|---|---|---|---|---|")
    pcases = [(128, 0), (128, 512), (512, 0), (512, 512)]
    if quick:
        pcases = [(128, 512)]
    for q_dtype, kv_dtype in DTYPE_PAIRS:
        for q_len, earlier in pcases:
            r = bench_prefill(q_len, earlier, q_dtype, kv_dtype, threads)
            emit(f"| {r['dtype']} | {q_len} | {earlier} | {ms(r['t_kernel'])} "
                 f"| {ms(r['t_torch'])} | {r['t_torch'][0] / r['t_kernel'][0]:.1f}x "
                 f"| {r['gflops']:.1f} | {r['err']:.1e} |")


if __name__ == "__main__":
    main()
