"""Tests of the C paged-attention kernel (pdserve/kernels/attention/cpu_kernels.py) against the torch
reference: decode, chunked prefill with earlier context, mixed batches, GQA, head dims, page
sizes, float32, bfloat16 and float32 queries over a bfloat16 KV pool, scattered pages, key
splits, and input validation.

Tolerances: float32 1e-5 absolute (same math, different summation order; outputs are convex
combinations of V entries of magnitude ~1). bfloat16: kernel and reference read the same bf16
inputs and compute in fp32, so they differ by fp32 rounding plus the final bf16 rounding of the
output (half an ulp of bf16 = 2^-9 relative, ~4e-3 for |x| < 2): 1e-2 absolute / 1e-2 relative.
float32 queries with a bfloat16 pool: the output is float32 and the reference reads the same
bf16 K/V values, widened exactly to float32, so only float32 summation order differs (~1e-6 on
these outputs): the float32 tolerance, 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from support.native import skip_unless_built

from pdserve.kernels.attention import cpu_kernels

pytestmark = skip_unless_built(cpu_kernels.available(),
                               "the C attention kernels (pdserve.kernels.attention._cpu_kernels)",
                               cpu_kernels.unavailable_reason())


def make_case(
    q_lens: list[int],
    ctx_lens: list[int],
    hkv: int,
    g: int,
    d: int,
    p: int,
    dtype: torch.dtype = torch.float32,
    extra_pages: int = 7,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> dict:
    """Random pool with each sequence's pages scattered through it (non-trivial page ids).
    q is `dtype`, the pools `kv_dtype` (default: `dtype`)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-c // p) for c in ctx_lens]
    n_pages = sum(pages_per_seq) + extra_pages
    max_pages = max(pages_per_seq) + 2
    perm = torch.randperm(n_pages, generator=gen)                     # [N]
    block_tables = torch.full((len(ctx_lens), max_pages), n_pages - 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    t = sum(q_lens)
    q = torch.randn(t, hkv * g, d, generator=gen).to(dtype)           # [T, Hq, D]
    k_pool = torch.randn(n_pages, hkv, p, d, generator=gen).to(kv_dtype)  # [N, Hkv, P, D]
    v_pool = torch.randn(n_pages, hkv, p, d, generator=gen).to(kv_dtype)  # [N, Hkv, P, D]
    query_start = torch.zeros(len(q_lens) + 1, dtype=torch.int32)     # [S + 1]
    query_start[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)          # [S]
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                query_start=query_start, context_lens=context_lens, scale=d ** -0.5)


