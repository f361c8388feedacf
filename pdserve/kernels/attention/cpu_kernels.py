"""Python wrapper of the C paged-attention kernel (csrc/paged_attention.c, built with cffi).

`paged_attention` runs decode and chunked-prefill attention straight from the paged KV pool
(no gather copies); `paged_attention_reference` is the pure-torch definition the tests compare
against. A caller running every layer of a pass over the same sequences checks their metadata
once with `prepare_batch` and calls `run_batch` per layer (the attention backend does).
`available()` says whether the compiled module could be imported; importing this module
never raises.

Semantics (both functions): Hq = Hkv * G and query head h reads kv head h // G. Query i of
sequence s (q_len = query_start[s+1] - query_start[s]) sits at absolute position
p = context_lens[s] - q_len + i and attends to key positions 0..p, or with a sliding window W
to positions max(0, p - W + 1)..p. Key position t of s is slot t % P of page
block_tables[s, t // P]. With a window, table entries of pages wholly before the window of a
sequence's first query are never read (a sliding-window allocator points them at a padding
page). Softmax in float32; output cast to q's dtype. Rows of q
that belong to no sequence are left untouched in `out`.

Dtypes: q and out share one dtype, k_pool and v_pool another; the supported (q, K/V) pairs are
(float32, float32), (bfloat16, bfloat16) and (float32, bfloat16), the last for a float32 model
with a bfloat16 KV cache (half the bytes per key read from memory). Whatever the pair, scores,
softmax and the weighted sum are float32: bf16 elements are widened to float32 exactly.

Threads: the kernel uses OpenMP with exactly `num_threads` threads per call (default
torch.get_num_threads()). It links libgomp; when torch is imported first (as here), the process
keeps a single libgomp (torch's), so the two share one runtime. The C call releases the GIL.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

try:
    from pdserve.kernels.attention import _cpu_kernels  # built by _kernels_build.py

    _ffi = _cpu_kernels.ffi
    _lib = _cpu_kernels.lib
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # not compiled (or built for another interpreter)
    _ffi = None
    _lib = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    logger.info(
        "CPU attention kernels unavailable (%s); build them with "
        "`python pdserve/kernels/attention/_kernels_build.py` or `pip install -e .`",
        _IMPORT_ERROR,
    )

_BF16 = torch.bfloat16  # q_bf16 / kv_bf16 flags of the C kernel: True for bfloat16, else float32
# (q / out dtype, k_pool / v_pool dtype) pairs the kernel runs.
SUPPORTED_DTYPES = (
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
)


def available() -> bool:
    """True when the compiled kernel module imported."""
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why the compiled module is missing (None when it is available)."""
    return _IMPORT_ERROR


def has_openmp() -> bool:
    """True when the compiled module was built with OpenMP (else it runs single-threaded)."""
    return _lib is not None and bool(_lib.pa_has_openmp())


def _shapes(**tensors: torch.Tensor) -> str:
    return ", ".join(f"{name}={tuple(t.shape)}/{t.dtype}" for name, t in tensors.items())


def _validate_meta(
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    fail: Callable[[str], None] | None = None,
) -> None:
    """Dtypes, ranks, S and layout of the sequence metadata; `fail(why)` raises (default: a
    ValueError naming the three tensors' shapes)."""
    tensors = {"block_tables": block_tables, "query_start": query_start, "context_lens": context_lens}

    def fail_meta(why: str) -> None:
        raise ValueError(f"paged_attention: {why} ({_shapes(**tensors)})")

    fail = fail or fail_meta
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            fail(f"{name} must be int32, got {t.dtype}")
        if t.device.type != "cpu":
            fail(f"{name} is on {t.device}, expected cpu")
        if not t.is_contiguous():
            fail(f"{name} must be contiguous (strides {t.stride()})")
    if block_tables.dim() != 2 or context_lens.dim() != 1 or query_start.dim() != 1:
        fail("block_tables must be [S, max_pages], context_lens [S], query_start [S + 1]")
    s = context_lens.shape[0]
    if block_tables.shape[0] != s or query_start.shape[0] != s + 1:
        fail(f"S={s} from context_lens disagrees with block_tables / query_start")


