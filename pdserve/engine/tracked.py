"""One unfinished request's output side: its detokenizer and returned logprobs, the stop checks
after each sampled token, and the RequestOutput values the engine returns for it.

LLMEngine keeps one TrackedRequest per unfinished request (its `_tracked`); what happens to the
request's blocks and scheduling when it finishes stays in the engine (`LLMEngine._finish`).
Owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.sampling.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling.sampler import SampleLogprobs


@dataclass
class TrackedRequest:
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[SampleLogprobs]

    def push(self, token: int, lp: SampleLogprobs | None) -> tuple[FinishReason | None, str]:
        """Append a sampled token to the request: why it ends the request (None: it goes on) and
        the text it adds."""
        r = self.request
        r.output_token_ids.append(token)
        r.status = RequestStatus.DECODING
        if lp is not None:
            self.logprobs.append(lp)
        params = r.sampling
        reason: FinishReason | None = None
        delta = ""
        # A token that ends the request by its id (EOS, a stop token) is kept in token_ids but
        # not in the text, as the OpenAI-style APIs report it.
        if token in params.stop_token_ids:
            reason, r.stop_reason = FinishReason.STOP, token
        elif not params.ignore_eos and token in r.eos_token_ids:
            reason = FinishReason.STOP
        else:
            step = self.detok.push(token)
            delta = step.delta_text
            if step.stop_string is not None:
                reason, r.stop_reason = FinishReason.STOP, step.stop_string
            elif params.max_tokens is not None and len(r.output_token_ids) >= params.max_tokens:
                reason = FinishReason.LENGTH
            elif r.num_tokens >= r.max_total_tokens:
                reason = FinishReason.LENGTH
        return reason, delta

    def running_output(self, new_ids: tuple[int, ...], delta: str,
                       new_logprobs: tuple[SampleLogprobs, ...]) -> RequestOutput:
        """This step's output of a request that goes on."""
        return self._output(new_ids, delta, new_logprobs, finished=False)

    def finished_output(self, reason: FinishReason, new_ids: tuple[int, ...], delta: str,
                        new_logprobs: tuple[SampleLogprobs, ...], error: str | None) -> RequestOutput:
        """The last output of a request that ended (`reason`), with its whole completion."""
        r = self.request
        delta += self.detok.finish()
        completion = CompletionOutput(
            text=self.detok.text,
            token_ids=tuple(r.output_token_ids),
            finish_reason=reason.value,
            logprobs=tuple(self.logprobs) if r.sampling.logprobs is not None else None,
            stop_reason=r.stop_reason,
        )
        return self._output(new_ids, delta, new_logprobs, finished=True, completion=completion, error=error)

    def _output(self, new_ids: tuple[int, ...], delta: str, new_logprobs: tuple[SampleLogprobs, ...], *,
                finished: bool, completion: CompletionOutput | None = None,
                error: str | None = None) -> RequestOutput:
        """One step's `RequestOutput` of this request: the fields every output carries, plus the
        completion and error a finished one adds."""
        r = self.request
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=new_ids,
            delta_text=delta,
            finished=finished,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=len(r.output_token_ids),
            new_logprobs=new_logprobs,
            completion=completion,
            error=error,
            num_cached_tokens=r.num_reused_tokens or 0,
            first_scheduled_time=r.first_scheduled_time,
        )
