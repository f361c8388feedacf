"""The router's OpenAI-compatible HTTP API (R2, R4, S6).

Evidence, against a real `pdserve up` cluster (1 prefill + 1 decode node, module-scoped):
- the official `openai` package streams a chat completion and a completion, and gets the same text
  and usage as the gRPC client for the same greedy request (non-streamed and logprobs too);
- a client that disconnects mid-stream, or while its prompt is still being prefilled, leaves no
  page in use and nothing outstanding on any node within a second (GetNodeInfo of every node);
- bad input (invalid JSON, wrong types, negative max_tokens, unknown model, a 10 MB prompt...) gets
  a 4xx in OpenAI's error shape, and the server keeps serving;
- /v1/models, /health, /metrics.
Without a cluster: the wire format (SSE events, [DONE], include_usage, logprobs shapes, an error
after streaming began) against an in-process backend, and 503 from a router with no decode node.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import aiohttp
import pytest
from support.cluster import API_CLUSTER, LONG_PROMPT, assert_all_free, cluster_fixture, node_addresses, wait_busy
from support.net import free_ports

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client
from pdserve_api.servers import UnavailableError
from pdserve_api.v1 import generate_pb2
from router.config import RouterConfig
from router.http_api import HttpApi, HttpConfig
from router.limits import RequestLimits
from router.server import RouterServer

WAIT = 10.0


# ---- the wire format, against an in-process backend -------------------------------------------


def _msg(text: str = "", ids: tuple[int, ...] = (), finish: int = 0, logprobs: bool = False,
         **kw) -> generate_pb2.GenerateResponse:
    m = generate_pb2.GenerateResponse(request_id="r", text=text, token_ids=list(ids), finish_reason=finish, **kw)
    if logprobs:
        for t in ids:
            p = m.logprobs.add()
            p.sampled.CopyFrom(generate_pb2.TokenLogprob(token_id=t, logprob=-0.5, text=f"<{t}>"))
            p.top.add(token_id=t, logprob=-0.5, text=f"<{t}>")
            p.top.add(token_id=t + 1, logprob=-1.5, text="")  # no text from the node: vLLM's token_id form
    if finish:
        m.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=3, completion_tokens=len(ids) or 2, cached_prompt_tokens=1))
    return m


class FakeBackend:
    """A Backend that replays messages (or raises before the first); records requests and closes."""

    def __init__(self, messages=(), error: Exception | None = None, delay_s: float = 0.0) -> None:
        self.messages = list(messages)
        self.error = error
        self.delay_s = delay_s
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.clients: list[str] = []   # the client of each request (router.clients.http_client)
        self.closed = asyncio.Event()

    async def stream(self, request, client):
        self.requests.append(request)
        self.clients.append(client)
        try:
            if self.error is not None:
                raise self.error
            for m in self.messages:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                yield m
        finally:
            self.closed.set()

    async def list_models(self):
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelInfo(id="fake", max_context_length=64)])

    async def health(self):
        return generate_pb2.HealthResponse(serving=True)

    def context_length(self):
        return 64

    def default_model(self):
        return "fake"


async def _with_api(backend: FakeBackend, fn, limits: RequestLimits | None = None):
    api = HttpApi(backend, HttpConfig(port=0), limits or RequestLimits())
    port = await api.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            return await fn(session)
    finally:
        await api.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 4 * WAIT))


async def _events(response: aiohttp.ClientResponse) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded ("[DONE]" kept as is)."""
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    text = await response.text()
    blocks = [b for b in text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), text
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in blocks]


def test_completion_stream_events_usage_and_done():
    backend = FakeBackend([_msg("Hel", (1,)), _msg(""), _msg("lo", (2, 3), generate_pb2.FINISH_REASON_STOP,
                                                                     stop_string="!")])

    async def go(session):
        body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["!"], "top_k": 3,
                "ignore_eos": True}
        async with session.post("/v1/completions", json=body) as r:
            return await _events(r)

    events = run(_with_api(backend, go))
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo"]  # the empty message adds nothing
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert chunks[-1]["choices"][0]["stop_reason"] == "!"
    assert all(c["object"] == "text_completion" and c["model"] == "m" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    req = backend.requests[0]
    assert req.request_id == chunks[0]["id"] and req.text == "hi" and req.model == "m"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.top_k, s.ignore_eos) == \
        (5, 0.5, pytest.approx(0.9), 7, ["!"], 3, True)
    assert not s.HasField("logprobs")


