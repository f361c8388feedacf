"""The message orders fabric asks for and reports (csrc/pdf_core.c open_info: SAS + WAW, WAW the
last given up): TransferEngine.tx_order / rx_order are what the provider granted, read from the
fi_info it returned, and `writes_ordered` is what the prefill node's delivery fence relies on
(prefill_node.service: a fence is posted only where it holds)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from fabric import FabricConfig, TransferEngine

PROVIDERS = (("tcp;ofi_rxm", "127.0.0.1"), ("shm", None))


def _advertised(provider: str) -> set[str]:
    """The FI_ORDER_* names fi_info lists for `provider`'s RDM endpoints (tx and rx, all domains)."""
    text = subprocess.run(["fi_info", "-p", provider, "-t", "FI_EP_RDM", "-v"], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    names: set[str] = set()
    for line in re.findall(r"msg_order: \[([^\]]*)\]", text):
        names |= {n.strip().removeprefix("FI_ORDER_") for n in line.split(",") if n.strip()}
    return names


@pytest.mark.parametrize("provider,node", PROVIDERS, ids=[p for p, _ in PROVIDERS])
def test_granted_orders_are_reported(provider: str, node: str | None) -> None:
    with TransferEngine(FabricConfig(provider=provider, node=node)) as engine:
        tx, rx = engine.tx_order, engine.rx_order
        print(f"\n{provider}: tx {sorted(tx)} rx {sorted(rx)} writes_ordered {engine.writes_ordered}")
        assert "SAS" in tx and "SAS" in rx, "control messages need send-after-send order (always asked)"
        assert engine.writes_ordered == (bool({"WAW", "RMA_WAW"} & tx) and bool({"WAW", "RMA_WAW"} & rx))
        if shutil.which("fi_info") is None:
            pytest.skip("fi_info is not installed: the grant is not compared with what the provider advertises")
        advertised = _advertised(provider)
        assert tx <= advertised and rx <= advertised, f"reported orders the provider does not advertise: {advertised}"
        if "WAW" in advertised:   # asked for, so granted where offered
            assert "WAW" in tx and "WAW" in rx and engine.writes_ordered
