"""A decode node whose prefill node cannot be reached (S3; request path point 8): the request
fails with a clear error naming the prefill node within the deadline, and every page is freed.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.net import free_ports
from support.paths import ROOT
from support.wait import wait_until

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client, ClientError
from pdserve_api.v1 import node_pb2, node_pb2_grpc


def _wait_serving(addr: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def serving() -> bool:
            assert proc.poll() is None, f"node exited with {proc.returncode}"
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            return status == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, timeout, f"{addr} to report SERVING", interval=0.3, retry_on=(grpc.RpcError,))


@pytest.fixture(scope="module")
def lonely_decode_node(tmp_path_factory):
    port, dead = free_ports(2)  # distinct; nothing listens on `dead`
    log = tmp_path_factory.mktemp("dn") / "decode.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "decode_node", "--port", str(port), "--prefill", f"127.0.0.1:{dead}",
             "--provider", "shm", "--num-blocks", "64", "--threads", "1", "--prefill-timeout", "5"],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_serving(f"127.0.0.1:{port}", proc)
        yield f"127.0.0.1:{port}", dead
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_unreachable_prefill_node_fails_the_request_and_frees_every_page(lonely_decode_node):
    addr, dead = lonely_decode_node
    t0 = time.monotonic()
    with Client(addr, timeout=30) as client:
        with pytest.raises(ClientError) as err:
            client.complete("The capital of France is " * 8, SamplingParams(temperature=0, max_tokens=8))
    error = str(err.value)
    elapsed = time.monotonic() - t0
    assert f"127.0.0.1:{dead}" in error and "prefill" in error
    assert elapsed < 20, f"the failure took {elapsed:.1f} s"
    with grpc.insecure_channel(addr) as ch:
        info = node_pb2_grpc.NodeServiceStub(ch).GetNodeInfo(node_pb2.GetNodeInfoRequest(), timeout=10)
    assert info.load.free_kv_blocks == info.load.total_kv_blocks
    assert info.load.outstanding_requests == 0
