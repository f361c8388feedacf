"""The thread that drives an engine for asyncio servers, with a streaming front.

One background thread owns the `LLMEngine` and runs schedule -> run -> update; asyncio callers
talk to it only through a command queue, so the engine is never touched by two threads.

    engine = EngineThread(LLMEngine(EngineConfig()))
    async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=8)):
        print(out.delta_text, end="")

A consumer that stops iterating early (client disconnect, task cancelled) aborts its request, and
the request's blocks are freed on the engine thread. If a step raises, every in-flight request
ends with an explicit error output (nothing is dropped silently, S1) and the engine keeps serving.
When idle, the engine thread checks the cache invariant (free + used == total).

A dead engine thread (an error escaped its loop: a BaseException from a step, a failed
invariant, a failure while failing the requests) or a stopped one fails everything at once with
EngineDeadError instead of leaving callers waiting: the `call`s / `abort`s queued and not run,
every stream still open (it ends with an error output), and every later `call`, `abort`,
`generate` and `submit`. Blocking waits: none without a bound on a dead thread; `shutdown` joins
the thread for at most its `timeout`. The error outputs of a dead or stopped engine thread say
`node_error=True` (the node failed, not the request: a router resumes the request elsewhere, S10);
a failed step's do not (a request of its batch may be what failed it).

Test-only fault injection: built with a fault plan whose `engine_death_file` is set
(pdserve.engine.faults; a node's entry point reads it from $PDSERVE_TEST_ONLY_ENGINE_DEATH_FILE,
never set in production), the engine thread dies as from a BaseException escaping a step once
that file exists, checked before every step and idle tick; with no plan, nothing is checked.

Metrics: after every step, and at every idle tick (at least once a second), the engine thread
stores `engine.metrics()` in `last_metrics` and refreshes `last_load` (which the engine also takes
when it schedules each pass, so the pages of the pass running now count): frozen snapshots that any
thread may read (a Prometheus scrape or a NodeInfo call reads them without waiting for a forward
pass or touching engine state).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.faults import ENGINE_DEATH_FILE_ENV, NO_FAULTS, FaultPlan
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import TransferRole
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import EngineLoad, EngineMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


TEST_DEATH_FILE_ENV = ENGINE_DEATH_FILE_ENV   # deprecated alias: pdserve.engine.faults.ENGINE_DEATH_FILE_ENV


class InjectedEngineDeath(BaseException):
    """The test-only fault of FaultPlan.engine_death_file (a BaseException: it ends the thread)."""


_Command = Callable[[], None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class EngineThread:
    def __init__(self, engine: LLMEngine, faults: FaultPlan = NO_FAULTS) -> None:
        """Start the thread that owns `engine` from now on (no other thread may touch it); `faults`:
        the test-only fault plan (its engine_death_file), none by default."""
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Why the thread no longer serves (None while it does); set under _state, after which
        # nothing is queued any more and every call still pending is failed (_die).
        self._dead: str | None = None
        self._state = threading.Lock()
        self._pending: dict[_Command, concurrent.futures.Future] = {}   # call()s queued, not run yet
        self.last_metrics: EngineMetrics | None = None  # written by the engine thread only
        engine.last_load = engine.load()
        self._metrics_failed = False
        self._test_death_file = faults.engine_death_file
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    # --- public, any thread / event loop ---------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        role: TransferRole = TransferRole.LOCAL,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError (from the engine's validation) for bad input.

        role: the request's TransferRole (LOCAL; PREFILL on prefill nodes; REMOTE_PREFILL on
        decode nodes), as in LLMEngine.add_request.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        add = asyncio.ensure_future(self.call(lambda: self._add(prompt, params, request_id, stream, role)))
        try:
            rid = await asyncio.shield(add)
        except asyncio.CancelledError:
            # The caller went away while the request was being added: the add still runs (or ran)
            # on the engine thread, so the request is aborted once it exists, never left running.
            add.add_done_callback(self._abort_added)
            raise
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.submit(lambda: self._abort(rid))

    def _abort_added(self, add: asyncio.Future) -> None:
        """Loop: the add of a request whose caller was cancelled has ended; abort what it added."""
        if add.cancelled() or add.exception() is not None:
            return   # nothing was added (the error reached nobody: its caller is gone)
        rid = add.result()
        try:
            self.submit(lambda: self._abort(rid))
        except EngineDeadError as e:   # the engine is gone, and the request with it
            logger.info("request %s: not aborted after its caller left: %s", rid, e)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True if it was still running."""
        return await self.call(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[], object]) -> object:
        """Run fn on the engine thread and await its result (exceptions propagate)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            with self._state:
                self._pending.pop(run, None)
            if not fut.set_running_or_notify_cancel():
                return  # the caller was cancelled while the command was queued
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting caller, not swallowed
                fut.set_exception(e)
            else:
                fut.set_result(result)

        self._queue(run, fut)
        return await asyncio.wrap_future(fut)

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue fn for the engine thread; EngineDeadError if it no longer serves."""
        self._queue(fn, None)

    def _queue(self, fn: _Command, fut: concurrent.futures.Future | None) -> None:
        with self._state:
            if self._dead is not None or not self._thread.is_alive():
                raise EngineDeadError(f"the engine thread is not running ({self._dead or 'stopped'})")
            if fut is not None:
                self._pending[fn] = fut
            self._commands.put(fn)
        self._wake.set()

    def wake(self) -> None:
        """Any thread: wake an idle engine thread (a connector queued events for it to take)."""
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def last_load(self) -> EngineLoad:
        """The engine's load as of its last scheduled pass or idle tick (routing, NodeInfo.load)."""
        load = self.engine.last_load
        assert load is not None   # set before the thread starts
        return load

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    # --- engine thread ---------------------------------------------------------------------------

    def _add(self, prompt, params, request_id, stream: _Stream, role: TransferRole) -> str:
        r = self.engine.add_request(prompt, params, request_id, role)
        self._streams[r.request_id] = stream
        return r.request_id

    def _abort(self, request_id: str) -> bool:
        out = self.engine.abort_request(request_id)
        if out is None:
            return False
        self.deliver(out)
        return True

    def deliver(self, out: RequestOutput) -> None:
        """Engine thread: route an output to its stream (for outputs produced outside step())."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            logger.debug("dropping output for %s: its event loop is closed", out.request_id)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            logger.critical("the engine thread died; failing every in-flight request", exc_info=True)
            self._die(f"the engine thread died: {type(e).__name__}: {e}")
            raise
        self._die("the engine was shut down")

    def _die(self, reason: str) -> None:
        """Engine thread, last: refuse new commands, fail the queued calls and every open stream."""
        with self._state:
            self._dead = reason
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(reason))
        try:
            self._fail_all(reason, node_error=True)
        except BaseException:   # the engine is broken: end the streams without it
            logger.exception("failing the in-flight requests through the engine failed; ending their streams")
        for rid, stream in list(self._streams.items()):
            del self._streams[rid]
            out = RequestOutput(request_id=rid, new_token_ids=(), delta_text="", finished=True,
                                num_prompt_tokens=0, num_output_tokens=0, error=reason, node_error=True)
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                logger.debug("dropping output for %s: its event loop is closed", rid)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._test_death_file is not None and os.path.exists(self._test_death_file):
                raise InjectedEngineDeath(f"test-only fault injection: {self._test_death_file} exists")
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                try:
                    cmd()
                except Exception:  # a failed command must not take the engine down; it is logged
                    logger.exception("engine command %r failed", cmd)
            try:   # the transfer's completions (step() takes them too; here also when idle)
                ended = self.engine.apply_kv_events()
            except Exception:  # like a failed command: logged, and the engine goes on
                logger.exception("applying the KV connector's events failed")
                ended = []
            for out in ended:
                self.deliver(out)
            if self.engine.has_schedulable_work():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # reported to every in-flight request, then we go on
                    logger.exception("engine step failed; failing %d in-flight requests",
                                     self.engine.num_unfinished_requests)
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    continue
                for out in outputs:
                    self.deliver(out)
                self._take_metrics()
            else:
                self.engine.check_integrity()
                self._take_metrics()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
        self._fail_all("engine shut down", node_error=True)

    def _take_metrics(self) -> None:
        """Engine thread: refresh `last_metrics` and `last_load`; a failing snapshot is logged once and never
        stops serving."""
        try:
            self.last_metrics = self.engine.metrics()
            self.engine.last_load = self.engine.load()
        except Exception:  # metrics must not take serving down; the failure is logged, once
            if not self._metrics_failed:
                logger.exception("engine metrics snapshot failed; keeping the last one")
            self._metrics_failed = True

    def _fail_all(self, message: str, node_error: bool = False) -> None:
        for rid in list(self._streams):
            out = self.engine.abort_request(rid)
            if out is not None:
                self.deliver(RequestOutput(
                    request_id=out.request_id, new_token_ids=(), delta_text="", finished=True,
                    num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                    completion=out.completion, error=message, node_error=node_error,
                ))
