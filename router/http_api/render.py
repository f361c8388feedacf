"""GenerateResponse messages -> OpenAI JSON: whole responses and streamed chunks (R2).

    r = Renderer(call, response_id="cmpl-...", model="SmolLM2-135M-Instruct", created=1700000000)
    for msg in stream: events += r.chunks(msg)     # streaming: one `data:` event each
    r.usage_chunk()                                 # when stream_options.include_usage
    r.add(msg) ... r.response()                     # not streaming: one body at the end

Shapes follow OpenAI's API reference: `text_completion` / `chat.completion` objects, `.chunk`
objects when streaming (the chat stream opens with a `{"role": "assistant"}` delta; with
include_usage every chunk has `"usage": null` and a last chunk with no choices carries the usage).
Logprobs: completions give tokens / token_logprobs / top_logprobs / text_offset; chat gives
`content: [{token, logprob, bytes, top_logprobs}]`. A token's text is the one the node reports;
a node that reports none gets vLLM's `token_id:<id>` form. finish_reason is "stop", "length",
or "abort" (request aborted by id or by the server). Usage counts are the node's, unchanged.
"""

from __future__ import annotations

from typing import Any

from pdserve_api.v1 import generate_pb2
from router.http_api.parse import ApiCall

_FINISH = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
    generate_pb2.FINISH_REASON_ERROR: "error",
}


def finish_reason(msg: generate_pb2.GenerateResponse) -> str | None:
    return _FINISH.get(msg.finish_reason)


def token_text(t: generate_pb2.TokenLogprob) -> str:
    return t.text if t.text else f"token_id:{t.token_id}"


def usage(u: generate_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _stop_reason(msg: generate_pb2.GenerateResponse) -> str | int | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


class Renderer:
    """Shapes one request's messages as OpenAI objects; keeps what spans messages (text offsets,
    the whole text and logprobs for a non-streamed answer, the final usage)."""

    def __init__(self, call: ApiCall, response_id: str, model: str, created: int) -> None:
        self.call = call
        self.id = response_id
        self.model = model
        self.created = created
        self._offset = 0  # characters of completion text already reported (completions' text_offset)
        self._text: list[str] = []
        self._logprobs: list[Any] = []  # completion: (token, logprob, top, offset); chat: content entries
        self._usage: dict[str, Any] | None = None
        self._finish: str | None = None
        self._stop_reason: str | int | None = None
        self._opened = False

    @property
    def chat(self) -> bool:
        return self.call.kind == "chat"

    # --- logprobs ---------------------------------------------------------------------------------

    def _chat_logprobs(self, msg: generate_pb2.GenerateResponse) -> list[dict[str, Any]]:
        def entry(t: generate_pb2.TokenLogprob) -> dict[str, Any]:
            text = token_text(t)
            return {"token": text, "logprob": t.logprob, "bytes": list(text.encode("utf-8"))}

        return [{**entry(p.sampled), "top_logprobs": [entry(t) for t in p.top]} for p in msg.logprobs]

    def _completion_logprobs(self, msg: generate_pb2.GenerateResponse) -> list[tuple[str, float, dict, int]]:
        out = []
        for p in msg.logprobs:
            text = token_text(p.sampled)
            top = {token_text(t): t.logprob for t in p.top}
            out.append((text, p.sampled.logprob, top, self._offset))
            self._offset += len(p.sampled.text)
        return out

    @staticmethod
    def _completion_logprobs_object(entries: list[tuple[str, float, dict, int]]) -> dict[str, Any]:
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    # --- streaming --------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                 "created": self.created, "model": self.model, "choices": choices}
        if self.call.include_usage:
            chunk["usage"] = None
        return chunk

    def chunks(self, msg: generate_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The stream events for one message (none for a message that adds nothing)."""
        self._note(msg)
        finish = finish_reason(msg)
        events = []
        if self.chat and not self._opened:
            self._opened = True
            events.append(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        if not (msg.text or msg.logprobs or finish):
            return events
        if self.chat:
            delta = {"content": msg.text} if (msg.text or msg.logprobs) else {}
            lp = {"content": self._chat_logprobs(msg)} if self.call.logprobs is not None else None
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            lp = self._completion_logprobs_object(self._completion_logprobs(msg)) \
                if self.call.logprobs is not None else None
            choice = {"index": 0, "text": msg.text, "logprobs": lp, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = self._stop_reason
        events.append(self._chunk([choice]))
        return events

    def usage_chunk(self) -> dict[str, Any]:
        """The last event when include_usage: no choices, the request's usage."""
        chunk = self._chunk([])
        chunk["usage"] = self._usage
        return chunk

    # --- whole responses --------------------------------------------------------------------------

    def _note(self, msg: generate_pb2.GenerateResponse) -> None:
        if msg.HasField("usage"):
            self._usage = usage(msg.usage)
        if msg.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self._finish = finish_reason(msg)
            self._stop_reason = _stop_reason(msg)

    def add(self, msg: generate_pb2.GenerateResponse) -> None:
        """Fold one message into the non-streamed answer."""
        self._note(msg)
        self._text.append(msg.text)
        if self.call.logprobs is not None:
            self._logprobs.extend(self._chat_logprobs(msg) if self.chat else self._completion_logprobs(msg))

    def response(self) -> dict[str, Any]:
        """The whole answer (after every message was `add`ed)."""
        text = "".join(self._text)
        if self.chat:
            lp = {"content": self._logprobs} if self.call.logprobs is not None else None
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": self._finish, "stop_reason": self._stop_reason}
            kind = "chat.completion"
        else:
            lp = self._completion_logprobs_object(self._logprobs) if self.call.logprobs is not None else None
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": self._finish,
                      "stop_reason": self._stop_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage}
