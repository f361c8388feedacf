"""cffi (API mode) builder for pdserve's CPU ops: csrc/small_linear.c, csrc/norm_act.c, csrc/rope_kv.c.

setup.py lists ``"pdserve/kernels/ops/_ops_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.kernels.ops._cpu_ops``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/kernels/ops/_ops_build.py

Compiler flags: pdserve/kernels/_cflags.py (-O3, -march=native and -fopenmp where accepted), plus
-ffp-contract=off (the kernels fuse multiply-adds only where the source says, so every tile of
the linear kernel sums alike).
"""

import os
import runpy
import tempfile

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_SOURCES = ("small_linear.c", "norm_act.c", "rope_kv.c")

_CDEF = """
#define SL_OK 0
#define SL_ERR_SHAPE 1
#define SL_ERR_STRIDE 2
int sl_has_openmp(void);
int sl_linear_addr(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t bias, int M, int N, int K, int64_t ldx,
                   int64_t ldy, int num_threads);

#define OP_OK 0
#define OP_ERR_SHAPE 1
#define OP_ERR_STRIDE 2
int op_argmax_rows(int64_t *out, const float *x, int rows, int V, int64_t ld);

#define OP_ERR_ROW 3
int op_rope(float *out, const float *x, const float *cos_t, const float *sin_t, int T, int H, int D,
            int64_t ld_x);

int op_add_rms_norm_addr(uintptr_t out, uintptr_t h, uintptr_t delta, uintptr_t w, int rows, int H, int64_t ld_out,
                         int64_t ld_h, int64_t ld_delta, float eps);
int op_silu_mul_addr(uintptr_t out, uintptr_t gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                     int num_threads);
int op_rope_qk_addr(uintptr_t q_out, uintptr_t k_out, uintptr_t qkv, uintptr_t cos_t, uintptr_t sin_t, int T,
                    int Hq, int Hkv, int D, int64_t ld_qkv);
int op_write_kv_addr(uintptr_t k_pool, uintptr_t v_pool, uintptr_t k, uintptr_t v, uintptr_t rows, int T, int Hkv,
                     int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16, int64_t *bad);
"""


# sl_linear_addr: sl_linear taking addresses as integers (torch's data_ptr()), so the hottest call
# of a decode step (~600 a step) skips four ffi.cast conversions (~0.4 us each here). 0 = no bias.
_SOURCE_PREAMBLE = """
#include "small_linear.h"
#include "norm_act.h"
#include "rope_kv.h"
static int sl_linear_addr(uintptr_t y, uintptr_t x, uintptr_t w, uintptr_t bias, int M, int N, int K,
                          int64_t ldx, int64_t ldy, int num_threads) {
    return sl_linear((float *)y, (const float *)x, (const float *)w, (const float *)bias, M, N, K, ldx, ldy,
                     num_threads);
}

static int op_add_rms_norm_addr(uintptr_t out, uintptr_t h, uintptr_t delta, uintptr_t w, int rows, int H,
                                int64_t ld_out, int64_t ld_h, int64_t ld_delta, float eps) {
    return op_add_rms_norm((float *)out, (float *)h, (const float *)delta, (const float *)w, rows, H, ld_out, ld_h,
                           ld_delta, eps);
}

static int op_silu_mul_addr(uintptr_t out, uintptr_t gate_up, int rows, int I, int64_t ld_out, int64_t ld_in,
                            int num_threads) {
    return op_silu_mul((float *)out, (const float *)gate_up, rows, I, ld_out, ld_in, num_threads);
}

/* q and k rotated out of one qkv row block ([T, ld_qkv]: q heads at column 0, k heads at Hq * D). */
static int op_rope_qk_addr(uintptr_t q_out, uintptr_t k_out, uintptr_t qkv, uintptr_t cos_t, uintptr_t sin_t, int T,
                           int Hq, int Hkv, int D, int64_t ld_qkv) {
    if (ld_qkv < (int64_t)(Hq + Hkv) * D) return OP_ERR_STRIDE;
    const float *x = (const float *)qkv;
    int rc = op_rope((float *)q_out, x, (const float *)cos_t, (const float *)sin_t, T, Hq, D, ld_qkv);
    if (rc != OP_OK) return rc;
    return op_rope((float *)k_out, x + (int64_t)Hq * D, (const float *)cos_t, (const float *)sin_t, T, Hkv, D, ld_qkv);
}

static int op_write_kv_addr(uintptr_t k_pool, uintptr_t v_pool, uintptr_t k, uintptr_t v, uintptr_t rows, int T,
                            int Hkv, int D, int64_t ld_k, int64_t ld_v, int64_t pool_rows, int pool_bf16,
                            int64_t *bad) {
    return op_write_kv((void *)k_pool, (void *)v_pool, (const float *)k, (const float *)v, (const int64_t *)rows, T,
                       Hkv, D, ld_k, ld_v, pool_rows, pool_bf16, bad);
}
"""


def make_builder(absolute_sources: bool) -> FFI:
    """setuptools wants the C files relative to its working directory (the repository root);
    cffi's own compile() runs in a temporary directory and needs them absolute."""
    # pdserve/kernels/_cflags.py by path: setuptools runs this file before pdserve is importable.
    compile_args, link_args = runpy.run_path(os.path.join(os.path.dirname(_HERE), "_cflags.py"))["flags"]()
    paths = [os.path.join(_CSRC, name) for name in _SOURCES]
    builder = FFI()
    builder.cdef(_CDEF)
    builder.set_source(
        "pdserve.kernels.ops._cpu_ops",
        _SOURCE_PREAMBLE,
        sources=paths if absolute_sources else [os.path.relpath(p) for p in paths],
        include_dirs=[_CSRC, os.path.join(os.path.dirname(_HERE), "csrc")],  # + pdserve/kernels/csrc (exp8.h, bf16.h)
        extra_compile_args=[*compile_args, "-ffp-contract=off"],
        extra_link_args=link_args,
    )
    return builder


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    # Build in place: the .so lands next to this file (pdserve/kernels/ops/_cpu_ops*.so).
    with tempfile.TemporaryDirectory(prefix="pdserve-ops-build-") as tmp:
        so_path = make_builder(absolute_sources=True).compile(tmpdir=tmp, verbose=False)
        target = os.path.join(_HERE, os.path.basename(so_path))
        os.replace(so_path, target)
        print(target)
