"""The client gRPC API through the router (R1, R4, R6, S6), against a real `pdserve up` cluster
(1 prefill + 1 decode node, module-scoped).

Evidence: ListModels, the router's Health RPC, grpc.health.v1 and reflection; every sampling
option and logprobs through `pdserve.tools.client` (sync and async) and `pdserve generate --url --json
--logprobs`; bad requests answered INVALID_ARGUMENT / NOT_FOUND with the offending value named,
the server serving on; Abort during the prefill and a stream broken off mid-decode both leave no
page in use and nothing outstanding on any node within a second.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support.cluster import API_CLUSTER, LONG_PROMPT, assert_all_free, cluster_fixture, wait_busy

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, Client, ClientError
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.slow

GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
PROMPT = "The capital of France is"


cluster = cluster_fixture("grpc-api", **API_CLUSTER)


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.url, timeout=120) as c:
        yield c


def test_models_health_and_reflection(cluster, client):
    models = client.list_models()
    assert len(models) == 1 and models[0].id and models[0].max_context_length > 0
    report = client.health()
    assert report.serving and [n.node_id for n in report.nodes] == ["decode-0"]
    node = report.nodes[0]
    assert node.serving and node.reason == "" and node.total_kv_blocks and node.free_kv_blocks == node.total_kv_blocks
    with grpc.insecure_channel(cluster.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", GENERATE_SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        db = ProtoReflectionDescriptorDatabase(channel)
        assert GENERATE_SERVICE in db.get_services()
        methods = {m.name for m in db.FindFileContainingSymbol(GENERATE_SERVICE).service[0].method}
        assert methods == {"Generate", "Abort", "ListModels", "Health"}


def test_sampling_options_and_logprobs_through_the_client(cluster, client):
    greedy = client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 6 == len(greedy.logprobs)
    assert greedy.usage.completion_tokens == 6 and greedy.usage.prompt_tokens > 0
    for token_id, position in zip(greedy.token_ids, greedy.logprobs, strict=True):
        assert position.sampled.token_id == token_id == position.top[0].token_id  # greedy: the most likely
        logprobs = [t.logprob for t in position.top]
        assert len(logprobs) == 3 and logprobs == sorted(logprobs, reverse=True) and logprobs[0] <= 0

    async def async_side():
        async with AsyncClient(cluster.url, timeout=120) as aclient:
            same = await aclient.complete(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
            seeded = [await aclient.complete(PROMPT, SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05,
                                                                    seed=5, max_tokens=6)) for _ in range(2)]
            return same, seeded

    same, seeded = asyncio.run(asyncio.wait_for(async_side(), 180))
    assert (same.text, same.token_ids) == (greedy.text, greedy.token_ids)
    assert [p.sampled.logprob for p in same.logprobs] == pytest.approx([p.sampled.logprob for p in greedy.logprobs],
                                                                        abs=1e-4)
    assert seeded[0].token_ids == seeded[1].token_ids  # same seed, same tokens

    ids = greedy.token_ids
    i = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token that first appears at i
    by_id = client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(ids[i],)))
    assert by_id.finish_reason == "stop" and by_id.stop_reason == ids[i]
    assert by_id.token_ids[:i] == ids[:i] and len(by_id.token_ids) <= i + 1
    word = greedy.text.split()[1]
    by_text = client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=6, stop=(word,)))
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", word)
    assert by_text.text == greedy.text[:greedy.text.index(word)]
    assert_all_free(cluster, time.monotonic(), within=30.0)


def test_generate_url_prints_logprobs(cluster, client, capsys):
    from pdserve.tools.cli import build_parser
    from pdserve.tools.client import cmd_generate_remote

    args = build_parser().parse_args(["generate", "--json", "--max-tokens", "4", "--logprobs", "2", "--url",
                                      cluster.url, PROMPT])
    assert cmd_generate_remote(args) == 0
    line = json.loads(capsys.readouterr().out)
    ref = client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    assert line["text"] == ref.text and line["token_ids"] == list(ref.token_ids)
    assert [p["token_id"] for p in line["logprobs"]] == list(ref.token_ids)
    assert [[t[0] for t in p["top"]] for p in line["logprobs"]] == [[t.token_id for t in p.top] for p in ref.logprobs]


def _status(stub, request: generate_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=120))
    return err.value.code(), err.value.details()


# S6 input limits: the router and the decode node's own port answer them alike.
LIMIT_CASES = [
    (generate_pb2.GenerateRequest(text=PROMPT, sampling=generate_pb2.SamplingOptions(max_tokens=10 ** 9)),
     grpc.StatusCode.INVALID_ARGUMENT, "plus max_tokens=1000000000 for the completion"),
    (generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[1] * 8),
                                  sampling=generate_pb2.SamplingOptions(max_tokens=10 ** 9)),
     grpc.StatusCode.INVALID_ARGUMENT, "1000000008: 8 in the prompt"),
    (generate_pb2.GenerateRequest(text=PROMPT, sampling=generate_pb2.SamplingOptions(stop=["s"] * 17)),
     grpc.StatusCode.INVALID_ARGUMENT, "stop has 17 strings; at most 16 are allowed"),
    (generate_pb2.GenerateRequest(text=PROMPT, sampling=generate_pb2.SamplingOptions(stop=["s" * 300])),
     grpc.StatusCode.INVALID_ARGUMENT, "stop[0] is 300 characters long; at most 256"),
    (generate_pb2.GenerateRequest(text=PROMPT, sampling=generate_pb2.SamplingOptions(stop_token_ids=[1] * 300)),
     grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids has 300 ids; at most 256 are allowed"),
]


def test_the_decode_nodes_own_port_refuses_what_the_router_refuses(cluster):
    decode = next(s.address for s in cluster.specs if s.role == "decode")
    with grpc.insecure_channel(decode) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for request, code, text in LIMIT_CASES:
            got, details = _status(stub, request)
            assert got == code and text in details, (got, details)
        done = list(stub.Generate(generate_pb2.GenerateRequest(text=PROMPT, sampling=generate_pb2.SamplingOptions(
            max_tokens=2, temperature=0)), timeout=120))
        assert done[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH  # and it keeps serving


def test_bad_requests_are_refused_and_the_server_keeps_serving(cluster, client):
    def req(**kw) -> generate_pb2.GenerateRequest:
        r = generate_pb2.GenerateRequest(**kw)
        if r.WhichOneof("prompt") is None:
            r.text = PROMPT
        return r

    empty_ids = req(request_id="empty-ids")
    empty_ids.token_ids.SetInParent()
    empty_chat = req(request_id="empty-chat")
    empty_chat.messages.SetInParent()
    no_role = req(request_id="no-role")
    no_role.messages.messages.add(role="", content="hi")
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (req(sampling=generate_pb2.SamplingOptions(max_tokens=0)), invalid, "max_tokens must be an integer >= 1"),
        (req(sampling=generate_pb2.SamplingOptions(temperature=-1)), invalid, "temperature must be"),
        (req(sampling=generate_pb2.SamplingOptions(top_p=1.5)), invalid, "top_p must be in (0, 1], got 1.5"),
        (req(sampling=generate_pb2.SamplingOptions(logprobs=21)), invalid, "logprobs must be an integer in [0, 20]"),
        (req(sampling=generate_pb2.SamplingOptions(top_k=-2)), invalid, "top_k must be"),
        (generate_pb2.GenerateRequest(request_id="no_prompt"), invalid, "no prompt"),
        (empty_ids, invalid, "token_ids is empty"),
        (empty_chat, invalid, "messages is empty"),
        (no_role, invalid, "messages[0].role is empty"),
        (req(request_id="x" * 300), invalid, "request_id is 300 characters long"),
        (req(text="x" * (2 * 1024 * 1024)), invalid, "prompt is 2097152 bytes"),
        # over the router's message limit (--max-message-bytes, default 7 MiB): refused before parsing
        (req(text="x" * (10 * 1024 * 1024)), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
        (req(token_ids=generate_pb2.TokenIds(ids=[10 ** 6])), invalid, "token ids must be integers in [0, "),
        (req(text="hello " * 9000), invalid, "context"),
        (req(model="no-such-model"), grpc.StatusCode.NOT_FOUND, "unknown model 'no-such-model'"),
    ] + LIMIT_CASES
    with grpc.insecure_channel(cluster.url, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for request, code, text in cases:
            got, details = _status(stub, request)
            assert got == code and text in details, (request.request_id or request.WhichOneof("prompt"), got, details)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=-1)  # the client library refuses it before sending
    with pytest.raises(ClientError) as err:
        client.complete(PROMPT, SamplingParams(max_tokens=2), model="no-such-model")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    done = client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=3))
    assert done.finish_reason == "length" and len(done.token_ids) == 3
    assert_all_free(cluster, time.monotonic(), within=30.0)


def test_abort_during_the_prefill_frees_every_node_within_a_second(cluster):
    prefill = next(s.address for s in cluster.specs if s.role == "prefill")
    rid = "abort-during-prefill"

    async def go():
        async with AsyncClient(cluster.url, timeout=120) as aclient:
            async def consume():
                return [c async for c in aclient.generate("gRPC abort: " + LONG_PROMPT,
                                                          SamplingParams(max_tokens=4), request_id=rid)]

            task = asyncio.create_task(consume())
            await asyncio.to_thread(wait_busy, prefill)
            assert await aclient.abort(rid) is True
            since = time.monotonic()
            chunks = await task
            return since, chunks

    since, chunks = asyncio.run(asyncio.wait_for(go(), 180))
    assert chunks[-1].finish_reason == "abort" and not any(c.token_ids for c in chunks)
    assert_all_free(cluster, since)
    with Client(cluster.url, timeout=30) as c:
        assert c.abort(rid) is False  # idempotent: nothing left to abort


def test_a_stream_broken_off_mid_decode_frees_every_node_within_a_second(cluster):
    async def go():
        async with AsyncClient(cluster.url, timeout=120) as aclient:
            stream = aclient.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
            tokens = 0
            async for chunk in stream:
                tokens += len(chunk.token_ids)
                if tokens >= 3:
                    break
            await stream.aclose()  # cancels the call: the router cancels the node's call
            return time.monotonic()

    since = asyncio.run(asyncio.wait_for(go(), 180))
    assert_all_free(cluster, since)
