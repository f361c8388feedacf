"""Which models prefill and decode nodes serve disaggregated (E8).

The KV messenger sends every attention group's pages: a hybrid model (Gemma 3: "full" and
"sliding" groups) runs disaggregated (tests/integration/test_disagg_hybrid.py). A request's
pages are named by its "full" group's table, so a model with no full-attention layer (a
sliding-only Mistral config) is refused by both node kinds when they build their engine and
messenger, with an error naming the model, its groups and what is missing; the engine thread
they started is stopped. A colocated decode node serves it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.tiny_models import make_tiny_checkpoint

from kv_messenger import UnsupportedModelError
from pdserve.engine.config import EngineConfig
from pdserve.model.loader import resolve_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_sliding(tmp_path_factory) -> str:
    """A tiny Mistral config with a window: every layer slides (no full-attention group)."""
    return str(make_tiny_checkpoint("mistral", tmp_path_factory.mktemp("mistral") / "tiny-sliding",
                                    sliding_window=16))


def _config(model: str) -> EngineConfig:
    return EngineConfig.from_options(model=model, num_blocks=64, page_size=4, num_threads=1, max_batch_tokens=24)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pdserve-engine" and t.is_alive()]


def _check_message(message: str, model: str) -> None:
    name = resolve_model(model).name
    assert f"model {name!r}" in message
    assert "'sliding' (2 layers: [0, 1], window 16 tokens)" in message
    assert "needs a 'full' group" in message and "colocated" in message


def test_prefill_node_refuses_a_sliding_only_model(tiny_sliding):
    from prefill_node.service import PrefillNode, PrefillNodeConfig

    before = len(_engine_threads())
    with pytest.raises(UnsupportedModelError) as err:
        PrefillNode(PrefillNodeConfig(engine=_config(tiny_sliding), provider="shm"))
    _check_message(str(err.value), tiny_sliding)
    assert len(_engine_threads()) == before, "the refused node left its engine thread running"


def test_decode_node_refuses_a_sliding_only_model_unless_colocated(tiny_sliding):
    from decode_node.service import DecodeNode, DecodeNodeConfig

    before = len(_engine_threads())

    async def build(colocated: bool) -> None:
        node = DecodeNode(DecodeNodeConfig(_config(tiny_sliding), "decode-test", colocated=colocated,
                                           prefill_addresses=() if colocated else ("127.0.0.1:1",), provider="shm"))
        await node.start()
        try:
            assert node.llm.cache_manager.group_names == ("sliding",)
        finally:
            await node.close()

    with pytest.raises(UnsupportedModelError) as err:
        asyncio.run(build(colocated=False))
    _check_message(str(err.value), tiny_sliding)
    assert len(_engine_threads()) == before, "the refused node left its engine thread running"
    asyncio.run(build(colocated=True))  # colocated: no messenger, served


def test_node_processes_exit_with_the_reason(tiny_sliding, tmp_path):
    decode = subprocess.run(
        [sys.executable, "-m", "decode_node", "--port", "0", "--prefill", "127.0.0.1:1", "--provider", "shm",
         "--model", tiny_sliding, "--num-blocks", "64", "--page-size", "4", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert decode.returncode == 2, decode.stderr[-3000:]
    assert "failed to start: UnsupportedModelError" in decode.stderr
    _check_message(decode.stderr, tiny_sliding)

    prefill = subprocess.run(
        [sys.executable, "-m", "prefill_node", "--port", "0", "--provider", "shm",
         "--model", tiny_sliding, "--num-blocks", "64", "--page-size", "4", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert prefill.returncode == 2, prefill.stderr[-3000:]
    assert "failed to start: UnsupportedModelError" in prefill.stderr
    _check_message(prefill.stderr, tiny_sliding)
