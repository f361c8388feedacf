"""native_build.py (the cffi builders' helper) and the interface of the kernel modules built with it."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NB = runpy.run_path(str(ROOT / "native_build.py"))
read_cdef, cflags = NB["read_cdef"], NB["cflags"]

HEADERS = {
    "pdserve.kernels.attention._cpu_kernels": ROOT / "pdserve/kernels/attention/csrc/paged_attention.h",
    "pdserve.kernels.ops._cpu_ops": ROOT / "pdserve/kernels/ops/csrc/cpu_ops.h",
}


def _header(tmp_path: Path, body: str) -> str:
    path = tmp_path / "x.h"
    path.write_text(body)
    return str(path)


def test_read_cdef_returns_the_region_between_the_markers(tmp_path):
    path = _header(tmp_path, "#ifndef X\n/* cffi:begin */\n#define X_OK 0 /* ok */\n#define X_BIG 0x10\n"
                             "int x_f(int n);\n/* cffi:end */\nint hidden(void);\n#endif\n")
    assert read_cdef(path) == "#define X_OK 0 /* ok */\n#define X_BIG 0x10\nint x_f(int n);\n"


@pytest.mark.parametrize("body, message", [
    ("int f(void);\n", r"expected one '/\* cffi:begin \*/' line and one '/\* cffi:end \*/' line, found 0"),
    ("/* cffi:begin */\n/* cffi:begin */\n/* cffi:end */\n", r"found 2 at lines \[1, 2\] and 1 at lines \[3\]"),
    ("/* cffi:end */\n/* cffi:begin */\n", r"\(line 1\) comes before"),
    ("/* cffi:begin */\nint f(void);\n#define N ...\n/* cffi:end */\n",
     r"x.h:3: only '#define NAME <integer>'.*'#define N \.\.\.'"),
    ("/* cffi:begin */\n#include <stdint.h>\n/* cffi:end */\n", r"x.h:2: .*'#include <stdint.h>'"),
])
def test_read_cdef_refuses_bad_regions(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        read_cdef(_header(tmp_path, body))


def test_cflags_have_the_common_flags_and_openmp_only_when_asked():
    compile_args, link_args = cflags(openmp=False)
    assert compile_args[:2] == ["-O3", "-std=gnu11"] and "-fopenmp" not in compile_args + link_args
    assert not any("fast-math" in f for f in compile_args)
    with_omp, _ = cflags(openmp=True)
    assert [f for f in with_omp if f != "-fopenmp"] == compile_args


@pytest.mark.parametrize("module", sorted(HEADERS))
def test_built_module_exposes_exactly_its_header(module):
    lib = pytest.importorskip(module).lib
    cdef = read_cdef(str(HEADERS[module]))
    functions = set(re.findall(r"\b(\w+)\s*\(", re.sub(r"/\*.*?\*/", "", cdef, flags=re.S))) - {"void"}
    defines = dict(re.findall(r"#define\s+(\w+)\s+(\d+)", cdef))
    assert set(dir(lib)) == functions | set(defines)
    for name, value in defines.items():
        assert getattr(lib, name) == int(value)
