"""Conversions between the client API's wire format (pdserve.api.v1) and the engine's types.

The engine never imports the wire format and the wire package imports nothing of ours (DESIGN
§2), so servers and clients convert here: prompts, sampling options, streamed outputs. (The
Prefill call's ticket converts itself: kv_messenger.ticket.TransferTicket.)
"""

from __future__ import annotations

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


# --- sampling -------------------------------------------------------------------------------------

def sampling_from_pb(s: generate_pb2.SamplingOptions) -> SamplingParams:
    """SamplingOptions -> SamplingParams; invalid values raise ValueError naming them."""
    kw: dict[str, object] = {
        "top_k": s.top_k,
        "min_p": s.min_p,
        "stop": tuple(s.stop),
        "stop_token_ids": tuple(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    if s.HasField("temperature"):
        kw["temperature"] = s.temperature
    if s.HasField("top_p"):
        kw["top_p"] = s.top_p
    if s.HasField("seed"):
        kw["seed"] = s.seed
    if s.HasField("max_tokens"):
        kw["max_tokens"] = s.max_tokens
    if s.HasField("logprobs"):
        kw["logprobs"] = s.logprobs
    if s.HasField("skip_special_tokens"):
        kw["skip_special_tokens"] = s.skip_special_tokens
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