def test_chat_stream_opens_with_the_role_and_carries_logprobs():
    backend = FakeBackend([_msg("a", (5,), logprobs=True), _msg("b", (6,), generate_pb2.FINISH_REASON_LENGTH,
                                                                 logprobs=True)])

    async def go(session):
        body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                        {"type": "text", "text": "there"}]}],
                "stream": True, "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 2}
        async with session.post("/v1/chat/completions", json=body) as r:
            return await _events(r)

    events = run(_with_api(backend, go))
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])  # no include_usage
    first, *rest = events[:-1]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                            "content": ""}
    assert [c["choices"][0]["delta"] for c in rest] == [{"content": "a"}, {"content": "b"}]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    lp = rest[0]["choices"][0]["logprobs"]["content"]
    assert lp == [{"token": "<5>", "logprob": -0.5, "bytes": list(b"<5>"),
                   "top_logprobs": [{"token": "<5>", "logprob": -0.5, "bytes": list(b"<5>")},
                                    {"token": "token_id:6", "logprob": -1.5, "bytes": list(b"token_id:6")}]}]
    req = backend.requests[0]
    assert [(m.role, m.content) for m in req.messages.messages] == [("system", "be brief"), ("user", "hi there")]
    assert req.sampling.max_tokens == 2 and req.sampling.logprobs == 2


def test_non_streamed_answers_and_defaults():
    backend = FakeBackend([_msg("x", (7,), logprobs=True), _msg("y", (8,), generate_pb2.FINISH_REASON_STOP,
                                                                 logprobs=True)])

    async def go(session):
        async with session.post("/v1/completions", json={"prompt": [1, 2], "logprobs": 1}) as r:
            completion = await r.json()
        async with session.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]}) as r:
            chat = await r.json()
        return completion, chat

    completion, chat = run(_with_api(backend, go))
    c = completion["choices"][0]
    assert completion["object"] == "text_completion" and completion["model"] == "fake"  # default model
    assert c["text"] == "xy" and c["finish_reason"] == "stop"
    assert c["logprobs"] == {"tokens": ["<7>", "<8>"], "token_logprobs": [-0.5, -0.5],
                             "top_logprobs": [{"<7>": -0.5, "token_id:8": -1.5}, {"<8>": -0.5, "token_id:9": -1.5}],
                             "text_offset": [0, 3]}
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "xy"}
    assert chat["choices"][0]["logprobs"] is None and chat["usage"]["total_tokens"] == 3 + 1
    completion_req, chat_req = backend.requests
    assert list(completion_req.token_ids.ids) == [1, 2] and not completion_req.sampling.HasField("max_tokens")
    assert chat_req.sampling.max_tokens == 64  # chat default: the context length
    assert chat_req.sampling.clamp_max_tokens and not completion_req.sampling.clamp_max_tokens  # lowered to fit


def test_errors_before_the_stream_keep_their_status_and_after_it_end_the_stream():
    cases = [(UnavailableError("no healthy decode node"), 503, "service_unavailable", None),
             (ValueError("prompt has 99 tokens but the model's context is 64 tokens"), 400, "invalid_request_error",
              None),
             (LookupError("unknown model 'x'; this node serves 'fake'"), 404, "invalid_request_error",
              "model_not_found")]
    for error, status, kind, code in cases:
        async def go(session):
            async with session.post("/v1/completions", json={"prompt": "p", "stream": True}) as r:
                return r.status, r.content_type, await r.json()

        got_status, content_type, body = run(_with_api(FakeBackend(error=error), go))
        assert (got_status, content_type, body["error"]["type"], body["error"]["code"]) == \
            (status, "application/json", kind, code), body
        assert body["error"]["message"] == str(error)

    failed = _msg(finish=generate_pb2.FINISH_REASON_ERROR, error="decode node 127.0.0.1:1 failed mid-stream")

    async def go_stream(session):
        async with session.post("/v1/completions", json={"prompt": "p", "stream": True}) as r:
            return await _events(r)

    events = run(_with_api(FakeBackend([_msg("a", (1,)), failed]), go_stream))
    assert events[0]["choices"][0]["text"] == "a" and events[-1] == "[DONE]"
    assert events[1]["error"]["message"] == "decode node 127.0.0.1:1 failed mid-stream"

    async def go_whole(session):
        async with session.post("/v1/completions", json={"prompt": "p"}) as r:
            return r.status, await r.json()

    status, body = run(_with_api(FakeBackend([_msg("a", (1,)), failed]), go_whole))
    assert status == 500 and "failed mid-stream" in body["error"]["message"]


