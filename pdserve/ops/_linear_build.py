"""cffi (API mode) builder for the small-batch linear kernel in csrc/small_linear.c.

setup.py lists ``"pdserve/ops/_linear_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.ops._linear_kernels``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/ops/_linear_build.py

Compiler flags: pdserve/_cflags.py (-O3, -march=native and -fopenmp where accepted), plus
-ffp-contract=off (the kernel fuses multiply-adds explicitly, so every tile sums alike).
"""

import logging
import os
import runpy

from cffi import FFI

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")

_CDEF = """
#define SL_OK 0
#define SL_ERR_SHAPE 1
#define SL_ERR_STRIDE 2

int sl_linear(float *y, const float *x, const float *w, const float *bias, int M, int N, int K,
              int64_t ldx, int64_t ldy, int num_threads);
int sl_has_openmp(void);
"""


def _make_builder() -> FFI:
    with open(os.path.join(_CSRC, "small_linear.c")) as f:
        source = f.read()
    # pdserve/_cflags.py by path: setuptools runs this file before pdserve is importable.
    compile_args, link_args = runpy.run_path(os.path.join(os.path.dirname(_HERE), "_cflags.py"))["flags"]()
    builder = FFI()
    builder.cdef(_CDEF)
    builder.set_source(
        "pdserve.ops._linear_kernels",
        source,
        include_dirs=[_CSRC],
        extra_compile_args=[*compile_args, "-ffp-contract=off"],  # fused only where the source says
        extra_link_args=link_args,
    )
    return builder


ffibuilder = _make_builder()

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    # Compile next to this file: pdserve/ops/_linear_kernels.*.so (tmpdir = repo root).
    repo_root = os.path.dirname(os.path.dirname(_HERE))
    path = ffibuilder.compile(tmpdir=repo_root, verbose=True)
    logger.info("built %s", path)
