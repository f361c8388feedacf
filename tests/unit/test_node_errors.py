"""Whose failure ended a request (S10): a node's errors are marked so that a router moves the request
to another node, a request's own are not.

- A real engine thread: a failed step (an Exception: a request of its batch may be the cause) ends
  its streams with node_error False; shutting the engine down ends the streams still open with
  node_error True; GenerateResponse.error_cause says the same on the wire.
- The router's test of a final message (router.service._node_error): only an ERROR message of
  ERROR_CAUSE_NODE without tokens is moved; an unclassified ERROR (a request's) never is.
(The death of an engine thread and the router's migration with real processes:
tests/integration/test_migration.py.)
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from support.connectors import NoOpPrefillConnector

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.serving.convert import output_to_pb
from pdserve_api.v1 import generate_pb2
from router.service import _node_error

BOUND_S = 60.0   # the longest any output may take to arrive here (two shared cores)


class FailingConnector(NoOpPrefillConnector):
    """A prefill connector whose on_schedule raises a RuntimeError once armed (the step fails)."""

    def __init__(self) -> None:
        self.armed = threading.Event()

    def on_schedule(self, sched, block_ids) -> None:
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("injected step failure")


@pytest.mark.timeout(300)
def test_a_failed_step_is_the_requests_error_and_a_stopped_engine_the_nodes():
    conn = FailingConnector()
    engine = EngineThread(LLMEngine(EngineConfig.from_options(num_blocks=64, num_threads=1), kv_connector=conn))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def failed_step() -> RequestOutput:
        stream = engine.generate("The capital of France is", params)
        first = await asyncio.wait_for(anext(stream), BOUND_S)
        assert not first.finished
        conn.armed.set()
        rest = [out async for out in stream]
        return rest[-1]

    async def stopped_engine() -> RequestOutput:
        stream = engine.generate("Once upon a time", params)
        await asyncio.wait_for(anext(stream), BOUND_S)
        await asyncio.to_thread(engine.shutdown, BOUND_S)
        rest = [out async for out in stream]
        return rest[-1]

    try:
        step = asyncio.run(asyncio.wait_for(failed_step(), 2 * BOUND_S))
        assert step.finished and "injected step failure" in (step.error or "") and not step.node_error
        assert output_to_pb(step).error_cause == generate_pb2.ERROR_CAUSE_UNSPECIFIED
        assert engine.is_running   # a failed step does not stop the engine
        stopped = asyncio.run(asyncio.wait_for(stopped_engine(), 2 * BOUND_S))
        assert stopped.finished and stopped.error and stopped.node_error, stopped
        msg = output_to_pb(stopped)
        assert msg.finish_reason == generate_pb2.FINISH_REASON_ERROR
        assert msg.error_cause == generate_pb2.ERROR_CAUSE_NODE
    finally:
        engine.shutdown(timeout=BOUND_S)


def _final(node_error: bool, error: str | None = "boom", tokens: tuple[int, ...] = ()) -> generate_pb2.GenerateResponse:
    completion = CompletionOutput(text="", token_ids=tokens, finish_reason="error" if error else "length")
    return output_to_pb(RequestOutput(request_id="r", new_token_ids=tokens, delta_text="", finished=True,
                                      num_prompt_tokens=3, num_output_tokens=len(tokens), completion=completion,
                                      error=error, node_error=node_error))


def test_the_router_moves_only_a_nodes_error_without_tokens():
    assert _node_error(_final(node_error=True))
    assert not _node_error(_final(node_error=False))                  # a request's (or unclassified) error
    assert not _node_error(_final(node_error=True, tokens=(5,)))      # tokens the client must get: passed on
    assert not _node_error(_final(node_error=True, error=None))       # no error at all
    assert not _node_error(generate_pb2.GenerateResponse(token_ids=[1]))   # not a final message