BAD_BODIES = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "p", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "p", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "p", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "p", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "p", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"prompt": "p", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "p", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "p", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "p", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "p", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "p", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "p", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "p", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "p", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "p", "model": 3}, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "p", "stop": [f"s{i}" for i in range(17)]}, "stop"),        # S6 input caps
    ("/v1/completions", {"prompt": "p", "stop": "s" * 257}, "stop"),
    ("/v1/completions", {"prompt": "p", "stop_token_ids": list(range(257))}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1] * 60, "max_tokens": 5}, "max_tokens"),  # 65 > the fake's context of 64
    ("/v1/completions", b"[" * 50_000 + b"]" * 50_000, None),                    # nesting past the parser's guard
    ("/v1/completions", {"prompt": "p", "user": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
     None),                                                                       # 34 levels: past MAX_JSON_DEPTH
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]},
     "tools"),
]


def test_bad_bodies_get_400_naming_the_field_and_reach_no_node():
    backend = FakeBackend([_msg("a", (1,), generate_pb2.FINISH_REASON_STOP)])

    async def go(session):
        answers = []
        for path, body, _ in BAD_BODIES:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
                answers.append((r.status, await r.json()))
        async with session.post("/v1/completions", data=b"x" * (8 << 20)) as r:  # over the body limit
            too_large = r.status, await r.json()
        async with session.post("/v1/completions", json={"prompt": "p" * 2048}) as r:  # over max_prompt_bytes
            long_prompt = r.status, await r.json()
        async with session.get("/v1/nothing") as r:
            unknown = r.status, await r.json()
        async with session.post("/v1/completions", json={"prompt": "p"}) as r:  # still serving
            good = r.status
        return answers, too_large, long_prompt, unknown, good

    answers, too_large, long_prompt, unknown, good = run(_with_api(backend, go, RequestLimits(max_prompt_bytes=1024)))
    for (_path, body, param), (status, reply) in zip(BAD_BODIES, answers, strict=True):
        error = reply["error"]
        assert (status, error["type"], error["param"]) == (400, "invalid_request_error", param), (body, reply)
        assert error["message"], body
    assert too_large[0] == 413 and "larger than" in too_large[1]["error"]["message"]
    assert long_prompt[0] == 400 and "prompt is 2048 bytes" in long_prompt[1]["error"]["message"]
    assert unknown[0] == 404 and unknown[1]["error"]["message"] == "no route GET /v1/nothing"
    assert good == 200 and len(backend.requests) == 1  # no bad request reached the backend


def test_client_disconnect_closes_the_backend_stream():
    backend = FakeBackend([_msg("a", (i,)) for i in range(1000)], delay_s=0.01)

    async def go(session):
        async with session.post("/v1/completions", json={"prompt": "p", "stream": True}) as r:
            await r.content.readline()
        # Leaving the block releases the connection mid-stream; the handler is cancelled.
        await asyncio.wait_for(backend.closed.wait(), WAIT)
        return len(backend.requests)

    assert run(_with_api(backend, go)) == 1


def test_streaming_connections_have_nagle_off():
    """R2: TCP_NODELAY on the server side of a streaming connection (aiohttp sets it on accept)."""
    backend = FakeBackend([_msg("a", (i,)) for i in range(50)], delay_s=0.01)

    async def go():
        api = HttpApi(backend, HttpConfig(port=0), RequestLimits())
        port = await api.start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
                async with session.post("/v1/completions", json={"prompt": "p", "stream": True}) as r:
                    await r.content.readline()
                    server_sockets = [c.transport.get_extra_info("socket") for c in api._runner.server.connections]
                    return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in server_sockets]
        finally:
            await api.stop()

    flags = run(go())
    assert flags and all(flags), flags


def test_slow_bodies_get_408_and_idle_connections_are_closed():
    """S8: a body that does not arrive within body_timeout_s is answered 408; a connection that sends
    no request within idle_timeout_s is closed by the server."""
    backend = FakeBackend([_msg("a", (1,), generate_pb2.FINISH_REASON_STOP)])

    async def go():
        api = HttpApi(backend, HttpConfig(port=0, idle_timeout_s=0.5, body_timeout_s=0.5), RequestLimits())
        port = await api.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")   # 11 of the 100 bytes, then nothing
            await writer.drain()
            slow = await asyncio.wait_for(reader.read(4096), WAIT)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            idle = await asyncio.wait_for(reader.read(4096), WAIT)    # b"": closed by the server
            writer.close()
            return slow, idle
        finally:
            await api.stop()

    slow, idle = run(go())
    assert slow.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in slow, slow[:300]
    assert idle == b"" and not backend.requests


