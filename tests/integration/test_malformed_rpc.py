"""Malformed and absurd input on every RPC of every server, and on the HTTP front (issue 15's
evidence: "malformed bytes on every RPC; forged descriptors").

One small cluster (1 prefill + 1 decode node and the router, a tiny model). The RPCs are not listed
by hand: each server's reflection names the services it serves, and every method of those that
proto/pdserve_api describes is called through a generic channel (identity serializers, so the
bytes on the wire are exactly the test's) with:
- bodies that do not parse (invalid tags, truncated fields, lengths past the end, invalid UTF-8 in
  a string field, groups nested past the parser's recursion limit, seeded random bytes that the
  local parser refuses): INVALID_ARGUMENT naming the method;
- bodies that parse (random bytes that happen to, unknown fields, wrong wire types): any answer
  but a crash;
- well-formed messages with absurd values (ids of 1 MB, huge repeated fields, negative or
  overflowing numbers, unknown enum values, token ids outside the vocabulary, forged KV
  descriptors naming memory of an engine that is not the caller's): INVALID_ARGUMENT,
  PERMISSION_DENIED, RESOURCE_EXHAUSTED, NOT_FOUND, OUT_OF_RANGE or FAILED_PRECONDITION
  (UNIMPLEMENTED for the GenerateService methods a decode node does not serve).
No call may end UNKNOWN, INTERNAL, UNAVAILABLE or past its deadline, nor carry a traceback in its
details. Afterwards no process has exited, every node is back to free == total with nothing held,
tagged or in flight, and a normal request gives the same greedy tokens as before any of it.

The HTTP front gets garbage JSON, wrong content types, non-object bodies, wrong field types,
absurd values, huge headers and a lying Content-Length: always a 4xx, never a 5xx.

Every wait is bounded: each call has CALL_TIMEOUT_S, cleanup LEAK_WAIT_S.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import message, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.cluster import node_info, running_cluster, transfer_leftovers
from support.tiny_models import make_tiny_checkpoint
from support.wait import wait_until

from fabric import PeerDescriptor, RemoteDescriptor
from fabric.liveness import host_id
from kv_messenger import KvLayout, TransferTicket
from kv_messenger.ticket import peer_from_bytes, remote_to_bytes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client
from pdserve_api.v1 import common_pb2, generate_pb2, node_pb2, prefill_pb2

CALL_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 2   # the router's --http-body-timeout-s: a body that never comes is answered 408 by then
LEAK_WAIT_S = 30.0
API_FILES = (generate_pb2.DESCRIPTOR, node_pb2.DESCRIPTOR, prefill_pb2.DESCRIPTOR)
# What a refusal may be; anything else (UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED, ...) fails.
REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.UNIMPLEMENTED})   # the decode node serves Generate, not ListModels
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The capital of France is"
MB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "tiny-llama")
    with running_cluster(tmp_path_factory, "malformed", prefill=1, decode=1, port=0, http_port=0, model=str(model),
                         num_blocks=64, threads_per_node=1, startup_timeout_s=150, router_health_interval_s=0.5,
                         engine_args=("--max-batch-tokens", "32", "--page-size", "16"),
                         router_args=("--http-body-timeout-s", str(BODY_TIMEOUT_S))) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster) -> tuple[int, ...]:
    """The greedy tokens of a normal request before any malformed input."""
    with Client(cluster.url, timeout=CALL_TIMEOUT_S) as c:
        out = c.complete(PROMPT, GREEDY, request_id="reference").token_ids
    assert len(out) == GREEDY.max_tokens
    return out


# --- the RPCs, from reflection and the descriptors --------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    server: str           # the process name (router, decode-0, prefill-0)
    address: str
    path: str             # /package.Service/Method
    streaming: bool       # server-streaming response
    input: type[message.Message]


def served_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=CALL_TIMEOUT_S)
        return {s.name for r in replies for s in r.list_services_response.service}


def rpcs(cluster) -> list[Rpc]:
    out: list[Rpc] = []
    for spec in cluster.specs:
        served = served_services(spec.address)
        for file in API_FILES:
            for service in file.services_by_name.values():
                if service.full_name not in served:
                    continue
                for m in service.methods:
                    out.append(Rpc(spec.name, spec.address, f"/{service.full_name}/{m.name}", m.server_streaming,
                                   message_factory.GetMessageClass(m.input_type)))
    return out


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str


def call(channel: grpc.Channel, rpc: Rpc, body: bytes) -> Outcome:
    """The status `body` gets on `rpc` (a stream is read to its end)."""
    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731 - bytes as they are, both ways
    try:
        if rpc.streaming:
            for _ in channel.unary_stream(rpc.path, request_serializer=identity, response_deserializer=identity)(
                    body, timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(rpc.path, request_serializer=identity, response_deserializer=identity)(
                body, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "")
    return Outcome(grpc.StatusCode.OK, "")


def parses(cls: type[message.Message], body: bytes) -> bool:
    try:
        cls.FromString(body)
    except message.DecodeError:
        return False
    return True


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string_field(cls: type[message.Message]) -> int | None:
    for f in cls.DESCRIPTOR.fields:
        if f.type == f.TYPE_STRING:
            return f.number
    return None


def malformed_bodies(cls: type[message.Message], rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what, bytes) meant not to parse as `cls` (the caller asks the local parser which do not)."""
    yield "invalid tag 0", b"\x00\x01"
    yield "0xff bytes", b"\xff" * 11
    yield "unterminated varint", b"\x08" + b"\x80" * 12
    yield "length past the end", b"\x0a" + _varint(1000) + b"abc"
    yield "length of 2^35", b"\x0a" + _varint(1 << 35) + b"x"
    yield "groups nested past the recursion limit", b"\x0b" * 200
    yield "end group without start", b"\x0c"
    string_field = _string_field(cls)
    if string_field is not None:
        yield f"invalid UTF-8 in string field {string_field}", _varint(string_field << 3 | 2) + b"\x03\xff\xfe\xfd"
    full = _full_message(cls)
    if len(full) > 2:
        yield "a valid message cut in half", full[: len(full) // 2 + 1]
    for n in (1, 3, 17, 256, 4096):
        for _ in range(4):
            body = rng.randbytes(n)
            if not parses(cls, body):
                yield f"{n} random bytes", body
                break


def _full_message(cls: type[message.Message]) -> bytes:
    """`cls` with its string and repeated scalar fields set, serialized (something to truncate)."""
    m = cls()
    for f in cls.DESCRIPTOR.fields:
        if f.type == f.TYPE_STRING and not f.is_repeated and f.containing_oneof is None:
            setattr(m, f.name, "x" * 40)
        elif f.is_repeated and f.type == f.TYPE_UINT32:
            getattr(m, f.name).extend(range(1, 30))
    return m.SerializeToString()


def parsing_bodies(cls: type[message.Message]) -> Iterator[tuple[str, bytes]]:
    """(what, bytes) that parse as `cls` although they are odd: unknown fields, wrong wire types."""
    yield "an unknown field 999", _varint(999 << 3 | 2) + b"\x05hello"
    yield "field 1 with a wrong wire type (fixed32)", _varint(1 << 3 | 5) + b"\x01\x02\x03\x04"
    yield "empty", b""


def assert_refusal(what: str, rpc: Rpc, got: Outcome, allow_ok: bool) -> None:
    ok = (got.code in REFUSALS) or (allow_ok and got.code == grpc.StatusCode.OK)
    assert ok, f"{rpc.server} {rpc.path} with {what}: {got.code.name} {got.details[:300]!r}"
    assert "Traceback" not in got.details, f"{rpc.server} {rpc.path} with {what}: a traceback in {got.details!r}"


def assert_alive(cluster) -> None:
    assert not cluster.poll(), f"processes exited: {cluster.poll()}"


def assert_clean_and_same(cluster, reference: tuple[int, ...]) -> None:
    assert_alive(cluster)
    nodes = [s.address for s in cluster.specs if s.role != "router"]
    wait_until(lambda: transfer_leftovers(nodes), LEAK_WAIT_S,
               "every node free == total with nothing held, tagged or in flight", interval=0.2)
    with Client(cluster.url, timeout=CALL_TIMEOUT_S) as c:
        assert c.complete(PROMPT, GREEDY, request_id="after").token_ids == reference


# --- tests ------------------------------------------------------------------------------------------


def test_every_rpc_is_found(cluster):
    """The enumeration itself: each server serves what its role should (so the next tests cover them)."""
    by_server: dict[str, set[str]] = {}
    for r in rpcs(cluster):
        by_server.setdefault(r.server, set()).add(r.path.rsplit("/", 1)[1])
    assert {"Generate", "Abort", "ListModels", "Health"} <= by_server["router"]
    assert {"Generate", "Abort", "GetNodeInfo"} <= by_server["decode-0"]
    assert {"Prefill", "AbortPrefill", "GetNodeInfo"} <= by_server["prefill-0"]


def test_malformed_bytes_on_every_rpc(cluster, reference):
    rng = random.Random(15)
    checked = 0
    for rpc in rpcs(cluster):
        refused = 0
        with grpc.insecure_channel(rpc.address) as channel:
            for what, body in [*malformed_bodies(rpc.input, rng), *parsing_bodies(rpc.input)]:
                got = call(channel, rpc, body)
                checked += 1
                if parses(rpc.input, body):   # odd but a message: any answer but a crash
                    assert_refusal(what, rpc, got, allow_ok=True)
                    continue
                assert got.code == grpc.StatusCode.INVALID_ARGUMENT, \
                    f"{rpc.server} {rpc.path} with {what}: {got.code.name} {got.details[:300]!r}"
                assert "Traceback" not in got.details and got.details, (rpc.path, what, got)
                refused += 1
        assert refused >= 6, f"{rpc.server} {rpc.path}: only {refused} bodies that do not parse were sent"
    print(f"malformed: {checked} calls")
    assert_clean_and_same(cluster, reference)


def _generate_cases() -> Iterator[tuple[str, generate_pb2.GenerateRequest]]:
    S = generate_pb2.SamplingOptions

    def req(**kw) -> generate_pb2.GenerateRequest:
        if "token_ids" not in kw:
            kw.setdefault("text", PROMPT)
        sampling = kw.pop("sampling", S(max_tokens=2, temperature=0))
        return generate_pb2.GenerateRequest(sampling=sampling, **kw)

    yield "request_id of 1 MB", req(request_id="r" * MB)
    yield "model name of 1 MB", req(model="m" * MB)
    yield "an unknown model", req(model="no-such-model")
    yield "no prompt", generate_pb2.GenerateRequest(sampling=S(max_tokens=2))
    yield "empty token ids", generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(), sampling=S(max_tokens=2))
    yield "token ids outside the vocabulary", req(token_ids=generate_pb2.TokenIds(ids=[1, 2**32 - 1]))
    yield "1M token ids", req(token_ids=generate_pb2.TokenIds(ids=[7] * MB))
    yield "a prompt of 8 MB", req(text="a " * (4 * MB))
    yield "empty messages", generate_pb2.GenerateRequest(messages=generate_pb2.ChatMessages(), sampling=S(max_tokens=2))
    yield "a message of 1 MB with an empty role", generate_pb2.GenerateRequest(
        messages=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="", content="c" * MB)]),
        sampling=S(max_tokens=2))
    yield "temperature -1", req(sampling=S(temperature=-1, max_tokens=2))
    yield "temperature nan", req(sampling=S(temperature=float("nan"), max_tokens=2))
    yield "top_p 2", req(sampling=S(top_p=2.0, max_tokens=2))
    yield "top_k -5", req(sampling=S(top_k=-5, max_tokens=2))
    yield "min_p -1", req(sampling=S(min_p=-1.0, max_tokens=2))
    yield "max_tokens 0", req(sampling=S(max_tokens=0))
    yield "max_tokens 2^32-1", req(sampling=S(max_tokens=2**32 - 1))
    yield "100000 stop strings", req(sampling=S(max_tokens=2, stop=["x"] * 100_000))
    yield "a stop string of 1 MB", req(sampling=S(max_tokens=2, stop=["s" * MB]))
    yield "1M stop token ids", req(sampling=S(max_tokens=2, stop_token_ids=[3] * MB))
    yield "logprobs 2^32-1", req(sampling=S(max_tokens=2, logprobs=2**32 - 1))
    yield "resume with 1M token ids", req(resume=generate_pb2.ResumeFrom(token_ids=[5] * MB))
    yield "resume with token ids outside the vocabulary", req(resume=generate_pb2.ResumeFrom(token_ids=[2**31]))


