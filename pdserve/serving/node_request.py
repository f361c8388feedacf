"""A GenerateRequest as a node's engine takes it: token ids, checked sampling, and the seam of a
resumed request (S6, S10).

    prepared = await prepare_generate(request, tokenizer, max_model_len)   # ValueError: INVALID_ARGUMENT
    gen = prepared.outputs(engine_thread.generate(prepared.prompt_ids, prepared.params, rid, ...))

Checks (S6), the same words as the router's (pdserve.serving.convert): the input caps
(`sampling_from_pb`), then max_tokens against the context left after the prompt (`fit_context`), which
needs the prompt's token count, so text prompts are tokenized here (as LLMEngine.tokenize does:
the tokenizer's special tokens added) rather than on the engine thread; a long text (or chat) is
tokenized in a worker thread (TOKENIZE_IN_THREAD_CHARS), so that the node's event loop keeps
streaming and answering health checks.

Resume (S10, GenerateRequest.resume): a router moves a request whose decode node failed mid-stream
to this node with the tokens already streamed. The engine gets prompt + those tokens as its
prompt, max_tokens as sent (the router lowered it), no stop strings, and for a seeded request
`rng_skip_tokens` = the tokens streamed, so that its draws continue the seed's stream exactly where
the failed node left it (an uninterrupted run's tokens, pdserve.engine.sampling.sampler).
`ResumeSeam` rebuilds the failed node's detokenizer by replaying the streamed tokens through it,
then detokenizes every new token itself: its deltas start exactly after the `text_chars`
characters the client already has (text the failed node held back is sent now), stop strings
match across the seam, and usage counts the streamed tokens as completion tokens.

Blocking waits: tokenizing a long text prompt in a worker thread (bounded by the prompt's size,
which the router caps: router.limits.RequestLimits.max_prompt_bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.convert import Prompt, fit_context, sampling_from_pb
from pdserve_api.v1 import generate_pb2

TOKENIZE_IN_THREAD_CHARS = 16 * 1024   # text / chat prompts of more bytes are tokenized off the event loop
MAX_ID_CHARS = 256                     # request_id and model, as router.limits.MAX_ID_CHARS


def prompt_token_ids(prompt: Prompt, tokenizer: Any) -> list[int]:
    """The prompt as token ids: text tokenized as LLMEngine.tokenize does, ids as given (the engine
    checks their range), messages rendered by the chat template."""
    if prompt.text is not None:
        return list(tokenizer(prompt.text)["input_ids"])
    engine_prompt = prompt.to_engine(tokenizer)
    assert not isinstance(engine_prompt, str)
    return list(engine_prompt)


@dataclass(frozen=True)
class PreparedGenerate:
    """What the engine gets for one GenerateRequest. prompt_ids: the prompt's token ids (plus the
    streamed tokens of a resumed request); params: checked, clamped, and for a resumed request
    without stop strings and, seeded, past the streamed tokens' draws; seam: the resumed request's
    detokenizer, None otherwise."""

    prompt_ids: list[int]
    params: SamplingParams
    seam: ResumeSeam | None = None

    def outputs(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The engine's outputs as the client must see them (unchanged unless resumed)."""
        return gen if self.seam is None else self.seam.outputs(gen)


async def prepare_generate(request: generate_pb2.GenerateRequest, tokenizer: Any,
                           max_model_len: int) -> PreparedGenerate:
    """Check `request` (ValueError naming what is wrong) and build what the engine takes."""
    for name in ("request_id", "model"):   # as the router's check (router.limits): ids go into logs and labels
        value = getattr(request, name)
        if len(value) > MAX_ID_CHARS:
            raise ValueError(f"{name} is {len(value)} characters long; at most {MAX_ID_CHARS} are allowed")
    params = sampling_from_pb(request.sampling)
    prompt = Prompt.from_pb(request)
    if prompt.token_ids is None and prompt.nbytes > TOKENIZE_IN_THREAD_CHARS:   # text, or a chat to render
        ids = await asyncio.to_thread(prompt_token_ids, prompt, tokenizer)
    else:
        ids = prompt_token_ids(prompt, tokenizer)
    if not ids:
        raise ValueError("prompt is empty: it must contain at least one token")
    resumed = list(request.resume.token_ids) if request.HasField("resume") else []
    if request.HasField("resume") and not resumed:
        raise ValueError("resume.token_ids is empty: a resumed request continues after at least one token")
    # An unset max_tokens is the server's default, not the client's demand: it is lowered to fit.
    clamp = request.sampling.clamp_max_tokens or not request.sampling.HasField("max_tokens")
    params = fit_context(params, len(ids) + len(resumed), max_model_len, clamp)
    if not resumed:
        return PreparedGenerate(ids, params)
    seam = ResumeSeam(tokenizer, ids, resumed, request.resume.text_chars, params)
    skip = params.rng_skip_tokens + len(resumed) if params.seed is not None else 0
    engine_params = dataclasses.replace(params, stop=(), rng_skip_tokens=skip)
    return PreparedGenerate(ids + resumed, engine_params, seam)


