"""cffi (API mode) builder for the page-shard checksum (S7): csrc/checksum.c -> kv_messenger._checksum.

setup.py lists ``"kv_messenger/_checksum_build.py:ffibuilder"`` in ``cffi_modules`` so that
``pip install -e .`` compiles it. For development, compile in place:

    cd /work/main && .venv/bin/python kv_messenger/_checksum_build.py

The module's interface is csrc/checksum.h's cffi region (native_build.read_cdef); compiler flags
are native_build.cflags(openmp=False): one core hashes a run, the caller decides what runs where.
"""

import os
import runpy

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_REPO = os.path.dirname(_HERE)
_HEADER = os.path.join(_CSRC, "checksum.h")


def make_builder(absolute_sources: bool) -> FFI:
    """The module's builder (native_build.ffi_builder: setuptools takes relative sources, an in-place
    build absolute ones)."""
    # native_build.py by path: setuptools runs this file before any package here is importable.
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    return native_build["ffi_builder"](
        "kv_messenger._checksum", '#include "checksum.h"\n', cdef=native_build["read_cdef"](_HEADER),
        sources=[os.path.join(_CSRC, "checksum.c")], include_dirs=[_CSRC], openmp=False,
        absolute_sources=absolute_sources)


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    # Build in place: the .so lands next to this file (kv_messenger/_checksum*.so).
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    print(native_build["build_in_place"](make_builder(absolute_sources=True), _HERE, "pdserve-checksum-build-"))