def _unary(channel: grpc.Channel, path: str, req: message.Message, streaming: bool = False) -> Outcome:
    rpc = Rpc("", "", path, streaming, type(req))
    return call(channel, rpc, req.SerializeToString())


def test_absurd_generate_requests(cluster, reference):
    """On the router and on the decode node's own port (the nodes check the same, D/S6)."""
    for name in ("router", "decode-0"):
        address = cluster.processes[name].address
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 * MB)]) as channel:
            for what, req in _generate_cases():
                t0 = time.monotonic()
                got = _unary(channel, "/pdserve.api.v1.GenerateService/Generate", req, streaming=True)
                print(f"{name} {what}: {got.code.name} in {time.monotonic() - t0:.2f} s: {got.details[:120]}")
                assert_refusal(what, Rpc(name, address, "Generate", True, type(req)), got, allow_ok=False)
            for what, req in (("an abort id of 1 MB", generate_pb2.AbortRequest(request_id="a" * MB)),):
                got = _unary(channel, "/pdserve.api.v1.GenerateService/Abort", req)   # OK: nothing to abort
                assert_refusal(what, Rpc(name, address, "Abort", False, type(req)), got, allow_ok=True)
    assert_clean_and_same(cluster, reference)


def _forged(peer: PeerDescriptor, kv_peer: PeerDescriptor, *, rid: str = "forged", pages: tuple[int, ...] = (0,),
            num_pages: int = 8, tokens: int = 4, length: int = MB, tag: int = 77) -> prefill_pb2.PrefillRequest:
    layout = KvLayout(num_layers=2, num_pages=num_pages, kv_heads=2, page_size=16, head_dim=16, dtype="float32")
    ticket = TransferTicket(request_id=rid, kv=RemoteDescriptor(kv_peer, 1, 0, 1, length), layout=layout,
                            dst_pages=pages, context=RemoteDescriptor(peer, 2, 0, 2, 1 << 16), context_offset=0,
                            imm_tag=tag, expected_writes=3, num_prefill_tokens=tokens)
    return ticket.to_pb(list(range(1, tokens + 1)), peer)


