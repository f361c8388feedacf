"""The engine passes the A/B benchmarks time: one prefill pass of a fresh prompt, and timed decode
steps of a batch. Called on the benchmark's (or its worker's) main thread, through the public
engine API only (add_request / step / has_unfinished_requests), so any two trees can run them.
Nothing waits but the engine's own steps."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from pdserve import SamplingParams


def add_pass_args(parser: argparse.ArgumentParser, *, prefill_tokens: int, batch: int, ctx: int, steps: int,
                  threads: int | None) -> None:
    """The workload flags every pass A/B shares, with the benchmark's own defaults."""
    parser.add_argument("--prefill-tokens", type=int, default=prefill_tokens)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--ctx", type=int, default=ctx, help="prompt tokens of each decode request")
    parser.add_argument("--steps", type=int, default=steps, help="timed decode steps per round")
    parser.add_argument("--threads", type=int, default=threads, help="torch threads of each engine")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")


def synthetic_prompt(vocab_size: int, length: int, mul: int, salt: int) -> list[int]:
    """Token ids away from the special ids at both ends of the vocabulary, fixed by (mul, salt)."""
    return [(mul * i + salt) % (vocab_size - 100) + 50 for i in range(length)]


def prefill_pass(engine: Any, prompt: list[int], request_id: str) -> tuple[float, list[int]]:
    """(seconds from add_request to its finished output, its token ids) for one max_tokens=1 request."""
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), request_id=request_id)
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    return time.perf_counter() - t0, list(out[0].completion.token_ids)


def decode_steps(engine: Any, prompts: list[list[int]], steps: int, tag: str,
                 before: Callable[[], None] | None = None,
                 after: Callable[[], None] | None = None) -> tuple[float, list[list[int]]]:
    """Prefill `prompts` untimed, then time `steps` decode steps; (median step seconds, every request's
    tokens). `before` / `after` run right around the timed steps (e.g. to read a counter)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    reqs = [engine.add_request(p, params, request_id=f"{tag}-{j}") for j, p in enumerate(prompts)]
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    if before is not None:
        before()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if after is not None:
        after()
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), [list(r.output_token_ids) for r in reqs]
