"""The fault network as a module-scoped pytest fixture named `net` (tests/support/netfault.py's
`fault_net`: two namespaces and a veth wire, torn down after the module). A test module that needs
it imports `fault_net_fixture` (pytest finds the fixture among the module's names). Set-up and
tear-down are bounded by netfault's own `ip` / `iptables` bounds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support import netfault as nf


@pytest.fixture(scope="module", name="net")
def fault_net_fixture() -> Iterator[nf.FaultNet]:
    with nf.fault_net() as n:
        yield n
