"""Conversions between the client API's wire format (pdserve.api.v1) and the engine's types.

The engine never imports the wire format and the wire package imports nothing of ours (DESIGN
§2), so servers and clients convert here: prompts, sampling options, streamed outputs. (The
Prefill call's ticket converts itself: kv_messenger.ticket.TransferTicket.)

Input limits (S6) live here too, so that the router (router.limits.check_request) and every node
(decode_node.server) refuse the same things with the same words: the caps on stop strings, stop
token ids and logprobs (`InputLimits`), and a max_tokens larger than the context left after the
prompt (`fit_context`; the nodes tokenize and call it in pdserve.serving.node_request). Each
refusal is a ValueError naming the value and the cap (INVALID_ARGUMENT over gRPC, 400 over HTTP).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import SamplingParams
from pdserve_api.v1 import generate_pb2

if TYPE_CHECKING:   # the router converts too, and must not load torch for a type
    from pdserve.engine.outputs import RequestOutput

_FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
    "error": generate_pb2.FINISH_REASON_ERROR,
}
_FINISH_NAME = {v: k for k, v in _FINISH.items()}


# --- prompts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Prompt:
    """A GenerateRequest's prompt: exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("text", "token_ids", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"a prompt is exactly one of text, token_ids or messages, got {given or 'none'}")

    @property
    def nbytes(self) -> int:
        """Size in bytes (UTF-8 text; 4 per token id; chat contents and roles)."""
        if self.text is not None:
            return len(self.text.encode("utf-8"))
        if self.token_ids is not None:
            return 4 * len(self.token_ids)
        return sum(len(m.content.encode("utf-8")) + len(m.role.encode("utf-8")) for m in self.messages or ())

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "token_ids" if self.token_ids is not None else "messages"

    @classmethod
    def from_pb(cls, request: generate_pb2.GenerateRequest) -> Prompt:
        """The prompt of a GenerateRequest; ValueError when it has none."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return cls(text=request.text)
        if kind == "token_ids":
            return cls(token_ids=tuple(request.token_ids.ids))
        if kind == "messages":
            return cls(messages=tuple(ChatMessage(m.role, m.content) for m in request.messages.messages))
        raise ValueError("the request has no prompt: set one of text, token_ids, messages")

    def to_engine(self, tokenizer) -> str | list[int]:  # a transformers tokenizer
        """What the engine takes: the text, the ids, or the messages rendered by the chat template."""
        if self.text is not None:
            return self.text
        if self.token_ids is not None:
            return list(self.token_ids)
        msgs = [{"role": m.role, "content": m.content} for m in self.messages or ()]
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


# --- input limits (S6) ----------------------------------------------------------------------------

@dataclass(frozen=True)
class InputLimits:
    """Caps on the parts of a request whose cost grows with their count or size and that no model
    needs in bulk: each stop string is matched against the output text after every token, each stop
    token id against every sampled token, and logprobs sorts the vocabulary per position.

    max_stop_strings / max_stop_chars: how many stop strings, and how many characters each may have.
    max_stop_token_ids: how many stop token ids. max_logprobs: the most alternatives per position
    (SamplingParams' own bound)."""

    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{f.name} must be an integer >= 0, got {value!r}")


INPUT_LIMITS = InputLimits()


class FieldError(ValueError):
    """A ValueError about one request field; `field` names it as the wire does (OpenAI's `param`)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_sampling_limits(s: generate_pb2.SamplingOptions, limits: InputLimits = INPUT_LIMITS) -> None:
    """Raise ValueError naming the value and the cap when `s` asks for more than `limits` allow."""
    if len(s.stop) > limits.max_stop_strings:
        raise FieldError(f"stop has {len(s.stop)} strings; at most {limits.max_stop_strings} are allowed", "stop")
    for i, stop in enumerate(s.stop):
        if len(stop) > limits.max_stop_chars:
            raise FieldError(f"stop[{i}] is {len(stop)} characters long; at most {limits.max_stop_chars} "
                             "are allowed per stop string", "stop")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise FieldError(f"stop_token_ids has {len(s.stop_token_ids)} ids; at most {limits.max_stop_token_ids} "
                         "are allowed", "stop_token_ids")
    if s.HasField("logprobs") and s.logprobs > limits.max_logprobs:
        raise FieldError(f"logprobs must be an integer in [0, {limits.max_logprobs}], got {s.logprobs} "
                         f"(at most {limits.max_logprobs} alternatives per position)", "logprobs")


def context_error(max_model_len: int, prompt_tokens: int, max_tokens: int) -> str:
    """The refusal of a max_tokens that does not fit the context after the prompt (both numbers named)."""
    left = max_model_len - prompt_tokens
    return (f"this model's context is {max_model_len} tokens, but the request needs "
            f"{prompt_tokens + max_tokens}: {prompt_tokens} in the prompt plus max_tokens={max_tokens} for the "
            f"completion; at most {max(left, 0)} tokens are left for the completion, so lower max_tokens "
            "or shorten the prompt")


def fit_context(params: SamplingParams, prompt_tokens: int, max_model_len: int,
                clamp: bool = False) -> SamplingParams:
    """`params` checked against the context left after a prompt of `prompt_tokens` tokens.

    A max_tokens over what is left raises FieldError (context_error) unless `clamp`
    (SamplingOptions.clamp_max_tokens, or a max_tokens the request left unset), which lowers it to
    what is left. A prompt that leaves
    nothing to generate raises ValueError in either case. max_tokens=None (until the context is
    full) is returned as is."""
    left = max_model_len - prompt_tokens
    if left < 1:
        raise ValueError(f"prompt has {prompt_tokens} tokens but the model's context is {max_model_len} tokens "
                         "(at least one must be left to generate)")
    if params.max_tokens is None or params.max_tokens <= left:
        return params
    if clamp:
        return dataclasses.replace(params, max_tokens=left)
    raise FieldError(context_error(max_model_len, prompt_tokens, params.max_tokens), "max_tokens")


# --- sampling -------------------------------------------------------------------------------------

# SamplingOptions fields with presence (proto3 `optional`), named as SamplingParams' fields
_OPTIONAL_SAMPLING = ("temperature", "top_p", "seed", "max_tokens", "logprobs", "skip_special_tokens")


def sampling_from_pb(s: generate_pb2.SamplingOptions, limits: InputLimits = INPUT_LIMITS) -> SamplingParams:
    """SamplingOptions -> SamplingParams; invalid values, and values over `limits`, raise ValueError
    naming them."""
    check_sampling_limits(s, limits)
    kw: dict[str, object] = {
        "top_k": s.top_k,
        "min_p": s.min_p,
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    for name in _OPTIONAL_SAMPLING:   # unset: SamplingParams' own default
        if s.HasField(name):
            kw[name] = getattr(s, name)
    return SamplingParams(**kw)


def sampling_to_pb(p: SamplingParams) -> generate_pb2.SamplingOptions:
    s = generate_pb2.SamplingOptions(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
    )
    if p.seed is not None:
        s.seed = p.seed
    if p.max_tokens is not None:
        s.max_tokens = p.max_tokens
    if p.logprobs is not None:
        s.logprobs = p.logprobs
    return s


def finish_reason_to_pb(reason: str | None) -> int:
    return _FINISH.get(reason or "", generate_pb2.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_pb(value: int) -> str | None:
    return _FINISH_NAME.get(value)


def output_to_pb(out: RequestOutput, tokenizer=None) -> generate_pb2.GenerateResponse:
    """A pdserve RequestOutput -> one streamed GenerateResponse."""
    msg = generate_pb2.GenerateResponse(
        request_id=out.request_id, token_ids=list(out.new_token_ids), text=out.delta_text,
    )
    for lp in out.new_logprobs:
        msg.logprobs.append(generate_pb2.PositionLogprobs(
            sampled=_tlp(lp.sampled, tokenizer), top=[_tlp(t, tokenizer) for t in lp.top]))
    if out.finished:
        c = out.completion
        msg.finish_reason = finish_reason_to_pb(c.finish_reason if c else "error")
        if out.error:
            msg.finish_reason = generate_pb2.FINISH_REASON_ERROR
            msg.error = out.error
            if out.node_error:
                msg.error_cause = generate_pb2.ERROR_CAUSE_NODE
        if c is not None and isinstance(c.stop_reason, str):
            msg.stop_string = c.stop_reason
        elif c is not None and isinstance(c.stop_reason, int):
            msg.stop_token_id = c.stop_reason
        msg.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=out.num_prompt_tokens,
                                              completion_tokens=out.num_output_tokens,
                                              cached_prompt_tokens=out.num_cached_tokens))
    return msg


def _tlp(t, tokenizer) -> generate_pb2.TokenLogprob:
    text = tokenizer.decode([t.token_id]) if tokenizer is not None else ""
    return generate_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, text=text)
