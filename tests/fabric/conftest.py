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
