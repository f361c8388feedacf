"""The launcher's children run the checkout the launcher runs from (pdserve.tools.cluster.child)."""

import os
from pathlib import Path

import pytest

from pdserve.tools.cluster.child import child_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_goes_first_on_the_childrens_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    path = child_env().get("PYTHONPATH", "").split(os.pathsep)
    assert path[0] == str(ROOT) and (ROOT / "router").is_dir(), path
    assert path[1:] == ["/elsewhere"]
