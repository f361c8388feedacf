"""The wire contract: stubs current, every RPC and field commented, standard services, status mapping."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from support.paths import PROTO_DIR, ROOT

try:  # installed (package-dir mapping in pyproject) or not yet: both work
    import pdserve_api  # noqa: F401
except ImportError:
    sys.path.insert(0, str(PROTO_DIR))

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pdserve_api.servers import (
    AioExceptionToStatusInterceptor,
    ExceptionToStatusInterceptor,
    StatusError,
    UnavailableError,
    add_standard_services,
    add_standard_services_aio,
    status_details,
    status_for,
)
from pdserve_api.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

PROTO_FILES = sorted((PROTO_DIR / "pdserve_api").rglob("*.proto"))
MODULES = {"common": common_pb2, "generate": generate_pb2, "node": node_pb2, "prefill": prefill_pb2}
GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
NODE_SERVICE = node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name


# ---- stubs and comments ------------------------------------------------------------------------


def test_stubs_do_not_shadow_pdserve():
    import pdserve

    assert Path(pdserve.__file__).resolve().parent == ROOT / "pdserve"
    assert generate_pb2.DESCRIPTOR.package == "pdserve.api.v1"
    assert sorted(p.stem for p in PROTO_FILES) == sorted(MODULES)


def test_generated_stubs_are_current():
    run = subprocess.run(
        [sys.executable, str(PROTO_DIR / "generate.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_check_reports_stale_and_missing_stubs(tmp_path):
    copy = tmp_path / "proto"
    shutil.copytree(PROTO_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    v1 = copy / "pdserve_api" / "v1"
    with open(v1 / "prefill_pb2.py", "a") as f:
        f.write("# edited by hand\n")
    (v1 / "node_pb2.pyi").unlink()
    run = subprocess.run(
        [sys.executable, str(copy / "generate.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1
    assert "pdserve_api/v1/prefill_pb2.py (differs)" in run.stderr
    assert "pdserve_api/v1/node_pb2.pyi (missing)" in run.stderr
    assert "generate_pb2.py" not in run.stderr


_DECLARATION = re.compile(r"^(message|enum|service|oneof)\s+(\w+)\s*\{")
_RPC = re.compile(r"^rpc\s+(\w+)\s*\(")
_FIELD = re.compile(r"^(?:(?:optional|repeated)\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*\d+\s*[;\[]")
_ENUM_VALUE = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=\s*-?\d+\s*[;\[]")


def _declarations(text: str) -> list[tuple[str, str, int, bool]]:
    """(kind, name, line number, commented) for every declaration, RPC, field and enum value."""
    found = []
    previous = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        for kind, pattern in (("decl", _DECLARATION), ("rpc", _RPC), ("field", _FIELD), ("value", _ENUM_VALUE)):
            m = pattern.match(line)
            if m:
                name = m.group(m.lastindex)
                found.append((m.group(1) if kind == "decl" else kind, name, number, previous.startswith("//")))
                break
        previous = line
    return found


@pytest.mark.parametrize("path", PROTO_FILES, ids=lambda p: p.name)
def test_every_rpc_and_field_has_a_comment(path):
    found = _declarations(path.read_text())
    missing = [f"{path.name}:{n} {kind} {name}" for kind, name, n, commented in found if not commented]
    assert not missing, "uncommented (put a // line right above):\n" + "\n".join(missing)

    # The text parse saw exactly what protoc compiled: nothing slipped past the patterns.
    file = MODULES[path.stem].DESCRIPTOR

    def fields(messages):
        for m in messages:
            yield from (f.name for f in m.fields)
            yield from fields(m.nested_types)

    parsed = lambda kind: sorted(name for k, name, _, _ in found if k == kind)  # noqa: E731
    assert parsed("field") == sorted(fields(file.message_types_by_name.values()))
    assert parsed("rpc") == sorted(m.name for s in file.services_by_name.values() for m in s.methods)
    assert parsed("value") == sorted(v.name for e in file.enum_types_by_name.values() for v in e.values)
    assert parsed("message") == sorted(file.message_types_by_name)
    assert parsed("service") == sorted(file.services_by_name)


# ---- messages ----------------------------------------------------------------------------------


def _full_prefill_request() -> prefill_pb2.PrefillRequest:
    layout = prefill_pb2.KvLayout(
        num_layers=30, num_pages=4096, kv_heads=2, page_size=16, head_dim=64, dtype="bfloat16",
        element_size=2, base_offset=4096, layer_stride=2 * 4096 * 4096, kv_stride=4096 * 4096,
        page_stride=4096, head_stride=2048, token_stride=128,
    )
    return prefill_pb2.PrefillRequest(
        request_id="req-7",
        token_ids=[1, 15043, 29892, 2 ** 32 - 1],
        peer=prefill_pb2.FabricPeer(provider="tcp;ofi_rxm", descriptor=b"\x00peer\xff"),
        kv_memory=[
            prefill_pb2.KvMemory(tp_rank=0, descriptor=b"region-0", layout=layout),
            prefill_pb2.KvMemory(tp_rank=1, descriptor=b"region-1", layout=layout),
        ],
        page_ids=[7, 3, 4095],
        context=prefill_pb2.ContextSlot(descriptor=b"ctx", offset=65536, capacity=8192, logits_top_k=20),
        sharding=common_pb2.ShardingScheme(tp_size=2, kv_heads_per_rank=2, total_kv_heads=4),
        imm_tag=0xFFFFFFFF,
        expected_writes=360,
        cached_tokens=16,
        model="smollm2-135m",
        deadline_s=2.5,
        decode_node_id="decode-3",
        attempt=2,
        kv_checksum=True,
        group_pages=[prefill_pb2.GroupPages(name="sliding", layers=[0, 2, 3], sliding_window=512, first_page=1,
                                            page_ids=[9, 10])],
    )


def test_prefill_request_round_trip_with_every_field():
    request = _full_prefill_request()
    # Every field is set, so a field added later must be added here too.
    assert len(request.ListFields()) == len(prefill_pb2.PrefillRequest.DESCRIPTOR.fields)
    for message in (request.peer, request.context, request.sharding, request.kv_memory[0].layout,
                    request.group_pages[0]):
        assert len(message.ListFields()) == len(message.DESCRIPTOR.fields), message.DESCRIPTOR.name
    wire = request.SerializeToString(deterministic=True)
    back = prefill_pb2.PrefillRequest.FromString(wire)
    assert back == request
    assert back.imm_tag == 0xFFFFFFFF and back.token_ids[-1] == 2 ** 32 - 1
    assert back.kv_memory[1].layout.token_stride == 128 and back.HasField("deadline_s")
    assert back.SerializeToString(deterministic=True) == wire


def test_unset_differs_from_zero_where_it_matters():
    unset = generate_pb2.SamplingOptions()
    greedy = generate_pb2.SamplingOptions(temperature=0.0, logprobs=0, skip_special_tokens=False, seed=0)
    back = generate_pb2.SamplingOptions.FromString(greedy.SerializeToString())
    for name in ("temperature", "top_p", "seed", "max_tokens", "logprobs", "skip_special_tokens"):
        assert not unset.HasField(name)
    for name in ("temperature", "logprobs", "skip_special_tokens", "seed"):
        assert back.HasField(name), name
    assert not prefill_pb2.PrefillRequest().HasField("deadline_s")
    assert not prefill_pb2.PrefillRequest().HasField("context")


def test_prompt_is_one_of_text_ids_messages():
    r = generate_pb2.GenerateRequest(text="hi")
    r.token_ids.ids.extend([1, 2])
    assert r.WhichOneof("prompt") == "token_ids" and not r.HasField("text")
    r.messages.messages.add(role="user", content="hello")
    assert r.WhichOneof("prompt") == "messages"


# ---- status mapping ----------------------------------------------------------------------------


class _Busy(StatusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "exc, code",
    [
        (ValueError("temperature must be >= 0"), grpc.StatusCode.INVALID_ARGUMENT),
        (KeyError("req-1"), grpc.StatusCode.NOT_FOUND),
        (LookupError("unknown model 'x'"), grpc.StatusCode.NOT_FOUND),
        (IndexError("list index out of range"), grpc.StatusCode.INTERNAL),
        (TimeoutError("kv wait"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (asyncio.TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
        (UnavailableError("no prefill node"), grpc.StatusCode.UNAVAILABLE),
        (ConnectionRefusedError("refused"), grpc.StatusCode.UNAVAILABLE),
        (_Busy("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NotImplementedError("n-gram"), grpc.StatusCode.UNIMPLEMENTED),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_for(exc, code):
    assert status_for(exc) == code


def test_status_details():
    assert status_details(KeyError("req-1")) == "req-1"
    assert status_details(ValueError("bad top_p")) == "bad top_p"
    assert status_details(RuntimeError("boom")) == "RuntimeError: boom"


# ---- a real server -----------------------------------------------------------------------------


class _Generate(generate_pb2_grpc.GenerateServiceServicer):
    def Generate(self, request, context):
        if request.WhichOneof("prompt") is None:
            raise ValueError("a prompt is required: text, token_ids or messages")
        yield generate_pb2.GenerateResponse(request_id="srv-1", token_ids=[5, 6], text="He")
        if request.sampling.max_tokens == 1:
            raise RuntimeError("engine died")
        yield generate_pb2.GenerateResponse(
            request_id="srv-1", token_ids=[7], text="llo",
            finish_reason=generate_pb2.FINISH_REASON_LENGTH,
            usage=generate_pb2.Usage(prompt_tokens=3, completion_tokens=3),
        )

    def Abort(self, request, context):
        raise KeyError(f"unknown request {request.request_id}")

    def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelInfo(id="m", max_context_length=2048)])


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    def Prefill(self, request, context):
        raise UnavailableError(f"cannot reach {request.peer.provider} peer")

    def AbortPrefill(self, request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "its own status")


@pytest.fixture
def server_address():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[ExceptionToStatusInterceptor()])
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(_Generate(), server)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(), server)
    health_servicer = add_standard_services(server, [GENERATE_SERVICE, PREFILL_SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", health_servicer
    finally:
        server.stop(grace=None)


def test_server_health_reflection_and_statuses(server_address):
    address, health_servicer = server_address
    with grpc.insecure_channel(address) as channel:
        health_stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", GENERATE_SERVICE, PREFILL_SERVICE):
            reply = health_stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        health_servicer.set(PREFILL_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        reply = health_stub.Check(health_pb2.HealthCheckRequest(service=PREFILL_SERVICE), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            health_stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # the health service's own status survives

        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {GENERATE_SERVICE, PREFILL_SERVICE, "grpc.health.v1.Health"} <= services
        assert "grpc.reflection.v1alpha.ServerReflection" in services
        assert db.FindFileContainingSymbol(PREFILL_SERVICE).name == "pdserve_api/v1/prefill.proto"

        generate = generate_pb2_grpc.GenerateServiceStub(channel)
        chunks = list(generate.Generate(generate_pb2.GenerateRequest(text="hi"), timeout=5))
        assert [list(c.token_ids) for c in chunks] == [[5, 6], [7]]
        assert "".join(c.text for c in chunks) == "Hello"
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH and chunks[-1].usage.completion_tokens == 3
        assert generate.ListModels(generate_pb2.ListModelsRequest(), timeout=5).models[0].max_context_length == 2048

        def status_of(call):
            with pytest.raises(grpc.RpcError) as err:
                call()
            return err.value.code(), err.value.details()

        assert status_of(lambda: list(generate.Generate(generate_pb2.GenerateRequest(), timeout=5))) == (
            grpc.StatusCode.INVALID_ARGUMENT, "a prompt is required: text, token_ids or messages")
        stream = generate.Generate(
            generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingOptions(max_tokens=1)), timeout=5)
        assert next(stream).text == "He"
        assert status_of(lambda: next(stream)) == (grpc.StatusCode.INTERNAL, "RuntimeError: engine died")
        assert status_of(lambda: generate.Abort(generate_pb2.AbortRequest(request_id="r9"), timeout=5)) == (
            grpc.StatusCode.NOT_FOUND, "unknown request r9")

        prefill = prefill_pb2_grpc.PrefillServiceStub(channel)
        assert status_of(lambda: prefill.Prefill(_full_prefill_request(), timeout=5)) == (
            grpc.StatusCode.UNAVAILABLE, "cannot reach tcp;ofi_rxm peer")
        assert status_of(lambda: prefill.AbortPrefill(prefill_pb2.AbortPrefillRequest(request_id="x"), timeout=5)) == (
            grpc.StatusCode.FAILED_PRECONDITION, "its own status")


class _AioNode(node_pb2_grpc.NodeServiceServicer):
    async def GetNodeInfo(self, request, context):
        raise TimeoutError("load snapshot took too long")


class _AioGenerate(generate_pb2_grpc.GenerateServiceServicer):
    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(request_id="a-1", token_ids=[1], text="x")
        raise ValueError(f"bad sampling: top_p={request.sampling.top_p}")


def test_aio_server_health_and_statuses():
    async def main():
        server = grpc.aio.server(interceptors=[AioExceptionToStatusInterceptor()])
        node_pb2_grpc.add_NodeServiceServicer_to_server(_AioNode(), server)
        generate_pb2_grpc.add_GenerateServiceServicer_to_server(_AioGenerate(), server)
        await add_standard_services_aio(server, [NODE_SERVICE, GENERATE_SERVICE], serving=False)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=NODE_SERVICE), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await node_pb2_grpc.NodeServiceStub(channel).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert err.value.details() == "load snapshot took too long"
                call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(
                    generate_pb2.GenerateRequest(text="x", sampling=generate_pb2.SamplingOptions(top_p=0.0)), timeout=5)
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for chunk in call:
                        got.append(chunk.text)
                assert got == ["x"]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == "bad sampling: top_p=0.0"
        finally:
            await server.stop(None)

    asyncio.run(main())
