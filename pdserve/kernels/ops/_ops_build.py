"""cffi (API mode) builder for pdserve's CPU ops: csrc/small_linear.c, csrc/norm_act.c, csrc/rope_kv.c.

setup.py lists ``"pdserve/kernels/ops/_ops_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles ``pdserve.kernels.ops._cpu_ops``. For development, compile in place:

    cd /work/main && .venv/bin/python pdserve/kernels/ops/_ops_build.py

The module's interface is csrc/cpu_ops.h's cffi region (native_build.read_cdef); compiler flags
are native_build.cflags(openmp=True) plus one exception, -ffp-contract=off (below).
"""

import os
import runpy
import tempfile

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
    """setuptools wants the C files relative to its working directory (the repository root);
    cffi's own compile() runs in a temporary directory and needs them absolute."""
    # native_build.py by path: setuptools runs this file before any package here is importable.
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    compile_args, link_args = native_build["cflags"](openmp=True)
    paths = [os.path.join(_CSRC, name) for name in _SOURCES]
    builder = FFI()
    builder.cdef(native_build["read_cdef"](_HEADER))
    builder.set_source(
        "pdserve.kernels.ops._cpu_ops",
        '#include "cpu_ops.h"\n',
        sources=paths if absolute_sources else [os.path.relpath(p) for p in paths],
        include_dirs=[_CSRC, _SHARED_CSRC],
        extra_compile_args=[*compile_args, *_EXTRA_COMPILE_ARGS],
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
