"""Build-time helpers shared by the cffi builders: the cdef of a module read from its C header, and
the C compiler flags probed on this machine.

Build time only: setuptools runs the builders listed in setup.py's ``cffi_modules``
(``fabric/_ffi_build.py``, ``pdserve/kernels/attention/_kernels_build.py``,
``pdserve/kernels/ops/_ops_build.py``) as plain files before any package of this repository is
importable, so each builder loads this file by path::

    nb = runpy.run_path(os.path.join(<repository root>, "native_build.py"))
    builder = nb["ffi_builder"]("pkg._mod", '#include "mod.h"\n', cdef=nb["read_cdef"](header_path),
                                sources=[...], include_dirs=[...], openmp=True, absolute_sources=False)
    nb["build_in_place"](builder_with_absolute_sources, next_to_the_builder, "pkg-mod-")   # __main__

It imports nothing from the repository and, outside the standard library, only cffi (which every
builder needs anyway), inside `ffi_builder`.

The cdef of a module lives in its public C header, between two marker lines::

    /* cffi:begin */
    #define XX_OK 0
    int xx_forward(float *out, const float *x, int n);
    /* cffi:end */

so the header the C sources include and the declarations cffi binds are one text. The region
holds plain declarations (functions, structs, typedefs) and ``#define NAME <integer literal>``;
it is compiled as C too, so cffi's ``#define NAME ...`` (value asked from the compiler) has no
place in it, and neither has any other preprocessor line (``#include``, ``#if``...), which cffi's
cdef parser cannot read.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile

logger = logging.getLogger(__name__)

CDEF_BEGIN = "/* cffi:begin */"
CDEF_END = "/* cffi:end */"

_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_INT_DEFINE = re.compile(r"#\s*define\s+[A-Za-z_]\w*\s+-?(0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*")


def read_cdef(header_path: str) -> str:
    """The text of ``header_path`` between its ``/* cffi:begin */`` and ``/* cffi:end */`` lines.

    Raises ValueError naming the file and line when the markers are missing, repeated or out of
    order, or when the region holds a preprocessor line other than ``#define NAME <int>``.
    """
    with open(header_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip() == CDEF_BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == CDEF_END]
    if len(begins) != 1 or len(ends) != 1:
        raise ValueError(
            f"{header_path}: expected one {CDEF_BEGIN!r} line and one {CDEF_END!r} line, found "
            f"{len(begins)} at lines {[i + 1 for i in begins]} and {len(ends)} at lines {[i + 1 for i in ends]}"
        )
    begin, end = begins[0], ends[0]
    if end < begin:
        raise ValueError(f"{header_path}: {CDEF_END!r} (line {end + 1}) comes before {CDEF_BEGIN!r} (line {begin + 1})")
    region = "\n".join(lines[begin + 1 : end]) + "\n"
    # Check the directives with comments blanked out (newlines kept, so line numbers stay right).
    bare = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), region)
    for offset, line in enumerate(bare.splitlines()):
        text = line.strip()
        if text.startswith("#") and _INT_DEFINE.fullmatch(text) is None:
            raise ValueError(
                f"{header_path}:{begin + 2 + offset}: only '#define NAME <integer>' may appear between the cffi "
                f"markers, found {text!r}"
            )
    return region


def compiler() -> str:
    """The C compiler setuptools will use (first word of $CC, else sysconfig's CC, else 'cc')."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return cc.split()[0]


def accepts(flags: list[str], source: str = "int main(void) { return 0; }\n") -> bool:
    """Whether the compiler compiles and links the tiny program ``source`` with ``flags``."""
    cc = compiler()
    if shutil.which(cc) is None:
        logger.warning("compiler %r not found while probing flags %s", cc, flags)
        return False
    with tempfile.TemporaryDirectory(prefix="pdserve-probe-") as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        cmd = [cc, *flags, src, "-o", os.path.join(tmp, "probe")]
        # A probe of a two-line program; 60 s bounds a wedged compiler.
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    if result.returncode != 0:
        logger.warning("compiler %r rejects %s: %s", cc, flags, result.stderr.strip()[:300])
    return result.returncode == 0


_OMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"


def cflags(openmp: bool) -> tuple[list[str], list[str]]:
    """(extra_compile_args, extra_link_args) for a module built on this machine.

    Common flags: ``-O3 -std=gnu11``; ``-march=native`` when the compiler accepts it (a module
    is built on the machine that runs it); with ``openmp``, ``-fopenmp`` for compiling and
    linking when the compiler and its runtime accept it. A flag the compiler rejects is left out
    with a warning, so such a compiler still yields a working, slower module. Then the words of
    ``$PDSERVE_KERNEL_CFLAGS`` (development only). Never ``-ffast-math``: the attention kernel
    masks with -inf and the kernels rely on a fixed summation order.

    A builder appends its own exceptions after these, each commented with why (the CPU ops add
    ``-ffp-contract=off``; fabric adds warnings).
    """
    compile_args = ["-O3", "-std=gnu11"]
    link_args: list[str] = []
    if accepts(["-march=native"]):
        compile_args.append("-march=native")
    if openmp and accepts(["-fopenmp"], _OMP_PROBE):
        compile_args.append("-fopenmp")
        link_args.append("-fopenmp")
    compile_args += os.environ.get("PDSERVE_KERNEL_CFLAGS", "").split()
    return compile_args, link_args


def ffi_builder(module: str, preamble: str, *, cdef: str, sources: list[str], include_dirs: list[str],
                openmp: bool, absolute_sources: bool, extra_compile_args: tuple[str, ...] = (),
                libraries: tuple[str, ...] = (), library_dirs: tuple[str, ...] = (),
                extra_link_args: tuple[str, ...] = ()):
    """One cffi (API mode) builder: `module` compiled from `preamble` plus `sources` (absolute paths)
    with this machine's `cflags(openmp)` and then the builder's own `extra_compile_args`.

    absolute_sources: setuptools wants the C files relative to its working directory (the
    repository root; it refuses absolute paths), cffi's own compile() runs in a temporary directory
    and needs them absolute. library_dirs / extra_link_args: where `libraries` live when not on
    the system's path (fabric._ucx: the libucx wheel's lib/, with its rpath)."""
    from cffi import FFI

    compile_args, link_args = cflags(openmp)
    builder = FFI()
    builder.cdef(cdef)
    builder.set_source(
        module,
        preamble,
        sources=list(sources) if absolute_sources else [os.path.relpath(p) for p in sources],
        include_dirs=list(include_dirs),
        libraries=list(libraries),
        library_dirs=list(library_dirs),
        extra_compile_args=[*compile_args, *extra_compile_args],
        extra_link_args=[*link_args, *extra_link_args],
    )
    return builder


def build_in_place(builder, target_dir: str, prefix: str) -> str:
    """Compile `builder` (made with absolute_sources=True) in a temporary directory and move the
    module into `target_dir` (next to its builder: where the package imports it); its path."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        so_path = builder.compile(tmpdir=tmp, verbose=False)
        target = os.path.join(target_dir, os.path.basename(so_path))
        os.replace(so_path, target)
    return target