def test_router_without_a_decode_node_answers_503():
    async def go():
        dead, = free_ports(1)
        server = RouterServer(RouterConfig(port=0, decode_nodes=(f"127.0.0.1:{dead}",), health_interval_s=0.2),
                              http=HttpConfig(port=0))
        await server.start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{server.http_port}") as session:
                out = {}
                for method, path, body in (("POST", "/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
                                           ("POST", "/v1/completions", {"prompt": "hi"}),
                                           ("GET", "/v1/models", None), ("GET", "/health", None)):
                    async with session.request(method, path, json=body) as r:
                        out[path] = r.status, await r.json()
                async with session.get("/metrics") as r:
                    metrics = r.status, r.headers["Content-Type"]
            return out, metrics
        finally:
            await server.stop(grace=0.5)

    out, metrics = run(go())
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models"):
        status, body = out[path]
        assert status == 503 and "no healthy decode node" in body["error"]["message"], (path, body)
    status, health = out["/health"]
    assert status == 503 and health["status"] == "unavailable" and not health["nodes"][0]["serving"]
    assert metrics[0] == 200 and metrics[1].startswith("text/plain")


# ---- a real cluster ------------------------------------------------------------------------------


cluster = cluster_fixture("http-api", **API_CLUSTER)


@pytest.fixture(scope="module")
def openai_client(cluster):
    import openai

    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(openai_client):
    models = openai_client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "pdserve"
    return models[0].id


CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.mark.slow
def test_openai_streams_chat_and_completion_with_the_grpc_clients_text(cluster, openai_client, model):
    with Client(cluster.url, timeout=120) as grpc_client:
        chat_ref = grpc_client.complete(CHAT, GREEDY)
        text_ref = grpc_client.complete(PROMPT, GREEDY)

    chunks = list(openai_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat_ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat_ref.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == chat_ref.usage.prompt_tokens

    chunks = list(openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_ref.text
    assert chunks[-1].usage.total_tokens == text_ref.usage.prompt_tokens + text_ref.usage.completion_tokens


@pytest.mark.slow
def test_openai_whole_answers_logprobs_stop_and_seed_match_grpc(cluster, openai_client, model):
    with Client(cluster.url, timeout=120) as grpc_client:
        ref = grpc_client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))
        chat_ref = grpc_client.complete(CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))
        sampled = grpc_client.complete(PROMPT, SamplingParams(temperature=1.0, seed=11, max_tokens=5))
    assert len(ref.logprobs) == len(ref.token_ids) == 5

    def token(t):
        return t.text or f"token_id:{t.token_id}"

    done = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    choice = done.choices[0]
    assert choice.text == ref.text and done.usage.completion_tokens == 5
    assert choice.logprobs.tokens == [token(p.sampled) for p in ref.logprobs]
    assert choice.logprobs.token_logprobs == pytest.approx([p.sampled.logprob for p in ref.logprobs], abs=1e-4)
    assert [list(d) for d in choice.logprobs.top_logprobs] == [[token(t) for t in p.top] for p in ref.logprobs]

    chat = openai_client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content == chat_ref.text
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [token(p.sampled) for p in chat_ref.logprobs]
    assert [len(c.top_logprobs) for c in content] == [2] * 5

    again = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11)
    assert again.choices[0].text == sampled.text
    stop = ref.text.strip().split()[0]
    cut = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == ref.text[:ref.text.index(stop)]


# ~170 tokens with its own leading tag: two full 64-token pages of the prompt minus its last token
CACHED_PROMPT = "Cached usage: " + "A prefix cache keeps the pages of a prompt it has seen before. " * 12


