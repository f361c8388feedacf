"""Version skew and readiness on real processes (issue 19): a decode node with two prefill nodes, one
started with another page size (another KV layout, NodeInfo.build), never sends that one work: its log
names both identities, pdserve:incompatible_peers{peer} is 1 for it, and every request is prefilled
on the compatible node. When that node stops, the decode node reports its GenerateService
NOT_SERVING (the readiness probe's service; "" stays SERVING: the process lives) and a request fails
naming both prefill nodes and why each cannot serve; once it is started again at its address, the
decode node reports SERVING again and serves. Every wait is bounded (wait_until)."""

from __future__ import annotations

import contextlib
import pathlib
import re
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.net import free_ports
from support.paths import ROOT
from support.prometheus import fetch, parse, total
from support.tiny_models import make_tiny_checkpoint
from support.wait import wait_until

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client, ClientError
from pdserve_api.v1 import node_pb2, node_pb2_grpc

GENERATE = "pdserve.api.v1.GenerateService"
COMMON = ("--provider", "shm", "--num-blocks", "64", "--threads", "1")
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
START_S = 120.0
READY_CHANGE_S = 20.0   # watchdog (1 s) + prefill poll (1 s) + reconnect backoff (<= 1 s), with margin


def _health(addr: str, service: str = "") -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def _info(addr: str) -> node_pb2.NodeInfo:
    with grpc.insecure_channel(addr) as ch:
        return node_pb2_grpc.NodeServiceStub(ch).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=5)


class _Procs:
    def __init__(self, logs: pathlib.Path) -> None:
        self.logs, self.procs = logs, {}

    def start(self, name: str, module: str, port: int, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "a") as f:
            p = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *COMMON, *args], cwd=ROOT,
                                 stdout=f, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def wait_serving(self, name: str, addr: str) -> None:
        p = self.procs[name]

        def serving() -> bool:
            assert p.poll() is None, f"{name} exited with {p.returncode}: {self.log(name)[-2000:]}"
            return _health(addr) == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, START_S, f"{name} to report SERVING", interval=0.3, retry_on=(grpc.RpcError,))

    def stop(self, name: str) -> None:
        p = self.procs.pop(name)
        p.terminate()
        p.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def close(self) -> None:
        for name in list(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.stop(name)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    model = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("model") / "tiny-llama")
    good, bad, decode, metrics = free_ports(4)
    procs = _Procs(tmp_path_factory.mktemp("logs"))
    try:
        procs.start("good", "prefill_node", good, "--model", str(model))
        procs.start("bad", "prefill_node", bad, "--model", str(model), "--page-size", "32")
        for name, port in (("good", good), ("bad", bad)):
            procs.wait_serving(name, f"127.0.0.1:{port}")
        procs.start("decode", "decode_node", decode, "--model", str(model), "--metrics-port", str(metrics),
                    "--prefill", f"127.0.0.1:{good},127.0.0.1:{bad}")
        procs.wait_serving("decode", f"127.0.0.1:{decode}")
        yield procs, model, {"good": f"127.0.0.1:{good}", "bad": f"127.0.0.1:{bad}",
                             "decode": f"127.0.0.1:{decode}"}, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        procs.close()


def test_nodes_report_their_build_identity(nodes):
    _, _, addr, _ = nodes
    builds = {name: _info(a).build for name, a in addr.items()}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    for name, b in builds.items():
        assert b.model == "tiny-llama" and b.version and len(b.kv_layout_hash) == 16, (name, b)
        if head.returncode == 0:
            assert b.commit == head.stdout.strip(), name
    assert builds["decode"].kv_layout_hash == builds["good"].kv_layout_hash != builds["bad"].kv_layout_hash
    assert "page=16" in builds["decode"].kv_layout and "page=32" in builds["bad"].kv_layout
    assert builds["decode"].model_config_hash == builds["bad"].model_config_hash   # the same model, another layout


def test_the_decode_node_skips_the_prefill_node_of_another_kv_layout(nodes):
    procs, _, addr, metrics = nodes
    log = procs.log("decode")
    skipped = [line for line in log.splitlines() if f"prefill node {addr['bad']}" in line and "skipped" in line]
    assert len(skipped) == 1, log[-3000:]
    assert "KV layout differ" in skipped[0] and "page=32" in skipped[0] and "page=16" in skipped[0]
    assert not re.search(rf"prefill node {re.escape(addr['good'])} .*skipped", log)
    samples = parse(fetch(metrics)[0])
    assert total(samples, "pdserve:incompatible_peers", peer=addr["bad"]) == 1
    assert total(samples, "pdserve:incompatible_peers", peer=addr["good"]) == 0
    with Client(addr["decode"], timeout=60) as client:
        for i in range(4):
            out = client.complete(f"Prompt number {i}: the quick brown fox " * 4, GREEDY)
            assert len(out.token_ids) == 4 and out.timings is not None
            assert out.timings.prefill_node == addr["good"], out.timings
    assert _info(addr["bad"]).load.outstanding_requests == 0


def test_readiness_follows_the_only_compatible_prefill_node(nodes):
    procs, model, addr, _ = nodes
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(addr["decode"], GENERATE) == serving
    procs.stop("good")
    wait_until(lambda: _health(addr["decode"], GENERATE) == not_serving, READY_CHANGE_S,
               "the decode node to report GenerateService NOT_SERVING", interval=0.2)
    assert _health(addr["decode"]) == serving   # liveness: the process is alive
    assert "not ready" in procs.log("decode") and "no prefill node is reachable" in procs.log("decode")
    with Client(addr["decode"], timeout=60) as client:
        with pytest.raises(ClientError) as err:
            client.complete("The capital of France is", GREEDY)
    assert f"{addr['good']} (down:" in str(err.value) and f"{addr['bad']} (incompatible: KV layout" in str(err.value)
    procs.start("good", "prefill_node", int(addr["good"].rsplit(":", 1)[1]), "--model", str(model))
    procs.wait_serving("good", addr["good"])
    wait_until(lambda: _health(addr["decode"], GENERATE) == serving, READY_CHANGE_S,
               "the decode node to report GenerateService SERVING again", interval=0.2)
    assert "ready again" in procs.log("decode")
    with Client(addr["decode"], timeout=60) as client:
        out = client.complete("The capital of France is", GREEDY)
    assert len(out.token_ids) == 4 and out.timings.prefill_node == addr["good"]
