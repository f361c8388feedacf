"""The suite's root: markers by folder, the --require-native switch, and shared fixtures (the default
model, ours and transformers').

Folders: tests/unit (in-process and fast), tests/integration (processes, servers, clusters, whole
models end to end), tests/fabric (the transfer engine, with peer processes), tests/deploy (the
Kubernetes manifests and the container image); each test gets the
marker of its folder (`pytest -m unit`). Helpers live in tests/support (imported as `support.*`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support import native

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = ("unit", "integration", "fabric", "deploy", "bench")  # tests/<folder>/... -> pytest.mark.<folder>


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-native", action="store_true", default=False,
        help="fail at start if a native extension (" + ", ".join(native.NATIVE_MODULES) + ") does not import, "
             "and fail (not skip) the tests of a missing C backend")


def pytest_configure(config: pytest.Config) -> None:
    native.set_required(config.getoption("require_native"))
    if not native.required():
        return
    errors = native.import_errors()
    if errors:
        lines = "\n".join(f"  {module} (built by {native.NATIVE_MODULES[module]}): {error}"
                          for module, error in errors.items())
        raise pytest.UsageError(
            f"--require-native: {len(errors)} native extension(s) do not import:\n{lines}\n"
            "build them: .venv/bin/python -m pip install --no-deps --no-build-isolation -e .")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (given on the command line): no folder marker
            continue
        if folder in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture
def one_thread():
    """torch (and with it the C kernels) on one thread: a tiny model's ops are too small to split,
    and a second OpenMP thread only spins (several times slower on a loaded 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_source():
    from pdserve.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_default(default_source):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(default_source.path, dtype=torch.float32).eval()


REFERENCE_NEW_TOKENS = 24


@pytest.fixture(scope="session")
def hf_reference(hf_default, default_source):
    """transformers' greedy ids (REFERENCE_NEW_TOKENS each) for support.reference.REFERENCE_PROMPTS,
    computed once for every test module that compares against them."""
    from support.reference import REFERENCE_PROMPTS, hf_greedy

    from pdserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(default_source)
    return [hf_greedy(hf_default, tokenizer, p, REFERENCE_NEW_TOKENS) for p in REFERENCE_PROMPTS]
