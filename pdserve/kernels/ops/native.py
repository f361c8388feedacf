"""The compiled CPU ops module (pdserve.kernels.ops._cpu_ops, built from csrc/ by _ops_build.py).

`lib` / `ffi` are None when the module is not built (or built for another interpreter); every
caller then falls back to torch. Importing this module never raises.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

try:
    from pdserve.kernels.ops import _cpu_ops

    ffi = _cpu_ops.ffi
    lib = _cpu_ops.lib
    IMPORT_ERROR: str | None = None
except ImportError as exc:
    ffi = None
    lib = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    logger.info("pdserve CPU ops unavailable (%s); torch runs every op. Build them with "
                "`python pdserve/kernels/ops/_ops_build.py` or `pip install -e .`", IMPORT_ERROR)


def available() -> bool:
    """True when the compiled module imported."""
    return lib is not None


def unavailable_reason() -> str | None:
    """Why the compiled module is missing (None when it is available)."""
    return IMPORT_ERROR
