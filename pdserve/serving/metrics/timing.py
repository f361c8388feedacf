"""RequestTimer: one streamed request's TTFT, inter-token gaps and end-to-end latency, as its server sees them.

    timer = RequestTimer(request_metrics(REGISTRY), model_name="m")   # at receipt
    timer.tokens(len(msg.token_ids))    # each message sent (only those carrying tokens count)
    timer.finish("length")              # once: the last message, or "abort"/"error" when cut short

TTFT is observed with the first token-bearing message, ITL with each later one (one observation per
message: the gap since the previous token-bearing message), E2E and request_success_total at
`finish`. Used on one event loop; not thread-safe.
"""

from __future__ import annotations

import time

from pdserve.serving.metrics.definitions import FINISHED_REASONS, RequestMetrics


class RequestTimer:
    def __init__(self, metrics: RequestMetrics, model_name: str = "", start: float | None = None) -> None:
        self.metrics = metrics
        self.model_name = model_name  # may be set later (the router learns it from the chosen node)
        self.start = time.monotonic() if start is None else start
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finished_reason: str | None = None

    def tokens(self, n: int, now: float | None = None) -> None:
        """A message with `n` generated tokens went out (n == 0: nothing to observe)."""
        if n <= 0 or self.finished_reason is not None:
            return
        now = time.monotonic() if now is None else now
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.labels(model_name=self.model_name).observe(now - self.start)
        else:
            assert self.last_token is not None
            self.metrics.itl.labels(model_name=self.model_name).observe(now - self.last_token)
        self.last_token = now

    def finish(self, reason: str, now: float | None = None) -> bool:
        """The request ended for `reason` (stop, length, abort, error); later calls are ignored
        (returns False). Raises ValueError for any other reason."""
        if reason not in FINISHED_REASONS:
            raise ValueError(f"finished_reason must be one of {FINISHED_REASONS}, got {reason!r}")
        if self.finished_reason is not None:
            return False
        self.finished_reason = reason
        now = time.monotonic() if now is None else now
        self.metrics.e2e.labels(model_name=self.model_name).observe(now - self.start)
        self.metrics.success.labels(model_name=self.model_name, finished_reason=reason).inc()
        return True
