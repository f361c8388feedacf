"""FabricConfig's libfabric settings (tcp_nodelay, av_remove_cleanup; fabric.environment): set in the
process environment when the first endpoint opens, not when fabric is imported; an explicit FI_*
value in the environment wins; a later config asking otherwise is refused. Each case runs in a fresh
interpreter, since libfabric reads the variables once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fabric import FabricConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = ("FI_TCP_NODELAY", "FI_AV_REMOVE_CLEANUP")

CHILD = """
import json, os
from fabric import FabricConfig, TransferEngine
seen = {"imported": {n: os.environ.get(n) for n in %(names)r}}
with TransferEngine(FabricConfig(provider=%(provider)r, **%(config)r)):
    seen["opened"] = {n: os.environ.get(n) for n in %(names)r}
try:
    TransferEngine(FabricConfig(provider=%(provider)r, **%(second)r)).close()
    seen["second"] = "opened"
except ValueError as e:
    seen["second"] = str(e)
print(json.dumps(seen))
"""


# Two tcp engines in one process: after a write, the TCP_NODELAY option of the process's TCP sockets,
# and how many sockets a disconnect closes (rxm closes the connection only with FI_AV_REMOVE_CLEANUP).
EFFECT = """
import json, os, socket, time
from fabric import FabricConfig, PageWrites, TransferEngine
from pdserve.engine.cache.hostmem import alloc_buffer

def tcp_sockets():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                out.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
        finally:
            s.close()
    return out

cfg = FabricConfig(provider="tcp;ofi_rxm", node="127.0.0.1", **%(config)r)
a, b = TransferEngine(cfg), TransferEngine(cfg)
pa, pb = alloc_buffer(1 << 16), alloc_buffer(1 << 16)
ra, rb = a.register(pa.view), b.register(pb.view)
a.write_sync(PageWrites(ra, [0], rb.descriptor, [0], [4096], 1), timeout=10)
before = tcp_sockets()
a.disconnect(b.peer_descriptor)
deadline = time.monotonic() + 5
while len(tcp_sockets()) == len(before) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"nodelay": before, "closed": len(before) - len(tcp_sockets())}))
a.close(); b.close()
"""


def _run(provider: str, config: dict, second: dict, env: dict[str, str]) -> dict:
    """CHILD in a fresh interpreter whose environment has neither variable, plus `env`."""
    return _child(CHILD % {"names": NAMES, "provider": provider, "config": config, "second": second}, env)


def _child(code: str, env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in NAMES}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_defaults_are_set_at_open_not_at_import(provider: str) -> None:
    seen = _run(provider, {}, {}, {})
    assert seen["imported"] == {"FI_TCP_NODELAY": None, "FI_AV_REMOVE_CLEANUP": None}
    assert seen["opened"] == {"FI_TCP_NODELAY": "1", "FI_AV_REMOVE_CLEANUP": "1"}
    assert seen["second"] == "opened"        # the same asks: fine


def test_an_explicit_environment_value_wins() -> None:
    seen = _run("tcp;ofi_rxm", {}, {}, {"FI_TCP_NODELAY": "0"})
    assert seen["opened"] == {"FI_TCP_NODELAY": "0", "FI_AV_REMOVE_CLEANUP": "1"}


def test_config_fields_reach_the_environment_and_a_contrary_later_config_is_refused() -> None:
    seen = _run("tcp;ofi_rxm", {"tcp_nodelay": False}, {}, {})
    assert seen["opened"] == {"FI_TCP_NODELAY": "0", "FI_AV_REMOVE_CLEANUP": "1"}
    assert "FabricConfig.tcp_nodelay asks FI_TCP_NODELAY=1" in seen["second"]
    assert "first endpoint asked FI_TCP_NODELAY=0" in seen["second"]


@pytest.mark.parametrize("field", ["tcp_nodelay", "av_remove_cleanup"])
def test_fields_must_be_bools(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=1: expected a bool"):
        FabricConfig(**{field: 1})
    assert FabricConfig(**{field: False}).libfabric_environment()[
        {"tcp_nodelay": "FI_TCP_NODELAY", "av_remove_cleanup": "FI_AV_REMOVE_CLEANUP"}[field]] == ("0", field)


@pytest.mark.timeout(60)
def test_the_values_take_effect_in_libfabric() -> None:
    # applied at the first open, before libfabric initializes: the tcp provider's sockets carry
    # TCP_NODELAY, and a disconnect closes the peer's connection; asked off, neither happens
    on = _child(EFFECT % {"config": {}}, {})
    assert on["nodelay"] and all(on["nodelay"]), on
    assert on["closed"] > 0, on
    off = _child(EFFECT % {"config": {"tcp_nodelay": False, "av_remove_cleanup": False}}, {})
    assert off["nodelay"] and not any(off["nodelay"]), off
    assert off["closed"] == 0, off
