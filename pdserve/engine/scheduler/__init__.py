"""Iteration-level scheduling: which tokens of which requests run in the next forward pass."""

from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput, StalledRequest
from pdserve.engine.scheduler.scheduler import FifoScheduler, PrefillFirstScheduler, Scheduler, make_scheduler

__all__ = [
    "FifoScheduler",
    "PrefillFirstScheduler",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "StalledRequest",
    "make_scheduler",
]
