"""Free TCP ports for servers a test starts itself (the launcher's picker: one implementation, tested in
tests/integration/test_cluster.py)."""

from __future__ import annotations

from pdserve.tools.launcher import free_ports

__all__ = ["free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on `host` now (bound to port 0 and released: a race is possible, but unlikely)."""
    (port,) = free_ports(1, host)
    return port
