"""cffi (API mode) builder for the CPU paged-attention kernel: csrc/paged_attention.c.

setup.py lists ``"pdserve/kernels/attention/_kernels_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.kernels.attention._cpu_kernels``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/kernels/attention/_kernels_build.py

The module's interface is csrc/paged_attention.h's cffi region (native_build.read_cdef); compiler
flags are native_build.cflags(openmp=True) with no exception (-O3, -march=native and -fopenmp
where accepted; multiply-adds may be contracted, which the kernel's tests and bench results were
taken with).
"""

import os
import runpy

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_SHARED_CSRC = os.path.join(os.path.dirname(_HERE), "csrc")  # pdserve/kernels/csrc: vec8.h, exp8.h, bf16.h
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_HEADER = os.path.join(_CSRC, "paged_attention.h")
_SOURCES = ("paged_attention.c",)


def make_builder(absolute_sources: bool) -> FFI:
    """The module's builder (native_build.ffi_builder: setuptools takes relative sources, an in-place
    build absolute ones)."""
    # native_build.py by path: setuptools runs this file before any package here is importable.
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    return native_build["ffi_builder"](
        "pdserve.kernels.attention._cpu_kernels", '#include "paged_attention.h"\n',
        cdef=native_build["read_cdef"](_HEADER), sources=[os.path.join(_CSRC, name) for name in _SOURCES],
        include_dirs=[_CSRC, _SHARED_CSRC], openmp=True, absolute_sources=absolute_sources)


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    # Build in place: the .so lands next to this file (pdserve/kernels/attention/_cpu_kernels*.so).
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    print(native_build["build_in_place"](make_builder(absolute_sources=True), _HERE, "pdserve-attention-build-"))
