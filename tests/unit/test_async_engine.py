"""The asyncio streaming interface: concurrent streams, cancellation frees blocks, errors surface."""

from __future__ import annotations

import asyncio

import pytest
from support.wait import async_wait_until

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine():
    eng = EngineThread(LLMEngine(EngineConfig.from_options(num_blocks=256, num_threads=2)))
    yield eng
    eng.shutdown()


async def _collect(engine, prompt, params):
    text, ids, last = [], [], None
    async for out in engine.generate(prompt, params):
        text.append(out.delta_text)
        ids.extend(out.new_token_ids)
        last = out
    return "".join(text), ids, last


def test_concurrent_streams_equal_offline_generate(engine):
    prompts = ["The capital of France is", "def add(a, b):", "1, 2, 3,", "Hello, my name is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, params) for p in prompts])

    results = asyncio.run(main())
    offline = LLM(num_blocks=256).generate(prompts, params)
    for (text, ids, last), ref in zip(results, offline, strict=True):
        assert ids == list(ref.token_ids)
        assert text == ref.text == last.completion.text
        assert last.finished and last.finish_reason == "length"


def test_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    async def main():
        agen = engine.generate("Tell me a story. " * 10, SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in agen:
            if out.num_output_tokens >= 3:
                break
        await agen.aclose()
        await async_wait_until(lambda: engine.call(lambda: engine.engine.pool.num_used_blocks == 0), 5,
                               "the engine to free every block of the abandoned stream", interval=0.05)

    asyncio.run(main())
    assert engine.is_running


def test_bad_request_raises_to_the_caller_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(engine, "", SamplingParams())
        return await _collect(engine, "The capital of France is", SamplingParams(temperature=0, max_tokens=4))

    text, ids, last = asyncio.run(main())
    assert len(ids) == 4 and last.finished