@pytest.mark.slow
def test_a_repeated_prompt_reports_cached_tokens(cluster, openai_client, model):
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefill node took from its
    prefix cache instead of computing; 0 the first time, whole pages the second (HTTP and gRPC)."""
    first = openai_client.completions.create(model=model, prompt=CACHED_PROMPT, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 2 * 64 + 1, first.usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(openai_client.completions.create(
        model=model, prompt=CACHED_PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == first.usage.prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    # whole pages of the prompt minus its last token (the decode node computes that one)
    assert cached >= 2 * 64 and cached % 64 == 0 and cached <= usage.prompt_tokens - 1, usage
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    with Client(cluster.url, timeout=120) as grpc_client:
        again = grpc_client.complete(CACHED_PROMPT, SamplingParams(temperature=0, max_tokens=4))
    assert again.usage.cached_prompt_tokens == cached and again.text == first.choices[0].text
    chats = [openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": CACHED_PROMPT}], max_tokens=1, temperature=0)
        for _ in range(2)]
    assert chats[0].usage.prompt_tokens_details.cached_tokens == 0  # templated: another prefix
    assert chats[1].usage.prompt_tokens_details.cached_tokens >= 2 * 64


@pytest.mark.slow
def test_models_health_and_metrics(cluster, model):
    async def go():
        async with aiohttp.ClientSession(cluster.http_url) as session:
            async with session.get("/v1/models") as r:
                models = await r.json()
            async with session.get("/health") as r:
                health = r.status, await r.json()
            async with session.get("/metrics") as r:
                metrics = r.status, r.headers["Content-Type"], await r.text()
            nodes = {}
            for name, url in cluster.metrics_urls.items():
                async with session.get(url) as r:
                    nodes[name] = r.status, await r.text()
        return models, health, metrics, nodes

    models, (status, health), (m_status, m_type, text), nodes = run(go())
    assert set(nodes) == {"router", "prefill-0", "decode-0"} and cluster.metrics_urls["router"] == \
        f"{cluster.http_url}/metrics"
    assert all(code == 200 and "pdserve:" in body for code, body in nodes.values()), nodes
    assert models["object"] == "list" and models["data"][0]["id"] == model
    assert models["data"][0]["max_model_len"] > 0
    assert status == 200 and health["status"] == "ok"
    assert [n["node_id"] for n in health["nodes"]] == ["decode-0"] and health["nodes"][0]["serving"]
    assert m_status == 200 and m_type.startswith("text/plain")
    assert "pdserve:e2e_request_latency_seconds" in text  # the router's own registry, after requests ran


def _open_stream(http_url: str, path: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 POST, left open: the test decides when the client goes away."""
    url = urlsplit(http_url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.slow
def test_disconnect_mid_stream_frees_every_node_within_a_second(cluster, model):
    sock = _open_stream(cluster.http_url, "/v1/chat/completions",
                        {"model": model, "messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True})
    received = b""
    while received.count(b"data: ") < 3:  # the role chunk and two content chunks: decoding is under way
        more = sock.recv(65536)
        assert more, received
        received += more
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    since = time.monotonic()
    assert_all_free(cluster, since)


@pytest.mark.slow
def test_disconnect_during_the_prefill_frees_every_node_within_a_second(cluster, model):
    prefill, decode = (s.address for s in cluster.specs if s.role in ("prefill", "decode"))
    sock = _open_stream(cluster.http_url, "/v1/completions",
                        {"model": model, "prompt": "HTTP: " + LONG_PROMPT, "max_tokens": 4, "stream": True})
    wait_busy(prefill)  # the prefill node is computing the prompt's KV (no token exists yet)
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(1)  # nothing was sent: the answer starts with the first token
    sock.close()
    since = time.monotonic()
    assert_all_free(cluster, since)
    assert set(node_addresses(cluster)) == {prefill, decode}


@pytest.mark.slow
def test_bad_input_gets_4xx_and_the_server_keeps_serving(cluster, openai_client, model):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        openai_client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"

    async def go():
        out = []
        async with aiohttp.ClientSession(cluster.http_url) as session:
            for body in (b"{\"model\": ", {"model": model, "prompt": PROMPT, "temperature": "0"},
                         {"model": model, "prompt": [10 ** 6]},  # token id beyond the vocabulary
                         {"model": model, "prompt": "hello " * 9000},  # more tokens than the context
                         {"model": model, "prompt": PROMPT, "max_tokens": 10 ** 9},  # S6: past the context left
                         {"model": model, "prompt": "x" * (10 * 1024 * 1024)}):
                path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with session.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
                    error = (await r.json())["error"]
                    out.append((r.status, error["message"], error["param"]))
        return out

    (bad_json, wrong_type, bad_id, too_long, too_many, huge) = run(go())
    assert too_many[0] == 400 and "plus max_tokens=1000000000 for the completion" in too_many[1]
    assert too_many[2] == "max_tokens"  # the node's refusal names the field
    assert bad_json[0] == 400 and "not valid JSON" in bad_json[1]
    assert wrong_type[0] == 400 and "temperature must be a finite number" in wrong_type[1]
    assert bad_id[0] == 400 and "token ids must be integers in [0, " in bad_id[1]
    assert too_long[0] == 400 and "context" in too_long[1]
    assert huge[0] == 413 and "larger than" in huge[1]
    done = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3
    assert_all_free(cluster, time.monotonic(), within=30.0)
