"""OpenAI request bodies -> a GenerateRequest and how to answer (R2, S6).

    call = parse_completion(body)                      # POST /v1/completions
    call = parse_chat(body, default_max_tokens=8192)   # POST /v1/chat/completions

Every field is type-checked and range-checked here, and a bad one raises `ApiError(400, message,
param=<the field>)`. Accepted beside OpenAI's fields (as vLLM does): top_k, min_p, ignore_eos,
stop_token_ids, skip_special_tokens; chat also takes max_completion_tokens and `content` as a list
of text parts. Refused with 400 rather than ignored, because they would change the answer: n or
best_of other than 1, echo, suffix, logit_bias, non-zero presence/frequency penalties, tools, a
response_format other than text, and non-text content parts. Unknown fields are ignored (clients
send user, metadata, store...). Chat templates are applied by the decode node, as for gRPC chat
requests, so both APIs give the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve_api.v1 import generate_pb2
from router.http_api.errors import bad_request

MAX_LOGPROBS = 20  # SamplingParams' bound
_UINT32 = (1 << 32) - 1
_INT64 = (1 << 63) - 1


@dataclass(frozen=True)
class ApiCall:
    """A parsed request: what to forward and how to shape the answer.

    kind: "completion" or "chat". model: as the client named it ("" when absent). logprobs: None,
    or how many alternatives per position to report. request: the GenerateRequest to forward
    (request_id still empty; the server sets it).
    """

    kind: str
    model: str
    stream: bool
    include_usage: bool
    logprobs: int | None
    request: generate_pb2.GenerateRequest


# --- typed getters ------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def _str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {type(value).__name__}", name)
    return value


# --- shared fields ------------------------------------------------------------------------------


def _sampling(body: dict, max_tokens: int | None) -> generate_pb2.SamplingOptions:
    s = generate_pb2.SamplingOptions()
    if max_tokens is not None:
        s.max_tokens = max_tokens
    temperature = _number(body, "temperature")
    if temperature is not None:
        if temperature < 0:
            raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
        s.temperature = temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
        s.top_p = top_p
    top_k = _int(body, "top_k", -1, (1 << 31) - 1)
    if top_k is not None:
        s.top_k = top_k
    min_p = _number(body, "min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise bad_request(f"min_p must be in [0, 1], got {min_p}", "min_p")
        s.min_p = min_p
    seed = _int(body, "seed", -_INT64 - 1, _INT64)
    if seed is not None:
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise bad_request(f"stop must be a non-empty string or a list of them, got {stop!r}"[:300], "stop")
        s.stop.extend(stop)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(x) and 0 <= x <= _UINT32 for x in ids):
            raise bad_request(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}"[:300], "stop_token_ids")
        s.stop_token_ids.extend(ids)
    if _bool(body, "ignore_eos"):
        s.ignore_eos = True
    skip = _bool(body, "skip_special_tokens")
    if skip is not None:
        s.skip_special_tokens = skip
    return s


def _refuse_unsupported(body: dict) -> None:
    for name in ("n", "best_of"):
        value = _int(body, name, 1, 1 << 31)
        if value is not None and value != 1:
            raise bad_request(f"{name} must be 1 (one completion per request), got {value}", name)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value:
            raise bad_request(f"{name} is not supported (must be 0 or absent), got {value}", name)
    bias = body.get("logit_bias")
    if bias:
        raise bad_request("logit_bias is not supported (must be empty or absent)", "logit_bias")


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {type(options).__name__}", "stream_options")
    return stream, bool(_bool(options, "include_usage"))


def _model(body: dict) -> str:
    return _str(body, "model") or ""


# --- /v1/completions ----------------------------------------------------------------------------


def _completion_prompt(request: generate_pb2.GenerateRequest, prompt: Any) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.text = prompt
        return
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t <= _UINT32]
        if bad:
            raise bad_request(f"prompt token ids must be >= 0, got {bad[:5]}", "prompt")
        request.token_ids.ids.extend(prompt)
        return
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"one prompt per request is supported, got a batch of {len(prompt)}", "prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    raise bad_request("prompt must be a string or a non-empty list of token ids, "
                      f"got {type(prompt).__name__}", "prompt")


def parse_completion(body: dict) -> ApiCall:
    """A /v1/completions body -> ApiCall; raises ApiError(400) naming the first bad field."""
    _refuse_unsupported(body)
    if _bool(body, "echo"):
        raise bad_request("echo is not supported", "echo")
    if _str(body, "suffix"):
        raise bad_request("suffix is not supported", "suffix")
    request = generate_pb2.GenerateRequest(model=_model(body))
    _completion_prompt(request, body.get("prompt"))
    request.sampling.CopyFrom(_sampling(body, _int(body, "max_tokens", 1, _UINT32)))
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if logprobs is not None:
        request.sampling.logprobs = logprobs
    stream, include_usage = _stream_flags(body)
    return ApiCall("completion", request.model, stream, include_usage, logprobs, request)


# --- /v1/chat/completions -----------------------------------------------------------------------


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                                  f"got {kind!r}", "messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.text must be a string", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts, "
                      f"got {type(content).__name__}", "messages")


def _messages(request: generate_pb2.GenerateRequest, messages: Any) -> None:
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with role and content, got {type(m).__name__}",
                              "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"messages[{i}].role must be a non-empty string, got {role!r}"[:300], "messages")
        if m.get("tool_calls"):
            raise bad_request(f"messages[{i}]: tool calls are not supported", "messages")
        request.messages.messages.add(role=role, content=_content(i, m.get("content")))


def parse_chat(body: dict, default_max_tokens: int | None = None) -> ApiCall:
    """A /v1/chat/completions body -> ApiCall; raises ApiError(400) naming the first bad field.

    default_max_tokens: used when neither max_completion_tokens nor max_tokens is given (OpenAI's
    chat default is "until the context is full": pass the model's context length).
    """
    _refuse_unsupported(body)
    if body.get("tools"):
        raise bad_request("tools are not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("response_format other than {'type': 'text'} is not supported", "response_format")
    request = generate_pb2.GenerateRequest(model=_model(body))
    _messages(request, body.get("messages"))
    max_tokens = _int(body, "max_completion_tokens", 1, _UINT32)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, _UINT32)
    clamp = max_tokens is None  # OpenAI's default: until the context is full (lowered to fit by the node)
    if max_tokens is None:
        max_tokens = default_max_tokens
    request.sampling.CopyFrom(_sampling(body, max_tokens))
    request.sampling.clamp_max_tokens = clamp
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (top or 0) if want else None
    if logprobs is not None:
        request.sampling.logprobs = logprobs
    stream, include_usage = _stream_flags(body)
    return ApiCall("chat", request.model, stream, include_usage, logprobs, request)
