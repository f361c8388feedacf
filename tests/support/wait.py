"""Bounded waits. Every wait in the suite goes through these: a test never sleeps and hopes.

`wait_until` is also the fence for a negative check: rather than sleep and assert that something did
not happen, wait until an observable later event proves the system is past the point where it would
have happened (a later request finished, a counter moved), then assert it did not."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL_S = 0.02


def _check(timeout: float, interval: float) -> None:
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not interval > 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")


def _timed_out(describe: str, timeout: float, last: object, error: BaseException | None) -> AssertionError:
    tail = f"; the last call raised {error!r}" if error is not None else ""
    return AssertionError(f"timed out after {timeout} s waiting for {describe}; last value: {last!r}{tail}")


def wait_until(pred: Callable[[], T], timeout: float, describe: str, *, interval: float = DEFAULT_INTERVAL_S,
               retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Call `pred` every `interval` seconds until it returns something truthy, and return that.

    After `timeout` seconds raises AssertionError naming `describe` and the last value `pred` returned
    (or the last exception, when exceptions of the `retry_on` types count as "not yet"; any other
    exception propagates at once)."""
    _check(timeout, interval)
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            last, error = pred(), None
        except retry_on as exc:
            error = exc
        if error is None and last:
            return last  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _timed_out(describe, timeout, last, error)
        time.sleep(interval)


async def async_wait_until(pred: Callable[[], T | Awaitable[T]], timeout: float, describe: str, *,
                           interval: float = DEFAULT_INTERVAL_S) -> T:
    """wait_until on an event loop: `pred` may be a plain function or return an awaitable; the loop
    keeps running between calls."""
    _check(timeout, interval)
    deadline = time.monotonic() + timeout
    while True:
        last = pred()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise _timed_out(describe, timeout, last, None)
        await asyncio.sleep(interval)