def _tensors_ok(out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """The common case of `_validate`'s tensor checks, as cheap attribute tests (one call per layer)."""
    return (q.dim() == 3 and k_pool.dim() == 4 and out.dtype is q.dtype and v_pool.dtype is k_pool.dtype
            and (q.dtype, k_pool.dtype) in SUPPORTED_DTYPES and out.shape == q.shape and v_pool.shape == k_pool.shape
            and q.shape[2] == k_pool.shape[3] and q.shape[2] % 8 == 0 and k_pool.shape[1] > 0
            and q.shape[1] % k_pool.shape[1] == 0 and q.is_cpu and out.is_cpu and k_pool.is_cpu and v_pool.is_cpu
            and q.is_contiguous() and out.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous())


def _validate(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Cheap shape / dtype / layout checks; raises ValueError naming every tensor's shape."""

    def fail(why: str) -> None:
        names = _shapes(
            out=out, q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
            query_start=query_start, context_lens=context_lens,
        )
        raise ValueError(f"paged_attention: {why} ({names})")

    if q.dim() != 3 or k_pool.dim() != 4:
        fail("q must be [T, Hq, D] and k_pool [N, Hkv, P, D]")
    if out.dtype != q.dtype:
        fail(f"out dtype {out.dtype} != q dtype {q.dtype}")
    if v_pool.dtype != k_pool.dtype:
        fail(f"v_pool dtype {v_pool.dtype} != k_pool dtype {k_pool.dtype}")
    if (q.dtype, k_pool.dtype) not in SUPPORTED_DTYPES:
        pairs = ", ".join(f"({a}, {b})" for a, b in SUPPORTED_DTYPES)
        fail(f"q dtype {q.dtype} with K/V pool dtype {k_pool.dtype} is unsupported; "
             f"supported (q, K/V): {pairs}")
    if out.shape != q.shape:
        fail(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if v_pool.shape != k_pool.shape:
        fail(f"v_pool shape {tuple(v_pool.shape)} != k_pool shape {tuple(k_pool.shape)}")
    _, hq, d = q.shape
    _, hkv, _, dk = k_pool.shape
    if dk != d:
        fail(f"head dim of k_pool ({dk}) != head dim of q ({d})")
    if hkv == 0 or hq % hkv != 0:
        fail(f"Hq={hq} is not a multiple of Hkv={hkv}")
    if d % 8 != 0:
        fail(f"head dim {d} must be a multiple of 8")
    _validate_meta(block_tables, query_start, context_lens, fail)
    tensors = (out, q, k_pool, v_pool)
    if not all(t.is_cpu and t.is_contiguous() for t in tensors):
        for name, t in zip(("out", "q", "k_pool", "v_pool"), tensors, strict=True):
            if t.device.type != "cpu":
                fail(f"{name} is on {t.device}, expected cpu")
            if not t.is_contiguous():
                fail(f"{name} must be contiguous (strides {t.stride()})")


_ERRORS = {
    "PA_ERR_SHAPE": "bad head counts / head dim: hq={}, hkv={}, head_dim={}",
    "PA_ERR_QUERY_START": "query_start not monotonic within [0, T]: seq {} has [{}, {})",
    "PA_ERR_CONTEXT_LEN": "seq {}: context_len {} is below its q_len {} or beyond max_pages * P",
    "PA_ERR_PAGE_ID": "seq {}: block_tables entry {} holds page id {} outside [0, N)",
    "PA_ERR_ALLOC": "out of memory for scratch buffers ({} {} {})",
    "PA_ERR_WINDOW": "sliding window {} is not >= 1 ({} {})",
    "PA_ERR_DTYPE": "unsupported dtype flags q_bf16={}, kv_bf16={}",
}


def _window_arg(window: int | None) -> int:
    """The C kernel's window argument: 0 for full attention, else W >= 1."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"paged_attention: window must be None or an integer >= 1, got {window!r}")
    return window


@dataclass(frozen=True)
class KernelBatch:
    """A pass's sequence metadata, checked once (`prepare_batch`) for every layer's kernel call."""

    block_tables: torch.Tensor   # [S, max_pages] int32
    query_start: torch.Tensor    # [S + 1] int32
    context_lens: torch.Tensor   # [S] int32
    window: int                  # the C argument: 0 = full attention, else W >= 1


def prepare_batch(
    block_tables: torch.Tensor,  # [S, max_pages] int32
    query_start: torch.Tensor,   # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32, including this step's queries
    window: int | None = None,
) -> KernelBatch:
    """Check dtypes, ranks, S and layout of the metadata (values are checked in C on every call)."""
    _validate_meta(block_tables, query_start, context_lens)
    return KernelBatch(block_tables, query_start, context_lens, _window_arg(window))


def paged_attention(
    out: torch.Tensor,           # [T, Hq, D] written in place, same dtype as q
    q: torch.Tensor,             # [T, Hq, D] contiguous, float32 or bfloat16
    k_pool: torch.Tensor,        # [N, Hkv, P, D] contiguous (HND pages), bfloat16 or q's dtype
    v_pool: torch.Tensor,        # [N, Hkv, P, D] same dtype as k_pool
    block_tables: torch.Tensor,  # [S, max_pages] int32
    query_start: torch.Tensor,   # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32, including this step's queries
    scale: float,
    num_threads: int | None = None,
    window: int | None = None,   # sliding window in tokens; None = full attention
) -> None:
    """Paged attention with the C kernel; see the module docstring for the semantics.

    Raises RuntimeError when the kernel is not built, ValueError for bad shapes / dtypes /
    layouts and for out-of-range metadata values (checked in C before any page is read).
    """
    if _lib is None:
        raise RuntimeError(f"CPU attention kernels are not built: {_IMPORT_ERROR}")
    _validate(out, q, k_pool, v_pool, block_tables, query_start, context_lens)  # errors name all seven
    run_batch(out, q, k_pool, v_pool, prepare_batch(block_tables, query_start, context_lens, window), scale,
              num_threads)


def run_batch(
    out: torch.Tensor,           # [T, Hq, D] written in place, same dtype as q
    q: torch.Tensor,             # [T, Hq, D]
    k_pool: torch.Tensor,        # [N, Hkv, P, D]
    v_pool: torch.Tensor,        # [N, Hkv, P, D]
    batch: KernelBatch,
    scale: float,
    num_threads: int | None = None,
) -> None:
    """`paged_attention` over metadata checked once by `prepare_batch` (one call per layer)."""
    if _lib is None:
        raise RuntimeError(f"CPU attention kernels are not built: {_IMPORT_ERROR}")
    bt, qs, cl = batch.block_tables, batch.query_start, batch.context_lens
    if not _tensors_ok(out, q, k_pool, v_pool):
        _validate(out, q, k_pool, v_pool, bt, qs, cl)  # raises, naming what is wrong
        raise ValueError(f"paged_attention: unsupported arguments ({_shapes(out=out, q=q, k_pool=k_pool)})")
    t, hq, d = q.shape
    n, hkv, p, _ = k_pool.shape
    err = _ffi.new("int64_t[3]")
    rc = _lib.pa_forward_addr(
        out.data_ptr(), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), bt.data_ptr(), qs.data_ptr(),
        cl.data_ptr(), t, cl.shape[0], bt.shape[1], n, hq, hkv, p, d, scale, batch.window,
        q.dtype is _BF16, k_pool.dtype is _BF16, torch.get_num_threads() if num_threads is None else num_threads,
        err,
    )
    if rc != 0:  # PA_OK
        for name, template in _ERRORS.items():
            if rc == getattr(_lib, name):
                msg = template.format(err[0], err[1], err[2])
                break
        else:
            msg = f"unknown error code {rc}"
        shapes = _shapes(q=q, k_pool=k_pool, block_tables=bt, query_start=qs, context_lens=cl)
        if rc == _lib.PA_ERR_ALLOC:
            raise MemoryError(f"paged_attention: {msg} ({shapes})")
        raise ValueError(f"paged_attention: {msg} ({shapes})")


def paged_attention_reference(
    out: torch.Tensor,           # [T, Hq, D] same dtype as q
    q: torch.Tensor,             # [T, Hq, D]
    k_pool: torch.Tensor,        # [N, Hkv, P, D] a dtype pair of SUPPORTED_DTYPES with q
    v_pool: torch.Tensor,        # [N, Hkv, P, D]
    block_tables: torch.Tensor,  # [S, max_pages] int32
    query_start: torch.Tensor,   # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32
    scale: float,
    num_threads: int | None = None,
    window: int | None = None,
) -> None:
    """Pure-torch definition (float32 math, per sequence); same contract as `paged_attention`.

    `num_threads` is accepted for signature parity and ignored. With a window, only the pages
    from the first query's window on are read, as the kernel does.
    """
    del num_threads
    _validate(out, q, k_pool, v_pool, block_tables, query_start, context_lens)
    w = _window_arg(window)
    _, hq, d = q.shape
    _, hkv, p, _ = k_pool.shape
    g = hq // hkv
    starts = query_start.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        q_len = b - a
        if q_len == 0:
            continue
        n_pages = math.ceil(ctx / p)
        first = max(0, ctx - q_len - w + 1) // p if w else 0           # first page read
        pages = block_tables[s, first:n_pages].long()                  # [n]
        n = n_pages - first
        t0 = first * p                                                 # position of key 0
        k = k_pool[pages].float().permute(1, 0, 2, 3).reshape(hkv, n * p, d)[:, : ctx - t0]
        v = v_pool[pages].float().permute(1, 0, 2, 3).reshape(hkv, n * p, d)[:, : ctx - t0]
        k = k.repeat_interleave(g, dim=0)                              # [Hq, L, D]
        v = v.repeat_interleave(g, dim=0)                              # [Hq, L, D]
        qs = q[a:b].float().transpose(0, 1)                            # [Hq, q_len, D]
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale           # [Hq, q_len, L]
        pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)              # [q_len, 1]
        keys = torch.arange(t0, ctx).unsqueeze(0)                      # [1, L]
        hidden = keys > pos
        if w:
            hidden |= keys <= pos - w
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[a:b] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)  # [q_len, Hq, D]
