"""The asyncio driver of one benchmark run (L1).

    outcome = asyncio.run(run_benchmark(backend, requests, RunConfig(request_rate=0.5, duration_s=120)))

Requests are sent at their arrival offsets (arrivals.arrival_offsets: Poisson or gamma at
`request_rate`; all at once for an infinite rate), each in its own task. `max_concurrency` caps the
requests in flight (a request due while the cap is reached waits for a free slot). `duration_s` caps
the sending: a request not sent by then is not sent at all (counted in `not_sent`); requests in
flight run to their end. The run's duration, used by every throughput, is from the start to the
end of the last stream.

`warm_up` sends requests one at a time, unrecorded, before a run (serve.py sends
`RunConfig.num_warmups` of them, with prompts of their own so that no run prompt is cached by
them); a failed warm-up raises RuntimeError with the server's error, since the run would measure
nothing.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.tools.bench.arrivals import arrival_offsets
from pdserve.tools.bench.backends import Backend, SendOptions
from pdserve.tools.bench.datasets import BenchRequest
from pdserve.tools.bench.progress import Progress
from pdserve.tools.bench.records import RequestRecord, record_from_trace


@dataclass(frozen=True)
class RunConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    seed: int = 0
    num_warmups: int = 0  # for serve.py: run_benchmark itself sends no warm-up
    send: SendOptions = field(default_factory=SendOptions)

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1 (or unset), got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s (or unset), got {self.duration_s}")
        if self.num_warmups < 0:
            raise ValueError(f"warm-up count must be >= 0, got {self.num_warmups}")


@dataclass(frozen=True)
class RunOutcome:
    records: tuple[RequestRecord, ...]  # the sent requests, in dataset order
    duration_s: float
    planned: int
    not_sent: int                       # planned requests the duration cap left unsent


async def warm_up(backend: Backend, requests: Sequence[BenchRequest], options: SendOptions) -> None:
    tag = secrets.token_hex(3)
    for i, req in enumerate(requests):
        trace = await backend.send(req, options, f"bench-warmup-{tag}-{i}")
        if trace.error is not None or trace.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"warm-up request {i} ({req!r}) failed: {trace.error or trace.finish_reason}")


async def run_benchmark(backend: Backend, requests: Sequence[BenchRequest], config: RunConfig,
                        progress: Progress | None = None) -> RunOutcome:
    if not requests:
        raise ValueError("no requests to send")
    offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    tag = secrets.token_hex(3)
    progress = progress or Progress(len(requests), enabled=False)
    start = time.perf_counter()

    def too_late() -> bool:
        return config.duration_s is not None and time.perf_counter() - start >= config.duration_s

    async def one(req: BenchRequest) -> RequestRecord | None:
        if slots is not None:
            await slots.acquire()
        try:
            if too_late():
                return None
            progress.sent()
            trace = await backend.send(req, config.send, f"bench-{tag}-{req.index}")
            record = record_from_trace(req.index, trace, start, req.max_tokens, req.prompt_len)
            progress.finished(record.success)
            return record
        finally:
            if slots is not None:
                slots.release()

    tasks: list[asyncio.Task[RequestRecord | None]] = []
    try:
        for req, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if config.duration_s is not None and offset >= config.duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        progress.close()
    end = time.perf_counter()
    records = tuple(r for r in results if r is not None)
    return RunOutcome(records, end - start, len(requests), len(requests) - len(records))
