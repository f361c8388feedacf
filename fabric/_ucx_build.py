"""cffi (API mode) build script for ``fabric._ucx``, the UCX core (``csrc/pdu_core.c``).

Which UCX: the ``libucx-cu12`` wheel (UCX 1.22, with headers; it runs without a GPU or CUDA: its
CUDA transports are plugins loaded only where CUDA exists). Debian bookworm's ``libucx-dev`` is
UCX 1.13, whose TCP put bandwidth measured 0.65 GB/s on this host's loopback against the wheel's
2.96 GB/s (``ucx_perftest -t ucp_put_bw -s 1048576``, issue 32), and the wheel installs with pip
into the venv like every other Python dependency (scripts/setup.sh, pyproject's build and runtime
requirements). The wheel is found with importlib (its ``include/`` and ``lib/``); without it the
system's UCX headers and libraries are used (``/usr/include/ucp``, Debian's libucx-dev).

The extension links libucp / libucs from the wheel's ``lib/`` with that directory as its rpath
(right for an in-place build); an isolated pip build links against the build environment's copy,
so at import fabric.ucx first loads the installed wheel's libraries (``libucx.load_library()``,
RTLD_LOCAL), which satisfy the extension's libucp.so.0 / libucs.so.0 by soname.

The cdef is read from ``csrc/pdu_core.h`` (native_build.read_cdef), as for fabric._libfabric.
setup.py uses it through ``cffi_modules=["fabric/_ucx_build.py:ffibuilder"]``; in place::

    python fabric/_ucx_build.py
"""

from __future__ import annotations

import importlib.util
import os
import runpy

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_REPO = os.path.dirname(_HERE)

_PREAMBLE = """
#include <ucp/api/ucp.h>
#include "pdu_core.h"
"""


def ucx_prefix() -> str | None:
    """The libucx wheel's directory (holding include/ and lib/), or None to use the system's UCX."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    prefix = list(spec.submodule_search_locations)[0]
    return prefix if os.path.isfile(os.path.join(prefix, "include", "ucp", "api", "ucp.h")) else None


def make_builder(absolute_sources: bool) -> FFI:
    """The FFI builder (native_build.ffi_builder; see fabric/_ffi_build.py for absolute_sources)."""
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    prefix = ucx_prefix()
    # -isystem: UCX's own headers are not -Wall -Wextra clean (its UCS_MASK), ours are
    system_include = ("-isystem", os.path.join(prefix, "include")) if prefix else ()
    lib_dirs = (os.path.join(prefix, "lib"),) if prefix else ()
    return native_build["ffi_builder"](
        "fabric._ucx", _PREAMBLE, cdef=native_build["read_cdef"](os.path.join(_CSRC, "pdu_core.h")),
        sources=[os.path.join(_CSRC, "pdu_core.c")], include_dirs=[_CSRC], openmp=False,
        absolute_sources=absolute_sources, extra_compile_args=("-Wall", *system_include), libraries=("ucp", "ucs"),
        library_dirs=lib_dirs, extra_link_args=tuple(f"-Wl,-rpath,{d}" for d in lib_dirs))


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    print(native_build["build_in_place"](make_builder(absolute_sources=True), _HERE, "pdserve-ucx-build-"))