def _prefill_cases(decode_peer: PeerDescriptor) -> Iterator[tuple[str, prefill_pb2.PrefillRequest]]:
    other = PeerDescriptor("shm", b"fi_shm://other\0", "o" * 32, host_id(), 1, 1)
    ok = _forged(decode_peer, decode_peer)
    yield "KV memory of another engine than the peer", _forged(decode_peer, other)
    yield "peer and KV memory of an engine that does not exist", _forged(other, other)
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.kv_memory[0].descriptor = b"\x00" * 7
    yield "a KV descriptor of 7 bytes", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.peer.descriptor = b"\xff" * MB
    yield "a peer descriptor of 1 MB garbage", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.kv_memory.append(r.kv_memory[0])
    yield "two KV memories for tp_size 1", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    del r.token_ids[:]
    yield "no tokens", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.page_ids[:] = [2**32 - 1]
    yield "a page id outside the layout", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.page_ids.extend([0] * MB)
    yield "1M page ids", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.token_ids.extend([2**32 - 1] * 12)
    r.page_ids[:] = [0]
    yield "token ids outside the vocabulary", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.imm_tag = 2**32 - 1
    yield "imm_tag 2^32-1", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.kv_memory[0].layout.num_layers = 2**32 - 1
    yield "2^32-1 layers", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.kv_memory[0].layout.page_stride = 2**64 - 1
    yield "a page stride of 2^64-1", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.kv_memory[0].layout.dtype = "complex256"
    yield "dtype complex256", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.sharding.CopyFrom(common_pb2.ShardingScheme(tp_size=2**31, kv_heads_per_rank=0, total_kv_heads=7))
    yield "tp_size 2^31", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.deadline_s = -1.0
    yield "deadline -1 s", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.request_id = "p" * MB
    yield "request_id of 1 MB", r
    r = prefill_pb2.PrefillRequest()
    r.CopyFrom(ok)
    r.model = "no-such-model"
    yield "an unknown model", r


