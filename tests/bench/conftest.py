"""Fixtures of the benchmarks' smoke runs (tests/bench): a tiny checkpoint for the session, and
`bench`, which runs `python -m bench.<module>` with its report files going to the test's tmp_path
(never into bench/results/). The runner and the checks are in bench_smoke.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from bench_smoke import SMOKE_TIMEOUT_S, BenchRun, run_bench


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random llama of hidden 64 with the default model's tokenizer (tests/support/tiny_models.py),
    6 layers so that the spec benchmarks' 4-layer self-draft fits; every smoke run shares it."""
    from support.tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("bench-tiny") / "llama", num_hidden_layers=6))


@pytest.fixture
def bench(tmp_path: Path) -> Callable[..., BenchRun]:
    def run(module: str, *args: str, timeout_s: float = SMOKE_TIMEOUT_S, **env: str) -> BenchRun:
        return run_bench(module, *args, tmp_path=tmp_path, timeout_s=timeout_s, **env)

    return run
