"""What the engine reports per step and per finished request."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling.sampler import SampleLogprobs


@dataclass(frozen=True)
class CompletionOutput:
    """The finished (or so-far) completion of one request."""

    text: str
    token_ids: tuple[int, ...]          # generated ids only (EOS included when it ended the request)
    finish_reason: str | None           # "stop", "length", "abort", "error", or None while running
    logprobs: tuple[SampleLogprobs, ...] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


@dataclass(frozen=True)
class RequestOutput:
    """One step's news about one request: the new tokens, and the whole completion once finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    delta_text: str
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: tuple[SampleLogprobs, ...] = ()
    completion: CompletionOutput | None = None  # set when finished
    error: str | None = None
    # The error is the node's, not the request's: its engine thread stopped (died, or shut down), so
    # another node may serve the request (GenerateResponse.error_cause = ERROR_CAUSE_NODE, S10).
    node_error: bool = False
    # Prompt tokens this engine took from its prefix cache instead of computing (E12), counted at
    # the request's first admission (Request.num_reused_tokens). 0 for a remote-prefill request
    # (a decode node's): the prefill node reports its own count in PrefillResponse.
    num_cached_tokens: int = 0
    # When the engine first gave the request pages (time.monotonic()): the end of its queueing.
    first_scheduled_time: float | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason if self.completion else None