def _abort_cases(decode_peer: PeerDescriptor, prefill_engine: str) -> Iterator[tuple[str, message.Message]]:
    other = PeerDescriptor("shm", b"fi_shm://other\0", "o" * 32, host_id(), 1, 1)
    A = prefill_pb2.AbortPrefillRequest
    yield "a fence aimed at another engine", A(
        request_id="r-1", decode_engine_id=decode_peer.engine_id, prefill_engine_id=prefill_engine, fence_tag=5,
        fence_region=remote_to_bytes(RemoteDescriptor(other, region_id=1, base=0, key=1, length=8)))
    yield "a fence region of 1 MB garbage", A(request_id="r-1", decode_engine_id=decode_peer.engine_id,
                                               prefill_engine_id=prefill_engine, fence_tag=5, fence_region=b"\x01" * MB)
    yield "a request id of 1 MB", A(request_id="a" * MB, decode_engine_id=decode_peer.engine_id)


def test_absurd_and_forged_prefill_requests(cluster, reference):
    """The prefill node's own port: forged KV descriptors are refused by its authorization, absurd
    values by its checks; nothing is written, nothing crashes."""
    decode_peer = peer_from_bytes(node_info(cluster.processes["decode-0"].address).fabric_peer)
    prefill = cluster.processes["prefill-0"].address
    prefill_engine = peer_from_bytes(node_info(prefill).fabric_peer).engine_id
    with grpc.insecure_channel(prefill, options=[("grpc.max_send_message_length", 64 * MB)]) as channel:
        for what, req in _prefill_cases(decode_peer):
            got = _unary(channel, "/pdserve.api.v1.PrefillService/Prefill", req)
            assert_refusal(what, Rpc("prefill-0", prefill, "Prefill", False, type(req)), got, allow_ok=False)
            if what == "KV memory of another engine than the peer":
                assert got.code == grpc.StatusCode.PERMISSION_DENIED, got
        for what, req in _abort_cases(decode_peer, prefill_engine):
            got = _unary(channel, "/pdserve.api.v1.PrefillService/AbortPrefill", req)
            assert_refusal(what, Rpc("prefill-0", prefill, "AbortPrefill", False, type(req)), got, allow_ok=False)
            if what == "a fence aimed at another engine":
                assert got.code == grpc.StatusCode.PERMISSION_DENIED, got
    assert_clean_and_same(cluster, reference)


