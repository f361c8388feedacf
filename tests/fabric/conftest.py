"""Fixtures for the fabric tests: real processes, real libfabric, loopback."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for path in (_HERE, _ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

PROVIDERS = ["shm", "tcp;ofi_rxm"]
# The TransferBackends (fabric.open_backend) the seam-level tests run over: the libfabric providers,
# and UCX (issue 32) with the transports it picks itself (on one host: shared memory) and with
# UCX_TLS=tcp (its TCP path, as between hosts).
BACKENDS = [*PROVIDERS, "ucx", "ucx-tcp"]


def pytest_configure(config: pytest.Config) -> None:
    # The integrator declares these in pyproject; repeat them so that running
    # this folder alone does not warn.
    config.addinivalue_line("markers", "rdma: needs an EFA or verbs NIC")
    config.addinivalue_line("markers", "slow: long-running test")


def _built() -> bool:
    try:
        import fabric._libfabric  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True)
def _need_extension() -> None:
    if not _built():
        pytest.skip("fabric._libfabric is not built: run `python fabric/_ffi_build.py` or `pip install -e .`")


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The provider name for FabricConfig: "ucx-tcp" is "ucx" with UCX_TLS=tcp in the environment
    (this process's and the peer processes' it spawns)."""
    if request.param.startswith("ucx"):
        _need_ucx()
    if request.param == "ucx-tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")
        return "ucx"
    return request.param


def _need_ucx() -> None:
    from fabric.ucx import load_native

    try:
        load_native()   # the libucx wheel's libraries, then the extension
    except ImportError as exc:
        pytest.fail(f"fabric._ucx does not import ({exc}): run `python fabric/_ucx_build.py` or scripts/setup.sh")
