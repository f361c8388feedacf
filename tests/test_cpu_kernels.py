"""Tests of the C paged-attention kernel (pdserve/attention/cpu_kernels.py) against the torch
reference: decode, chunked prefill with earlier context, mixed batches, GQA, head dims, page
sizes, float32 and bfloat16, scattered pages, key splits, and input validation.

Tolerances: float32 1e-5 absolute (same math, different summation order; outputs are convex
combinations of V entries of magnitude ~1). bfloat16: kernel and reference read the same bf16
inputs and compute in fp32, so they differ by fp32 rounding plus the final bf16 rounding of the
output (half an ulp of bf16 = 2^-9 relative, ~4e-3 for |x| < 2): 1e-2 absolute / 1e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.attention import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason=f"CPU kernels not built: {cpu_kernels.unavailable_reason()}",
)


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
) -> dict:
    """Random pool with each sequence's pages scattered through it (non-trivial page ids)."""
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
    k_pool = torch.randn(n_pages, hkv, p, d, generator=gen).to(dtype)  # [N, Hkv, P, D]
    v_pool = torch.randn(n_pages, hkv, p, d, generator=gen).to(dtype)  # [N, Hkv, P, D]
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
