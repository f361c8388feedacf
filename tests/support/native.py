"""The native (C) extensions, and the --require-native switch (tests/conftest.py sets it).

Without the switch a test of a C backend is skipped, or the C backend left out of a parametrize list,
when its extension cannot be imported (a checkout nobody built). With it the run fails at start naming
each extension that does not import, and the tests below fail instead of skipping."""

from __future__ import annotations

import importlib

import pytest

# Module -> the build that makes it (for the error message).
NATIVE_MODULES: dict[str, str] = {
    "fabric._libfabric": "fabric/_ffi_build.py",
    "pdserve.kernels.attention._cpu_kernels": "pdserve/kernels/attention/_kernels_build.py",
    "pdserve.kernels.ops._cpu_ops": "pdserve/kernels/ops/_ops_build.py",
    "kv_messenger._checksum": "kv_messenger/_checksum_build.py",
}

_required = False


class NativeMissing(RuntimeError):
    """A native extension is missing while --require-native is given."""


def set_required(value: bool) -> None:
    global _required
    _required = bool(value)


def required() -> bool:
    """Whether this run was given --require-native."""
    return _required


def import_errors() -> dict[str, str]:
    """Module -> "ExceptionType: message" for each native extension that does not import."""
    errors = {}
    for module in NATIVE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # not built, or built for another interpreter
            errors[module] = f"{type(exc).__name__}: {exc}"
    return errors


def missing(what: str, reason: str | None) -> NativeMissing:
    return NativeMissing(f"{what} is not available under --require-native: {reason} "
                         f"(build it: pip install --no-deps --no-build-isolation -e .)")


def skip_unless_built(available: bool, what: str, reason: str | None) -> pytest.MarkDecorator:
    """A skipif mark for tests that need `what` (a native extension); `reason` says why it is missing.
    Under --require-native a missing extension raises NativeMissing instead (at import of the test
    module: a collection error, so the run fails)."""
    if not available and _required:
        raise missing(what, reason)
    return pytest.mark.skipif(not available, reason=f"{what} not built: {reason}")


def with_cpu(available: bool, reason: str | None) -> list[str]:
    """Attention backends to parametrize over: "torch", and "cpu" when the C kernels import. Under
    --require-native a missing C backend raises NativeMissing instead of shrinking the list."""
    if not available and _required:
        raise missing("the C attention backend (pdserve.kernels.attention._cpu_kernels)", reason)
    return ["torch"] + (["cpu"] if available else [])
