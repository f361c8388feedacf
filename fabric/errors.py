"""The one exception type of the fabric transport."""

from __future__ import annotations

import os


def fi_strerror(code: int) -> str:
    """Render a libfabric error code (either sign) with ``fi_strerror``."""
    code = abs(int(code))
    try:
        from fabric._libfabric import ffi, lib
    except ImportError:  # extension not built: fall back to the OS text
        return os.strerror(code)
    return ffi.string(lib.fi_strerror(code)).decode("utf-8", "replace")


class FabricError(RuntimeError):
    """A libfabric operation failed, or a request was refused before posting.

    Attributes:
        code: positive libfabric errno (``FI_E*``), e.g. 111 for FI_ECONNREFUSED.
        context: what was being done, with the offending values.
    """

    def __init__(self, code: int, context: str) -> None:
        self.code = abs(int(code))
        self.context = context
        super().__init__(f"{context}: {fi_strerror(self.code)} (fi_errno {self.code})")

    def __reduce__(self):  # picklable across processes
        return (FabricError, (self.code, self.context))
