"""Scheduler simulation without a model (E21): static vs continuous batching on synthetic steps.

The real `Scheduler` and `KVCacheManager` run; only the forward pass is replaced by a synthetic
step that "generates" one token for every sequence that samples. Each request has a one-token
prompt, so a request with output length n occupies its slot for exactly n steps.

Static batching admits a new group of `slots` requests only when the previous group has fully
finished; continuous batching refills a slot the step after it frees (Orca-style).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.cache.block_pool import BlockPool
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import make_scheduler


@dataclass(frozen=True)
class SimulationResult:
    steps: int
    slot_utilization: float  # generated tokens / (steps x slots)
    tokens: int


def simulate(output_lengths: Sequence[int], slots: int, static: bool, page_size: int = 16) -> SimulationResult:
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    bad = [n for n in output_lengths if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad or not output_lengths:
        raise ValueError(f"output lengths must be a non-empty list of integers >= 1, got {list(output_lengths)}")
    longest = max(output_lengths) + 1
    blocks = slots * -(-longest // page_size) + 1
    cache = KVCacheManager(BlockPool(blocks, 1), page_size)
    config = SchedulerConfig(max_batch_tokens=max(slots, 1), max_requests_per_batch=slots, safety_margin=0.0)
    scheduler = make_scheduler(config, cache)
    pending = deque(
        Request(f"sim-{i}", [0], SamplingParams(max_tokens=n, ignore_eos=True), max_total_tokens=longest + 1)
        for i, n in enumerate(output_lengths)
    )
    steps = tokens = 0
    while pending or scheduler.has_work():
        if static and not scheduler.running and not scheduler.waiting:
            for _ in range(min(slots, len(pending))):
                scheduler.add_request(pending.popleft())
        elif not static:
            while pending:
                scheduler.add_request(pending.popleft())
        sched = scheduler.schedule()
        if sched.is_empty:
            raise RuntimeError(f"simulation stalled at step {steps} with {len(scheduler.waiting)} waiting")
        steps += 1
        for chunk in sched.chunks:
            r = chunk.request
            r.num_computed_tokens = chunk.end
            if chunk.samples:
                r.output_token_ids.append(0)
                r.status = RequestStatus.DECODING
                tokens += 1
                if len(r.output_token_ids) >= r.sampling.max_tokens:
                    scheduler.remove_request(r)
                    r.status = RequestStatus.FINISHED
    cache.check_integrity()
    return SimulationResult(steps=steps, slot_utilization=tokens / (steps * slots), tokens=tokens)
