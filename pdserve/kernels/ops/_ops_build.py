"""cffi (API mode) builder for pdserve's CPU ops: csrc/small_linear.c, csrc/norm_act.c, csrc/rope_kv.c.

setup.py lists ``"pdserve/kernels/ops/_ops_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.kernels.ops._cpu_ops``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/kernels/ops/_ops_build.py

The module's interface is csrc/cpu_ops.h's cffi region (native_build.read_cdef); compiler flags
are native_build.cflags(openmp=True) plus one exception, -ffp-contract=off (below).
"""

import os
import runpy

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_SHARED_CSRC = os.path.join(os.path.dirname(_HERE), "csrc")  # pdserve/kernels/csrc: vec8.h, exp8.h, bf16.h
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_HEADER = os.path.join(_CSRC, "cpu_ops.h")
_SOURCES = ("small_linear.c", "norm_act.c", "rope_kv.c")

# Exception to the common flags: no contraction of a * b + c into fused multiply-adds. The
# kernels fuse only where the source says (fma8 in small_linear.c): left to itself GCC fused some
# tile shapes' multiply-adds and not others, and a row's result then depended on which other
# rows shared the call (batch invariance broken by an ulp); rope's x * cos + rotate_half(x) * sin
# matches torch bit for bit only unfused.
_EXTRA_COMPILE_ARGS = ["-ffp-contract=off"]


def make_builder(absolute_sources: bool) -> FFI:
    """The module's builder (native_build.ffi_builder: setuptools takes relative sources, an in-place
    build absolute ones)."""
    # native_build.py by path: setuptools runs this file before any package here is importable.
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    return native_build["ffi_builder"](
        "pdserve.kernels.ops._cpu_ops", '#include "cpu_ops.h"\n',
        cdef=native_build["read_cdef"](_HEADER), sources=[os.path.join(_CSRC, name) for name in _SOURCES],
        include_dirs=[_CSRC, _SHARED_CSRC], openmp=True, absolute_sources=absolute_sources,
        extra_compile_args=tuple(_EXTRA_COMPILE_ARGS))


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    # Build in place: the .so lands next to this file (pdserve/kernels/ops/_cpu_ops*.so).
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    print(native_build["build_in_place"](make_builder(absolute_sources=True), _HERE, "pdserve-ops-build-"))
