"""The libfabric settings a TransferEngine needs from the process environment (FabricConfig's
``tcp_nodelay`` and ``av_remove_cleanup``), applied when an endpoint is opened.

libfabric reads its FI_* variables once per process, when it first initializes (fi_ini, run by the
first fi_getinfo, which is inside the native open, csrc/pdf_core.c ``pdf_open``; loading the
extension does not initialize it): FI_AV_REMOVE_CLEANUP in the core, FI_TCP_NODELAY in the tcp
provider's init. So ``apply`` runs in ``Endpoint.__init__`` before ``pdf_open`` and sets each
variable only where the environment has no value (an explicit user setting wins, as libfabric
users expect). The values are process-wide: the first endpoint's config decides them, and a later
config that asks otherwise is refused (ValueError naming both), since libfabric would silently
keep the first. Child processes inherit what was set.

Threads: any thread that opens an endpoint; one lock guards the first application. Nothing here
waits beyond that lock, which is held only around environment reads and writes.
"""

from __future__ import annotations

import os
import threading

from fabric.config import FabricConfig

_lock = threading.Lock()
_asked: dict[str, tuple[str, str]] = {}   # FI_* variable -> (value the first config asked, its field)


def apply(config: FabricConfig) -> dict[str, str]:
    """Set ``config``'s FI_* variables where the environment has none (first endpoint of the
    process); return the values libfabric reads (the environment's). ValueError when an earlier
    endpoint's config asked a different value (libfabric keeps the first)."""
    wanted = config.libfabric_environment()
    with _lock:
        for name, (value, field) in wanted.items():
            first = _asked.get(name)
            if first is not None and first[0] != value:
                raise ValueError(f"FabricConfig.{field} asks {name}={value}, but this process's first endpoint "
                                 f"asked {name}={first[0]}: libfabric reads it once per process")
        for name, (value, field) in wanted.items():
            _asked.setdefault(name, (value, field))
            os.environ.setdefault(name, value)
        return {name: os.environ[name] for name in wanted}