def run_both(case: dict, num_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(case["q"], float("nan"))
    ref = torch.full_like(case["q"], float("nan"))
    cpu_kernels.paged_attention(out, **case, num_threads=num_threads)
    cpu_kernels.paged_attention_reference(ref, **case)
    return out, ref


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(out).any()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("d,p", [(64, 16), (128, 16), (64, 32), (128, 32)])
def test_decode_varied_lengths(dtype: torch.dtype, g: int, d: int, p: int) -> None:
    ctx = [1, p - 1, p, p + 1, 1000, 37]
    case = make_case([1] * len(ctx), ctx, hkv=2, g=g, d=d, p=p, dtype=dtype)
    check(*run_both(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3])
def test_chunked_prefill_with_earlier_context(dtype: torch.dtype, g: int) -> None:
    # q rows are the last q_len positions of each context (earlier chunks already cached).
    case = make_case([1, 17, 128, 300], [1, 17 + 40, 128 + 512, 300 + 5], hkv=3, g=g, d=64,
                     p=16, dtype=dtype)
    check(*run_both(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_decode_and_prefill(dtype: torch.dtype) -> None:
    q_lens = [1, 1, 1, 33, 1, 64]
    ctx = [500, 16, 2, 33, 129, 64 + 250]
    case = make_case(q_lens, ctx, hkv=2, g=4, d=128, p=32, dtype=dtype)
    check(*run_both(case))


@pytest.mark.parametrize("num_threads", [1, 2, 3, 8])
def test_thread_counts_and_key_splits(num_threads: int) -> None:
    # One long decode: few (seq, head) items, so the kernel splits the keys across threads.
    case = make_case([1], [2048 + 5], hkv=1, g=3, d=64, p=16)
    check(*run_both(case, num_threads=num_threads))
    case = make_case([1, 1], [700, 3000], hkv=2, g=2, d=64, p=16, dtype=torch.bfloat16)
    check(*run_both(case, num_threads=num_threads))


def test_large_scores_are_stable() -> None:
    # Large logits: streaming softmax must subtract the running max (no inf / nan).
    case = make_case([1, 20], [600, 300], hkv=1, g=2, d=64, p=16)
    case["q"] = case["q"] * 300.0
    out, ref = run_both(case)
    assert torch.isfinite(out).all()
    # Logits of a few hundred: fp32 rounding of the dot products (~|logit| * 1e-6) moves the
    # weights by ~1e-4 relative in either implementation, hence the looser tolerance.
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_empty_sequence_and_untouched_rows() -> None:
    # A sequence with q_len 0 contributes nothing; rows outside every sequence are untouched.
    case = make_case([2, 0, 1], [10, 5, 20], hkv=1, g=1, d=64, p=16)
    q = case["q"]
    case["q"] = torch.cat([q, torch.randn(2, *q.shape[1:])])           # [T + 2, Hq, D]
    out = torch.full_like(case["q"], 7.0)
    cpu_kernels.paged_attention(out, **case)
    ref = torch.full_like(case["q"], 7.0)
    cpu_kernels.paged_attention_reference(ref, **case)
    check(out, ref)
    assert (out[-2:] == 7.0).all()


def test_bad_inputs_raise_value_error_naming_shapes() -> None:
    case = make_case([1, 1], [10, 20], hkv=2, g=2, d=64, p=16)
    out = torch.empty_like(case["q"])
    with pytest.raises(ValueError, match=r"k_pool=\(\d+, 2, 16, 64\)"):
        cpu_kernels.paged_attention(out, **{**case, "block_tables": case["block_tables"].long()})
    with pytest.raises(ValueError, match="head dim"):
        half = case["k_pool"][..., :32].clone()
        cpu_kernels.paged_attention(out, **{**case, "k_pool": half, "v_pool": half})
    with pytest.raises(ValueError, match="multiple of 8"):
        odd = make_case([1], [5], hkv=1, g=1, d=12, p=16)
        cpu_kernels.paged_attention(torch.empty_like(odd["q"]), **odd)
    with pytest.raises(ValueError, match="v_pool shape"):
        cpu_kernels.paged_attention(out, **{**case, "v_pool": case["v_pool"][:3].clone()})
    with pytest.raises(ValueError, match="Hq=4 is not a multiple of Hkv=3"):
        bad = torch.randn(5, 3, 16, 64)
        cpu_kernels.paged_attention(out, **{**case, "k_pool": bad, "v_pool": bad})
    with pytest.raises(ValueError, match="contiguous"):
        kt = case["k_pool"].transpose(1, 2).contiguous().transpose(1, 2)
        cpu_kernels.paged_attention(out, **{**case, "k_pool": kt})
    with pytest.raises(ValueError, match="dtype"):
        cpu_kernels.paged_attention(out.bfloat16(), **case)
    with pytest.raises(ValueError, match="out shape"):
        cpu_kernels.paged_attention(out[:1], **case)
    with pytest.raises(ValueError, match="page id"):
        bt = case["block_tables"].clone()
        bt[1, 0] = 10_000
        cpu_kernels.paged_attention(out, **{**case, "block_tables": bt})
    with pytest.raises(ValueError, match="context_len"):
        cpu_kernels.paged_attention(
            out, **{**case, "context_lens": torch.tensor([10, 0], dtype=torch.int32)})
    with pytest.raises(ValueError, match="query_start"):
        cpu_kernels.paged_attention(
            out, **{**case, "query_start": torch.tensor([0, 2, 1], dtype=torch.int32)})


def test_prepared_batch_serves_every_layer_and_still_checks_each_call() -> None:
    # The backend checks a pass's metadata once (prepare_batch) and each layer's tensors per call.
    case = make_case([1, 3, 1], [10, 20, 33], hkv=2, g=3, d=64, p=16)
    meta = {k: case.pop(k) for k in ("block_tables", "query_start", "context_lens")}
    batch = cpu_kernels.prepare_batch(**meta)
    layers = [(case["k_pool"], case["v_pool"]), (case["k_pool"] * 0.5, case["v_pool"] + 1.0)]
    for kp, vp in layers:
        out, ref = torch.empty_like(case["q"]), torch.empty_like(case["q"])
        cpu_kernels.run_batch(out, case["q"], kp, vp, batch, case["scale"])
        cpu_kernels.paged_attention_reference(ref, case["q"], kp, vp, **meta, scale=case["scale"])
        check(out, ref)
    out = torch.empty_like(case["q"])
    with pytest.raises(ValueError, match=r"block_tables must be int32.*block_tables=\(3, \d+\)"):
        cpu_kernels.prepare_batch(**{**meta, "block_tables": meta["block_tables"].long()})
    with pytest.raises(ValueError, match="S=3 from context_lens disagrees"):
        cpu_kernels.prepare_batch(**{**meta, "query_start": meta["query_start"][:3]})
    with pytest.raises(ValueError, match="window must be None or an integer >= 1"):
        cpu_kernels.prepare_batch(**meta, window=0)
    with pytest.raises(ValueError, match="head dim"):
        half = case["k_pool"][..., :32].clone()
        cpu_kernels.run_batch(out, case["q"], half, half, batch, case["scale"])
    with pytest.raises(ValueError, match="contiguous"):
        kt = case["k_pool"].transpose(1, 2).contiguous().transpose(1, 2)
        cpu_kernels.run_batch(out, case["q"], kt, case["v_pool"], batch, case["scale"])
    with pytest.raises(ValueError, match="page id"):  # values stay checked in C on every call
        small = case["k_pool"][:2].clone()
        cpu_kernels.run_batch(out, case["q"], small, small, batch, case["scale"])


def test_runs_beside_torch_threads_without_hang() -> None:
    # The kernel's OpenMP team and torch's intra-op pool share one libgomp; calling the kernel
    # from another Python thread while torch ops run must neither crash nor deadlock.
    import threading

    case = make_case([1] * 8 + [40], [300] * 8 + [90], hkv=3, g=3, d=64, p=16)
    ref = torch.empty_like(case["q"])
    cpu_kernels.paged_attention_reference(ref, **case)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(50):
                out = torch.empty_like(case["q"])
                cpu_kernels.paged_attention(out, **case, num_threads=2)
                check(out, ref)
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    a = torch.randn(256, 256)
    for _ in range(50):
        a = torch.tanh(a @ a)
    thread.join(timeout=30)
    assert not thread.is_alive(), "kernel thread hung"
    assert not errors, errors


# --- sliding window -------------------------------------------------------------------------


def windowed_case(q_lens: list[int], ctx_lens: list[int], window: int, p: int, hkv: int = 2,
                  g: int = 2, d: int = 64, dtype: torch.dtype = torch.float32,
                  kv_dtype: torch.dtype | None = None) -> dict:
    """A case whose table entries before each sequence's window point at a NaN-filled padding
    page 0, as a sliding-window allocator leaves them: reading one would poison the output."""
    case = make_case(q_lens, ctx_lens, hkv=hkv, g=g, d=d, p=p, dtype=dtype, seed=3,
                     kv_dtype=kv_dtype)
    # Page 0 becomes the padding page: move whatever sequence page sat there to a fresh page.
    n = case["k_pool"].shape[0]
    case["k_pool"] = torch.cat([case["k_pool"], case["k_pool"][:1].clone()])    # [N + 1, ...]
    case["v_pool"] = torch.cat([case["v_pool"], case["v_pool"][:1].clone()])
    bt = case["block_tables"]
    bt[bt == 0] = n
    case["k_pool"][0] = float("nan")
    case["v_pool"][0] = float("nan")
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        first_page = max(0, ctx - q_len - window + 1) // p
        bt[s, :first_page] = 0
    return {**case, "window": window}


def dense_windowed(case: dict) -> torch.Tensor:
    """Independent definition: per sequence, gather its whole context (padding pages as zeros)
    and run SDPA with an explicit causal sliding-window mask."""
    q, kp, vp = case["q"].float(), case["k_pool"].float(), case["v_pool"].float()
    kp, vp = kp.nan_to_num(0.0), vp.nan_to_num(0.0)
    _, hkv, p, d = kp.shape
    g = q.shape[1] // hkv
    w = case["window"]
    out = torch.zeros_like(q)
    starts = case["query_start"].tolist()
    for s, ctx in enumerate(case["context_lens"].tolist()):
        a, b = starts[s], starts[s + 1]
        pages = case["block_tables"][s, : -(-ctx // p)].long()
        k = kp[pages].transpose(0, 1).reshape(hkv, -1, d)[:, :ctx]               # [Hkv, ctx, D]
        v = vp[pages].transpose(0, 1).reshape(hkv, -1, d)[:, :ctx]
        q_pos = torch.arange(ctx - (b - a), ctx)[:, None]                        # [q_len, 1]
        k_pos = torch.arange(ctx)[None, :]                                       # [1, ctx]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - w)                            # [q_len, ctx]
        qs = q[a:b].transpose(0, 1)                                              # [Hq, q_len, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=mask,
            scale=case["scale"])                                                 # [Hq, q_len, D]
        out[a:b] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,p", [(16, 16), (20, 8), (1, 16), (100, 32)])
def test_sliding_window_skips_recycled_pages(dtype: torch.dtype, window: int, p: int) -> None:
    # Decodes before, at and past the window; prefill chunks (fresh and with earlier context)
    # whose first rows reach back across several pages and whose last rows see only the window.
    q_lens = [1, 1, 1, 1, 1, 40, 7, 64]
    ctx = [3, window, window + 1, window + p + 3, 700, 40, 7 + 90, 64 + 300]
    case = windowed_case(q_lens, ctx, window, p, dtype=dtype)
    out, ref = run_both(case)
    check(out, ref)
    dense = dense_windowed(case)
    if dtype == torch.float32:
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), dense, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_threads", [1, 2, 5])
def test_sliding_window_key_splits(num_threads: int) -> None:
    # One long decode whose window spans many pages: the kernel splits the window's pages.
    case = windowed_case([1], [5000], window=1500, p=16, hkv=1, g=4)
    check(*run_both(case, num_threads=num_threads))


def test_window_larger_than_context_equals_full_attention() -> None:
    case = make_case([1, 30], [50, 30 + 20], hkv=2, g=2, d=64, p=16)
    full = torch.empty_like(case["q"])
    cpu_kernels.paged_attention(full, **case)
    wide = torch.empty_like(case["q"])
    cpu_kernels.paged_attention(wide, **case, window=10_000)
    assert torch.equal(full, wide)


def test_bad_window_raises() -> None:
    case = make_case([1], [10], hkv=1, g=1, d=64, p=16)
    out = torch.empty_like(case["q"])
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="window must be None or an integer >= 1"):
            cpu_kernels.paged_attention(out, **case, window=bad)


@pytest.mark.parametrize("window", [None, 12])
def test_torch_backend_matches_kernel_backend(window: int | None) -> None:
    # The two AttentionBackends on one mixed batch (3 decodes, a fresh prompt chunk, a chunk
    # with earlier context), including the K/V write into the pool.
    from pdserve.kernels.attention.base import AttentionBatch
    from pdserve.kernels.attention.cpu_backend import CpuKernelAttentionBackend
    from pdserve.kernels.attention.torch_backend import TorchAttentionBackend

    P, hkv, g, d = 8, 2, 3, 32
    q_lens, ctx = [1, 1, 1, 21, 9], [5, 30, 61, 21, 9 + 40]
    gen = torch.Generator().manual_seed(7)
    n_pages = 1 + sum(-(-c // P) for c in ctx)
    perm = (torch.randperm(n_pages - 1, generator=gen) + 1).tolist()             # page 0 = padding
    tables, used = [], 0
    for c in ctx:
        n = -(-c // P)
        tables.append(perm[used:used + n])
        used += n
    slot_pages, slot_offsets = [], []
    for s, (q_len, c) in enumerate(zip(q_lens, ctx, strict=True)):
        for pos in range(c - q_len, c):
            slot_pages.append(tables[s][pos // P])
            slot_offsets.append(pos % P)
        if window is not None:  # what a sliding-window allocator recycles before this step
            first = max(0, c - q_len - window + 1) // P
            tables[s][:first] = [0] * first
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(ctx), width, dtype=torch.int32)
    for s, t in enumerate(tables):
        block_tables[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
    pages_t = torch.tensor(slot_pages)
    offs_t = torch.tensor(slot_offsets)
    kv_rows = ((pages_t[:, None] * hkv + torch.arange(hkv)[None, :]) * P + offs_t[:, None]).reshape(-1)
    batch = AttentionBatch(
        query_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=block_tables,
        slot_pages=pages_t, slot_offsets=offs_t, kv_rows=kv_rows, num_decode=3,
        q_lens=tuple(q_lens), ctx_lens=tuple(ctx), page_size=P, window=window)
    T = sum(q_lens)
    q = torch.randn(T, hkv * g, d, generator=gen)                                # [T, Hq, D]
    k = torch.randn(T, hkv, d, generator=gen)                                    # [T, Hkv, D]
    v = torch.randn(T, hkv, d, generator=gen)
    pool = torch.randn(2, n_pages, hkv, P, d, generator=gen)                     # earlier K/V
    if window is not None:
        # Recycled entries point at page 0: garbage that would show if it were attended to. (The
        # torch backend may gather it under a mask, so it is finite; the kernel test above uses NaN.)
        pool[:, 0] = 1e4
    outs = []
    for backend in (TorchAttentionBackend(), CpuKernelAttentionBackend()):
        kp, vp = pool[0].clone(), pool[1].clone()
        outs.append(backend.forward(q, k, v, kp, vp, backend.plan(batch), d ** -0.5))
        assert torch.equal(kp.view(-1, d)[kv_rows], k.reshape(-1, d))
    assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


# --- float32 queries, bfloat16 KV pool --------------------------------------------------------
# (f32 q / out, bf16 k_pool / v_pool): a float32 model with a bfloat16 KV cache. Tolerance: the
# float32 one, see the module docstring (check() picks it from the float32 output).

BF16 = torch.bfloat16


@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("d,p", [(64, 16), (128, 16), (64, 32), (40, 13)])
def test_f32_queries_bf16_pool_decode(g: int, d: int, p: int) -> None:
    # Partial last pages (p - 1, p + 1, 37, 1000), a one-token context, a page size that is not
    # a multiple of 8 (13) and a head dim that is not a multiple of 16 (40).
    ctx = [1, p - 1, p, p + 1, 1000, 37]
    case = make_case([1] * len(ctx), ctx, hkv=2, g=g, d=d, p=p, kv_dtype=BF16)
    assert case["q"].dtype == torch.float32 and case["k_pool"].dtype == BF16
    out, ref = run_both(case)
    assert out.dtype == torch.float32
    check(out, ref)


@pytest.mark.parametrize("g", [1, 3])
def test_f32_queries_bf16_pool_chunked_prefill_and_mixed_batch(g: int) -> None:
    # Prefill chunks with earlier context in the cache, then decodes mixed with chunks.
    case = make_case([1, 17, 128, 300], [1, 17 + 40, 128 + 512, 300 + 5], hkv=3, g=g, d=64,
                     p=16, kv_dtype=BF16)
    check(*run_both(case))
    mixed = make_case([1, 1, 1, 33, 1, 64], [500, 16, 2, 33, 129, 64 + 250], hkv=2, g=4, d=128,
                      p=32, kv_dtype=BF16)
    check(*run_both(mixed))


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_f32_queries_bf16_pool_key_splits(num_threads: int) -> None:
    # One long decode (keys split across threads) and a batch of SmolLM2-shaped decodes.
    case = make_case([1], [2048 + 5], hkv=1, g=3, d=64, p=16, kv_dtype=BF16)
    check(*run_both(case, num_threads=num_threads))
    batch = make_case([1] * 32, [320 + 7 * i for i in range(32)], hkv=3, g=3, d=64, p=16,
                      kv_dtype=BF16)
    check(*run_both(batch, num_threads=num_threads))


@pytest.mark.parametrize("window,p", [(16, 16), (20, 8), (100, 32)])
def test_f32_queries_bf16_pool_sliding_window(window: int, p: int) -> None:
    q_lens = [1, 1, 1, 1, 1, 40, 7, 64]
    ctx = [3, window, window + 1, window + p + 3, 700, 40, 7 + 90, 64 + 300]
    case = windowed_case(q_lens, ctx, window, p, kv_dtype=BF16)
    out, ref = run_both(case)
    check(out, ref)
    torch.testing.assert_close(out, dense_windowed(case), atol=1e-5, rtol=1e-5)


def test_bf16_pool_is_widened_exactly() -> None:
    # The kernel widens bf16 K/V to exactly the float32 values a float32 pool would hold, and
    # (today) sums in the same order for both pool dtypes: the outputs are identical. A kernel
    # that sums bf16 pools in another order would relax this to the 1e-5 tolerance.
    case = make_case([1, 1, 30], [300, 17, 30 + 64], hkv=3, g=3, d=64, p=16, kv_dtype=BF16)
    widened = {**case, "k_pool": case["k_pool"].float(), "v_pool": case["v_pool"].float()}
    out_bf16, out_f32 = torch.empty_like(case["q"]), torch.empty_like(case["q"])
    cpu_kernels.paged_attention(out_bf16, **case, num_threads=2)
    cpu_kernels.paged_attention(out_f32, **widened, num_threads=2)
    assert torch.equal(out_bf16, out_f32)


def test_unsupported_dtype_pairs_raise_naming_dtypes() -> None:
    case = make_case([1, 3], [10, 20], hkv=2, g=2, d=64, p=16)
    # bf16 queries over a float32 pool: not a supported pair, in the kernel or the reference.
    bf16_q = {**case, "q": case["q"].to(BF16)}
    for fn in (cpu_kernels.paged_attention, cpu_kernels.paged_attention_reference):
        with pytest.raises(ValueError, match=r"q dtype torch\.bfloat16 with K/V pool dtype "
                                             r"torch\.float32 is unsupported; supported \(q, K/V\): "
                                             r"\(torch\.float32, torch\.float32\)"):
            fn(torch.empty_like(bf16_q["q"]), **bf16_q)
    # float16 pools are not supported either.
    half = {**case, "k_pool": case["k_pool"].half(), "v_pool": case["v_pool"].half()}
    with pytest.raises(ValueError, match=r"K/V pool dtype torch\.float16 is unsupported"):
        cpu_kernels.paged_attention(torch.empty_like(case["q"]), **half)
    # K and V pools of different dtypes.
    with pytest.raises(ValueError, match=r"v_pool dtype torch\.float32 != k_pool dtype torch\.bfloat16"):
        cpu_kernels.paged_attention(torch.empty_like(case["q"]),
                                    **{**case, "k_pool": case["k_pool"].to(BF16)})
    # With a bf16 pool, out still follows q (float32).
    mixed = {**case, "k_pool": case["k_pool"].to(BF16), "v_pool": case["v_pool"].to(BF16)}
    with pytest.raises(ValueError, match=r"out dtype torch\.bfloat16 != q dtype torch\.float32"):
        cpu_kernels.paged_attention(torch.empty_like(case["q"], dtype=BF16), **mixed)


def test_kernel_refuses_bf16_queries_over_f32_pool() -> None:
    # The C entry point checks the dtype flags itself (before reading any pointer).
    lib, ffi = cpu_kernels._lib, cpu_kernels._ffi
    err = ffi.new("int64_t[3]")
    null = ffi.NULL
    for q_bf16, kv_bf16 in ((1, 0), (2, 1), (0, -1)):
        rc = lib.pa_forward(null, null, null, null, null, null, null, 1, 1, 1, 1, 2, 1, 16, 64,
                            0.125, 0, q_bf16, kv_bf16, 1, err)
        assert rc == lib.PA_ERR_DTYPE
        assert (err[0], err[1]) == (q_bf16, kv_bf16)
