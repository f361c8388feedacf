"""cffi (API mode) builder for the CPU paged-attention kernel in csrc/paged_attention.c.

setup.py lists ``"pdserve/kernels/attention/_kernels_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.kernels.attention._cpu_kernels``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/kernels/attention/_kernels_build.py

Compiler flags: pdserve/kernels/_cflags.py (-O3, -march=native and -fopenmp where accepted).
"""

import logging
import os
import runpy

from cffi import FFI

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")

_CDEF = """
#define PA_OK 0
#define PA_ERR_SHAPE 1
#define PA_ERR_QUERY_START 2
#define PA_ERR_CONTEXT_LEN 3
#define PA_ERR_PAGE_ID 4
#define PA_ERR_ALLOC 5
#define PA_ERR_WINDOW 6
#define PA_ERR_DTYPE 7

int pa_forward(void *out, const void *q, const void *k_pool, const void *v_pool,
               const int32_t *block_tables, const int32_t *query_start,
               const int32_t *context_lens, int num_tokens, int num_seqs, int max_pages,
               int num_pages, int hq, int hkv, int page_size, int head_dim, float scale,
               int window, int q_bf16, int kv_bf16, int num_threads, int64_t *err_info);
int pa_forward_addr(uintptr_t out, uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, uintptr_t block_tables,
                    uintptr_t query_start, uintptr_t context_lens, int num_tokens, int num_seqs, int max_pages,
                    int num_pages, int hq, int hkv, int page_size, int head_dim, float scale, int window,
                    int q_bf16, int kv_bf16, int num_threads, int64_t *err_info);
int pa_has_openmp(void);
"""

# pa_forward with every array as an integer address (tensor.data_ptr()): no ffi.cast per argument
# (~0.4 us each) on a call made once per layer per pass.
_ADDR_WRAPPER = """
static int pa_forward_addr(uintptr_t out, uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, uintptr_t block_tables,
                           uintptr_t query_start, uintptr_t context_lens, int num_tokens, int num_seqs,
                           int max_pages, int num_pages, int hq, int hkv, int page_size, int head_dim, float scale,
                           int window, int q_bf16, int kv_bf16, int num_threads, int64_t *err_info) {
    return pa_forward((void *)out, (const void *)q, (const void *)k_pool, (const void *)v_pool,
                      (const int32_t *)block_tables, (const int32_t *)query_start, (const int32_t *)context_lens,
                      num_tokens, num_seqs, max_pages, num_pages, hq, hkv, page_size, head_dim, scale, window,
                      q_bf16, kv_bf16, num_threads, err_info);
}
"""


def _make_builder() -> FFI:
    with open(os.path.join(_CSRC, "paged_attention.c")) as f:
        source = f.read()
    # pdserve/kernels/_cflags.py by path: setuptools runs this file before pdserve is importable.
    compile_args, link_args = runpy.run_path(os.path.join(os.path.dirname(_HERE), "_cflags.py"))["flags"]()
    builder = FFI()
    builder.cdef(_CDEF)
    builder.set_source(
        "pdserve.kernels.attention._cpu_kernels",
        source + _ADDR_WRAPPER,
        include_dirs=[_CSRC, os.path.join(os.path.dirname(_HERE), "csrc")],  # + pdserve/kernels/csrc (exp8.h, bf16.h)
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    return builder


ffibuilder = _make_builder()

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    # Compile next to this file: pdserve/kernels/attention/_cpu_kernels.*.so (tmpdir = repo root).
    repo_root = os.path.dirname(os.path.dirname(_HERE))
    path = ffibuilder.compile(tmpdir=repo_root, verbose=True)
    logger.info("built %s", path)
