"""fabric._libfabric exposes exactly what its headers declare (csrc/pdf_core.h, csrc/pdf_wait.h)
plus the few libfabric names the builder binds itself: the C interface is typed once."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "fabric" / "csrc"
NB = runpy.run_path(str(ROOT / "native_build.py"))
BUILD = runpy.run_path(str(ROOT / "fabric" / "_ffi_build.py"), run_name="fabric_ffi_build_under_test")


def _names(cdef: str) -> tuple[set[str], dict[str, int]]:
    """(function names, {define: value}) of a cdef text."""
    bare = re.sub(r"/\*.*?\*/", "", cdef, flags=re.S)
    functions = set(re.findall(r"\b(\w+)\s*\(", bare)) - {"void"}
    defines = {name: int(value) for name, value in re.findall(r"#define\s+(\w+)\s+(\d+)[uUlL]*", bare)}
    return functions, defines


def test_the_builder_declares_no_pdf_name_of_its_own() -> None:
    own = BUILD["_LIBFABRIC_CDEF"]
    assert "pdf_" not in own.lower(), "pdf_core.c's interface belongs in csrc/pdf_core.h"
    functions, _ = _names(own)
    assert functions == {"fi_strerror", "fi_version"}


def test_built_module_exposes_exactly_its_headers() -> None:
    from fabric._libfabric import lib

    functions, defines = set(), {}
    for header in BUILD["_HEADERS"]:
        f, d = _names(NB["read_cdef"](str(CSRC / header)))
        functions |= f
        defines |= d
    libfabric_functions, _ = _names(BUILD["_LIBFABRIC_CDEF"])
    libfabric_defines = set(re.findall(r"#define\s+(FI_\w+)\s+\.\.\.", BUILD["_LIBFABRIC_CDEF"]))
    assert set(dir(lib)) == functions | set(defines) | libfabric_functions | libfabric_defines
    for name, value in defines.items():
        assert getattr(lib, name) == value, name


@pytest.mark.parametrize("name, value", [("PDF_IMM_TAG_MAX", (1 << 24) - 1), ("PDF_IMM_UNIT_MAX", 255)])
def test_immediate_data_layout_matches_the_python_side(name: str, value: int) -> None:
    from fabric import IMM_TAG_MAX
    from fabric._libfabric import lib

    assert getattr(lib, name) == value
    assert IMM_TAG_MAX == lib.PDF_IMM_TAG_MAX
