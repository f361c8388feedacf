"""A streamed request's timeline (StreamTrace, what a backend observed) and what the harness keeps of it
(RequestRecord: TTFT, ITLs, E2E, token counts, finish reason), with vLLM's definitions:

- TTFT: from sending the request to the first streamed message carrying output (a token id on
  gRPC, non-empty text on HTTP);
- ITL: the gap between two consecutive such messages (our servers send one token per message);
- E2E: from sending the request to the end of its stream;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request, for requests of more than one token.

Output tokens are the server's usage count when it sends one, else the token ids counted in the
stream (HTTP without usage: the number of text messages). Times are seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUCCESS_REASONS = ("stop", "length")


@dataclass(frozen=True)
class StreamTrace:
    """What a backend saw of one request. Times are one clock's readings (time.perf_counter)."""

    request_id: str
    sent_at: float
    chunk_times: tuple[float, ...]   # arrival of every message carrying output
    chunk_tokens: tuple[int, ...]    # tokens in each (1 per text message on HTTP)
    ended_at: float
    finish_reason: str | None        # "stop", "length", "abort", "error", None (stream broke off)
    prompt_tokens: int | None = None  # the server's usage, when reported
    completion_tokens: int | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if len(self.chunk_times) != len(self.chunk_tokens):
            raise ValueError(f"request {self.request_id}: {len(self.chunk_times)} chunk times but "
                             f"{len(self.chunk_tokens)} chunk token counts")
        times = (self.sent_at, *self.chunk_times, self.ended_at)
        if any(b < a for a, b in zip(times, times[1:], strict=False)):  # consecutive pairs
            raise ValueError(f"request {self.request_id}: times go backwards: sent {self.sent_at}, "
                             f"chunks {self.chunk_times}, ended {self.ended_at}")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the result keeps it. start_s: send time after the benchmark start. ttft_s is
    None when no output arrived; tpot_s None for fewer than two output tokens. success: finished
    with "stop" or "length" and no error."""

    index: int
    request_id: str
    prompt_tokens: int | None
    max_tokens: int
    output_tokens: int
    start_s: float
    ttft_s: float | None
    e2e_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]
    finish_reason: str | None
    error: str | None

    @property
    def success(self) -> bool:
        return self.error is None and self.finish_reason in SUCCESS_REASONS

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_s"] = list(self.itl_s)
        d["success"] = self.success
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        fields = {k: v for k, v in d.items() if k != "success"}
        fields["itl_s"] = tuple(fields["itl_s"])
        return cls(**fields)


def record_from_trace(index: int, trace: StreamTrace, bench_start: float, max_tokens: int,
                      prompt_len: int | None = None) -> RequestRecord:
    """The record of one trace; prompt_len (known to the dataset) stands in when usage is missing."""
    times = trace.chunk_times
    ttft = times[0] - trace.sent_at if times else None
    itl = tuple(b - a for a, b in zip(times, times[1:], strict=False))  # consecutive pairs
    streamed = sum(trace.chunk_tokens)
    output = trace.completion_tokens if trace.completion_tokens is not None else streamed
    e2e = trace.ended_at - trace.sent_at
    tpot = (e2e - ttft) / (output - 1) if ttft is not None and output > 1 else None
    error = trace.error
    if error is None and trace.finish_reason not in SUCCESS_REASONS:
        error = f"stream ended with finish_reason {trace.finish_reason!r}"
    return RequestRecord(
        index=index, request_id=trace.request_id,
        prompt_tokens=trace.prompt_tokens if trace.prompt_tokens is not None else prompt_len,
        max_tokens=max_tokens, output_tokens=output, start_s=trace.sent_at - bench_start, ttft_s=ttft, e2e_s=e2e,
        tpot_s=tpot, itl_s=itl, finish_reason=trace.finish_reason, error=error,
    )