class ResumeSeam:
    """The detokenizer of a resumed request, as it stood on the node that failed, carried on.

    Built by replaying the streamed tokens through an IncrementalDetokenizer over the original
    prompt (what the failed node's engine did, token by token), it turns the new node's tokens into
    the deltas the failed node would have sent: first the text it still held back, then the new
    text, with the request's stop strings. One per request; used by its handler task only.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], streamed: Sequence[int], text_chars: int,
                 params: SamplingParams) -> None:
        self.streamed = tuple(int(t) for t in streamed)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
        replayed: list[str] = []
        for t in self.streamed:
            step = self._detok.push(t)
            replayed.append(step.delta_text)
            if step.stop_string is not None:
                raise ValueError(f"resume.token_ids already end the request at stop string {step.stop_string!r} "
                                 f"(after {len(replayed)} of {len(self.streamed)} tokens)")
        text = "".join(replayed)
        # The client has text_chars characters; the replay emitted len(text). Normally equal; a gap
        # either way is closed so that the client's text stays a prefix of the node's.
        self._pending = text[text_chars:]
        self._to_skip = max(0, text_chars - len(text))
        self._stopped: str | None = None

    def _emit(self, delta: str) -> str:
        if self._to_skip:
            cut = min(self._to_skip, len(delta))
            delta = delta[cut:]
            self._to_skip -= cut
        out, self._pending = self._pending + delta, ""
        return out

    def _resumed(self, out: RequestOutput, ids: tuple[int, ...], delta: str, finished: bool,
                 completion: CompletionOutput | None) -> RequestOutput:
        dropped = len(out.new_token_ids) - len(ids)  # tokens after a stop string's match
        return dataclasses.replace(
            out, new_token_ids=ids, delta_text=self._emit(delta), finished=finished,
            new_logprobs=out.new_logprobs[:len(ids)],
            num_prompt_tokens=out.num_prompt_tokens - len(self.streamed),
            num_output_tokens=out.num_output_tokens - dropped + len(self.streamed),
            completion=completion)

    async def outputs(self, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The engine's outputs with the seam's text; ends (closing `gen`, which aborts the engine's
        request) at a stop string."""
        async with contextlib.aclosing(gen):  # type: ignore[type-var]
            async for out in gen:
                ids, delta = self._push(out)
                if self._stopped is not None:  # a stop string matched: the request ends here
                    completion = CompletionOutput(text="", token_ids=self.streamed + ids, finish_reason="stop",
                                                  stop_reason=self._stopped)
                    yield self._resumed(out, ids, delta, True, completion)
                    return
                c = out.completion
                completion = dataclasses.replace(c, token_ids=self.streamed + c.token_ids) if c else None
                yield self._resumed(out, ids, delta, out.finished, completion)
                if out.finished:
                    return

    def _push(self, out: RequestOutput) -> tuple[tuple[int, ...], str]:
        """Push `out`'s tokens through the detokenizer (flushing it when the engine finished);
        returns the tokens kept (up to a stop string's match) and the new text."""
        ids = out.new_token_ids
        # The engine's final token, when the request stopped on it (EOS or a stop token id: the engine
        # has no stop strings here), is reported but never part of the text, as the engine does.
        pushed = ids[:-1] if out.finished and out.finish_reason == "stop" else ids
        delta = []
        for i, t in enumerate(pushed):
            step = self._detok.push(t)
            delta.append(step.delta_text)
            if step.stop_string is not None:
                self._stopped = step.stop_string
                return ids[:i + 1], "".join(delta)
        if out.finished:
            delta.append(self._detok.finish())
        return ids, "".join(delta)