# --- HTTP ---------------------------------------------------------------------------------------------


def _http(cluster, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = cluster.http_url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _raw_http(cluster, raw: bytes) -> int | None:
    """The status of a hand-written HTTP request (headers http.client would refuse to send)."""
    host, port = cluster.http_url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S) as s:
        s.sendall(raw)   # and no shutdown: a server that sees EOF has no one to answer
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    if not data:
        return None
    line = data.split(b"\r\n", 1)[0]
    assert line.startswith(b"HTTP/1."), f"no HTTP status line: {data[:200]!r}"
    return int(line.split()[1])


def test_http_front_answers_4xx_to_bad_input(cluster, reference):
    JSON = {"Content-Type": "application/json"}
    completion = "/v1/completions"
    cases: list[tuple[str, str, str, bytes | None, dict[str, str]]] = [
        ("garbage bytes", "POST", completion, b"\x00\xffnot json{{", JSON),
        ("invalid UTF-8 JSON", "POST", completion, b'{"prompt": "\xff\xfe", "max_tokens": 2}', JSON),
        ("truncated JSON", "POST", completion, b'{"prompt": "a", "max_tok', JSON),
        ("a JSON array", "POST", completion, b"[1, 2]", JSON),
        ("JSON null", "POST", completion, b"null", JSON),
        ("a JSON string", "POST", completion, b'"hi"', JSON),
        ("50000 nested [", "POST", completion, b"[" * 50_000, JSON),
        ("50000 nested objects", "POST", completion, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, JSON),
        ("text/plain", "POST", completion, json.dumps({"prompt": "a", "max_tokens": 2}).encode(),
         {"Content-Type": "text/plain"}),
        ("form-encoded", "POST", completion, b"prompt=a&max_tokens=2",
         {"Content-Type": "application/x-www-form-urlencoded"}),
        ("no body", "POST", completion, None, JSON),
        ("max_tokens 'abc'", "POST", completion, json.dumps({"prompt": "a", "max_tokens": "abc"}).encode(), JSON),
        ("max_tokens -1", "POST", completion, json.dumps({"prompt": "a", "max_tokens": -1}).encode(), JSON),
        ("max_tokens 1e9", "POST", completion, json.dumps({"prompt": "a", "max_tokens": 1_000_000_000}).encode(),
         JSON),
        ("max_tokens 1e400", "POST", completion, b'{"prompt": "a", "max_tokens": 1e400}', JSON),
        ("max_tokens NaN", "POST", completion, b'{"prompt": "a", "max_tokens": NaN}', JSON),
        ("prompt 5", "POST", completion, json.dumps({"prompt": 5, "max_tokens": 2}).encode(), JSON),
        ("prompt of out-of-vocabulary ids", "POST", completion,
         json.dumps({"prompt": [2**40, -3], "max_tokens": 2}).encode(), JSON),
        ("temperature 'hot'", "POST", completion,
         json.dumps({"prompt": "a", "max_tokens": 2, "temperature": "hot"}).encode(), JSON),
        ("n 1000", "POST", completion, json.dumps({"prompt": "a", "max_tokens": 2, "n": 1000}).encode(), JSON),
        ("stop of 100000 strings", "POST", completion,
         json.dumps({"prompt": "a", "max_tokens": 2, "stop": ["x"] * 100_000}).encode(), JSON),
        ("logprobs 1e6", "POST", completion,
         json.dumps({"prompt": "a", "max_tokens": 2, "logprobs": 1_000_000}).encode(), JSON),
        ("messages not a list", "POST", "/v1/chat/completions",
         json.dumps({"messages": "hi", "max_tokens": 2}).encode(), JSON),
        ("a message whose content is 42", "POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": 42}], "max_tokens": 2}).encode(), JSON),
        ("a message of role 42", "POST", "/v1/chat/completions",
         json.dumps({"messages": [{"role": 42, "content": "hi"}], "max_tokens": 2}).encode(), JSON),
        ("an unknown model", "POST", completion,
         json.dumps({"model": "no-such-model", "prompt": "a", "max_tokens": 2}).encode(), JSON),
        ("GET on a POST endpoint", "GET", completion, None, {}),
        ("an unknown path", "POST", "/v1/nothing-here", b"{}", JSON),
    ]
    for what, method, path, body, headers in cases:
        status, reply = _http(cluster, method, path, body, headers)
        assert 400 <= status < 500, f"HTTP {what}: {status} {reply[:300]!r}"
    host = cluster.http_url.removeprefix("http://").split("/")[0]
    body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
    raw_cases = [
        ("a 64 KB header", b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nX-Big: "
         + b"a" * 65536 + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
         + b"\r\n\r\n" + body),
        ("1000 headers", b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
         + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"Content-Type: application/json\r\nContent-Length: "
         + str(len(body)).encode() + b"\r\n\r\n" + body),
        ("a Content-Length past the body", b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode()
         + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + body),
        ("a negative Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode()
         + b"\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n" + body),
        ("a garbage request line", b"\x16\x03\x01\x02\x00 NOT HTTP\r\n\r\n"),
    ]
    for what, raw in raw_cases:
        status = _raw_http(cluster, raw)
        print(f"HTTP {what}: {status}")
        assert status is not None and 400 <= status < 500, f"HTTP {what}: {status}"
    assert_clean_and_same(cluster, reference)
