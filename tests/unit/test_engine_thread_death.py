"""A dead engine thread fails its pending and later calls at once (S1, S8), instead of leaving
them waiting forever.

Evidence: a real LLMEngine whose kv_connector's `on_schedule` hook raises a BaseException (which
the step's error handling does not catch: the thread dies) while calls and an abort are queued
behind the step and a stream is open: every queued call and the abort fail with EngineDeadError,
the stream ends with an error output, and later `call`, `abort`, `generate` and `submit` raise
EngineDeadError at once; `is_running` turns False. Each wait is bounded so that a regression
fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.connectors import NoOpPrefillConnector

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineDeadError, EngineThread
from pdserve.engine.llm_engine import LLMEngine

BOUND_S = 10.0   # the longest any failure may take to reach its caller here


class InjectedCrash(BaseException):
    """Not an Exception: nothing in the engine thread's loop catches it."""


class CrashingConnector(NoOpPrefillConnector):
    """A prefill connector whose on_schedule, once armed, waits until released, then raises."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def on_schedule(self, sched, block_ids) -> None:
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(BOUND_S)
            raise InjectedCrash("injected failure in on_schedule")


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies on purpose
def test_dead_engine_thread_fails_pending_and_later_calls():
    conn = CrashingConnector()
    engine = EngineThread(LLMEngine(EngineConfig.from_options(num_blocks=64, num_threads=1), kv_connector=conn))

    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = engine.generate("The capital of France is", params)
        first = await asyncio.wait_for(anext(stream), BOUND_S * 6)   # serving: one output arrived
        assert not first.finished and first.error is None
        conn.armed.set()
        await asyncio.wait_for(asyncio.to_thread(conn.entered.wait, BOUND_S), BOUND_S + 1)
        # queued behind the step that is about to die
        pending = [asyncio.ensure_future(engine.call(lambda i=i: i)) for i in range(3)]
        pending.append(asyncio.ensure_future(engine.abort("no-such-request")))
        await asyncio.sleep(0.1)
        assert not any(p.done() for p in pending)
        conn.release.set()
        for p in pending:
            with pytest.raises(EngineDeadError, match="InjectedCrash: injected failure in on_schedule"):
                await asyncio.wait_for(p, BOUND_S)
        rest = [out async for out in stream]   # the stream ends (bounded by the test timeout)
        assert rest and rest[-1].finished and rest[-1].error, rest[-1:]
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.call(lambda: 1), 1.0)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.abort("x"), 1.0)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(anext(engine.generate("hi", params)), 1.0)
        with pytest.raises(EngineDeadError):
            engine.submit(lambda: None)

    try:
        asyncio.run(main())
    finally:
        conn.release.set()
        engine.shutdown(timeout=BOUND_S)
