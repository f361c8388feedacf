"""What the router checks on a GenerateRequest before it forwards it (S6), for gRPC and HTTP alike.

The decode node is the authority on a prompt (it tokenizes, knows the context length and the
vocabulary); the router only refuses, cheaply and early, what is malformed whatever the model:
no prompt, an empty conversation, sampling values out of range or over the input caps
(pdserve.serving.convert.InputLimits: stop strings, stop token ids, logprobs), a prompt so large in
bytes that tokenizing it would stall a decode node, and, for a token-id prompt once a node has
reported the context length, a max_tokens that does not fit after it (the node makes the same
check for every prompt: pdserve.serving.node_request). Every refusal is a ValueError naming the
field and the value (the exception mapping turns it into INVALID_ARGUMENT, the HTTP API into 400;
a convert.FieldError also names the field for the HTTP `param`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.serving.convert import Prompt, fit_context, sampling_from_pb
from pdserve_api.v1 import generate_pb2

MIN_MESSAGE_BYTES = 1024  # room for a request's fields besides its prompt
MAX_ID_CHARS = 256  # request_id and model: they go into logs and metrics labels


@dataclass(frozen=True)
class RequestLimits:
    """max_prompt_bytes: the most UTF-8 bytes a text prompt (or all chat contents together) may
    have; 4 bytes per token-id entry count against it for token-id prompts. A guard in front of
    tokenization, not the context length: a prompt under it can still be refused by the node.

    message_bytes: the most bytes one request may have on the wire (an HTTP body, a gRPC message),
    enforced before it is parsed: HTTP 413 (a declared Content-Length over it is refused before
    the body is read), gRPC RESOURCE_EXHAUSTED (the server's max receive message length). None:
    `default_message_bytes(max_prompt_bytes)`, which lets a prompt somewhat over max_prompt_bytes
    through to be refused with a clear INVALID_ARGUMENT naming its size."""

    max_prompt_bytes: int = 1 << 20
    message_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_prompt_bytes, bool) or not isinstance(self.max_prompt_bytes, int) \
                or self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be an integer >= 1, got {self.max_prompt_bytes!r}")
        if self.message_bytes is not None and (isinstance(self.message_bytes, bool) or not isinstance(
                self.message_bytes, int) or self.message_bytes < MIN_MESSAGE_BYTES):
            raise ValueError(f"message_bytes must be an integer >= {MIN_MESSAGE_BYTES} (or None: derived from "
                             f"max_prompt_bytes), got {self.message_bytes!r}")

    @property
    def max_message_bytes(self) -> int:
        """The receive limit of whole messages (message_bytes, or its default)."""
        return self.message_bytes if self.message_bytes is not None else default_message_bytes(self.max_prompt_bytes)


def default_message_bytes(max_prompt_bytes: int) -> int:
    """A JSON body may escape each prompt byte into up to 6 bytes (\\uXXXX), plus room for the other
    fields: a prompt over max_prompt_bytes, but under this, is refused naming its size."""
    return 6 * max_prompt_bytes + (1 << 20)


def check_request(request: generate_pb2.GenerateRequest, limits: RequestLimits,
                  context_length: int | None = None) -> None:
    """Raise ValueError naming what is wrong with `request`; return None when it may be forwarded.

    context_length: the decode nodes' context length when known (checks token-id prompts' max_tokens).
    """
    for name in ("request_id", "model"):
        value = getattr(request, name)
        if len(value) > MAX_ID_CHARS:
            raise ValueError(f"{name} is {len(value)} characters long; at most {MAX_ID_CHARS} are allowed")
    prompt = Prompt.from_pb(request)   # ValueError when it has none
    if prompt.token_ids is not None and not prompt.token_ids:
        raise ValueError("prompt token_ids is empty: it must hold at least one token id")
    if prompt.messages is not None:
        if not prompt.messages:
            raise ValueError("messages is empty: a chat prompt needs at least one message")
        for i, m in enumerate(prompt.messages):
            if not m.role:
                raise ValueError(f"messages[{i}].role is empty (e.g. 'system', 'user', 'assistant')")
    size = prompt.nbytes + 4 * len(request.resume.token_ids)  # resumed tokens extend the prompt (S10)
    if size > limits.max_prompt_bytes:
        raise ValueError(f"prompt is {size} bytes; this server accepts at most {limits.max_prompt_bytes} "
                         "bytes per prompt (router --max-prompt-bytes)")
    params = sampling_from_pb(request.sampling)  # raises ValueError naming the first out-of-range value
    if context_length and prompt.token_ids is not None:
        streamed = len(request.resume.token_ids) if request.HasField("resume") else 0
        clamp = request.sampling.clamp_max_tokens or not request.sampling.HasField("max_tokens")
        fit_context(params, len(prompt.token_ids) + streamed, context_length, clamp)
