"""cffi (API mode) build script for ``fabric._libfabric``.

The extension binds the system libfabric (Debian: ``libfabric1`` +
``libfabric-dev``, 1.17) and compiles our native helper ``csrc/pdf_core.c``
into it, so that batches of writes are posted and completions polled in C;
``csrc/pdf_wait.c`` is how its progress thread sleeps and wakes, ``csrc/pdf_shm.c``
how it survives shm peers that die holding a lock.

The cdef is read, never retyped: pdf_core.c's interface from ``csrc/pdf_core.h`` and the
wait modes from ``csrc/pdf_wait.h`` (the regions between their ``/* cffi:begin */`` and
``/* cffi:end */`` lines, native_build.read_cdef), plus the few libfabric names Python uses
itself (_LIBFABRIC_CDEF, values taken from libfabric's headers by the compiler). Compiler
flags: native_build.cflags(openmp=False) plus -Wall (below). native_build.py is loaded by
path, so fabric imports nothing of this repository.

setup.py uses it through ``cffi_modules=["fabric/_ffi_build.py:ffibuilder"]``;
during development build it in place with::

    python fabric/_ffi_build.py
"""

from __future__ import annotations

import os
import runpy

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_CSRC = os.path.join(_HERE, "csrc")
_REPO = os.path.dirname(_HERE)
_HEADERS = ("pdf_wait.h", "pdf_core.h")  # pdf_core.h's pdf_info.wait_mode holds PDF_WAIT_* values
_SOURCES = ("pdf_core.c", "pdf_wait.c", "pdf_shm.c")

# libfabric's own names that fabric's Python code uses (error codes, MR mode bits, message
# order bits, two functions); `...`: cffi asks the compiler for each value from the headers included below.
_LIBFABRIC_CDEF = """
#define FI_MR_LOCAL ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_ECANCELED ...
#define FI_ETIMEDOUT ...
#define FI_EINVAL ...
#define FI_EBUSY ...
#define FI_ESHUTDOWN ...
#define FI_EHOSTUNREACH ...
#define FI_ECONNREFUSED ...
#define FI_EMSGSIZE ...
#define FI_ENOENT ...
#define FI_EACCES ...
#define FI_EAGAIN ...
#define FI_ENOSYS ...
#define FI_ECONNRESET ...
#define FI_ORDER_RAR ...
#define FI_ORDER_RAW ...
#define FI_ORDER_WAR ...
#define FI_ORDER_WAW ...
#define FI_ORDER_SAS ...
#define FI_ORDER_RMA_WAW ...

const char *fi_strerror(int errnum);
uint32_t fi_version(void);
"""

_PREAMBLE = """
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

#include "pdf_wait.h"
#include "pdf_core.h"
"""

# Addition to the common flags: warnings on (fabric's C and its cffi wrapper are -Wall clean).
_EXTRA_COMPILE_ARGS = ["-Wall"]


def make_builder(absolute_sources: bool) -> FFI:
    """The FFI builder (native_build.ffi_builder: setuptools takes relative sources, an in-place
    build absolute ones)."""
    # native_build.py by path: setuptools runs this file before any package here is importable,
    # and fabric must not import anything of this repository.
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    cdef = "".join(native_build["read_cdef"](os.path.join(_CSRC, h)) for h in _HEADERS) + _LIBFABRIC_CDEF
    return native_build["ffi_builder"](
        "fabric._libfabric", _PREAMBLE, cdef=cdef, sources=[os.path.join(_CSRC, name) for name in _SOURCES],
        include_dirs=[_CSRC], openmp=False, absolute_sources=absolute_sources,
        extra_compile_args=tuple(_EXTRA_COMPILE_ARGS), libraries=("fabric",))


ffibuilder = make_builder(absolute_sources=False)  # setup.py: cffi_modules=[...:ffibuilder]

if __name__ == "__main__":
    # Build in place: the .so lands next to this file (fabric/_libfabric*.so).
    native_build = runpy.run_path(os.path.join(_REPO, "native_build.py"))
    print(native_build["build_in_place"](make_builder(absolute_sources=True), _HERE, "pdserve-fabric-build-"))
