"""The manifests are run (K2, K4): the 1p3d overlay's spec, with a tiny model and one core per node set
through the spec's own knobs, is rendered; each pod's container (command, args, environment from its
ConfigMap and the downward API) runs as a local process; a small local kubelet probes it as the
manifests say (gRPC health on the named service and port, within the startup budget) and, once
ready, publishes it in its Services' records, which the router and the decode nodes resolve through
the resolver seam (PDSERVE_RESOLVER_FILE: the headless Services' DNS records). Then a gRPC and an
HTTP request go through the router Service, and decode pods are replaced by one at a new address:
discovery picks it up without restarting anyone. The tp2 overlay's prefill node is a LeaderWorkerSet
group: its leader pod (the labels and LWS_* variables the LWS controller gives it, k8s_pods) runs as
one process, rank 0, which starts rank 1 as its own child process sharing its /dev/shm; the prefill
Service selects it as the group's leader, and it serves a TP 1 decode node over the fabric.

What differs from a cluster, and only this: each pod gets its own loopback address (127.0.0.N) and
binds there instead of 0.0.0.0 (pods have their own network namespace; these processes share one);
the RDMA provider becomes tcp;ofi_rxm (no RDMA NIC here; the same code path, D9); the container's
mount paths (model cache, /tmp) are folders of the test; probes are polled faster than their
period, within the same total budget.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from k8s_pods import invocation, lws_env, lws_leader_labels, lws_leader_name
from support import prometheus
from support.paths import ROOT, child_env
from support.tiny_models import make_tiny_checkpoint
from support.wait import wait_until

from pdserve.engine.sampling_params import SamplingParams
from pdserve.serving.discovery import RESOLVER_FILE_ENV
from pdserve.tools import deploy
from pdserve.tools.client import Client, ClientError

BOUND_S = 120.0            # any one pod's start, within its startup budget
LOOPBACK_BASE = 20         # pods get 127.0.0.20, 127.0.0.21, ...


@dataclass
class Pod:
    name: str
    role: str
    ip: str
    template: dict[str, Any]
    workdir: Path
    labels: dict[str, str] = field(default_factory=dict)     # the pod's: its template's and its controller's
    injected: dict[str, str] = field(default_factory=dict)   # env its controller's webhook adds (LWS_*)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    ready: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def container(self) -> dict[str, Any]:
        return self.template["spec"]["containers"][0]

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log and self.log.exists() else ""


class LocalKubelet:
    """Runs pod templates as processes and keeps the Services' records (the resolver file) up to date."""

    def __init__(self, objects: list[dict[str, Any]], root: Path) -> None:
        self.objects = objects
        self.root = root
        self.records_file = root / "records.json"
        self.services = [o for o in objects if o["kind"] == "Service"]
        self.pods: list[Pod] = []
        self._next_ip = LOOPBACK_BASE
        self._publish()

    def new_pod(self, workload: dict[str, Any], index: int) -> Pod:
        """Pod `index` of a Deployment, or the leader pod of group `index` of a LeaderWorkerSet."""
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        template = dict(deploy.leader_template(workload))
        if workload["kind"] == "LeaderWorkerSet":
            name, labels, injected = (lws_leader_name(workload, index), lws_leader_labels(workload, index),
                                      lws_env(workload, index))
        else:
            name, labels, injected = f"{workload['metadata']['name']}-{index}", dict(template["metadata"]["labels"]), {}
        pod = Pod(name, labels[deploy.LABEL_ROLE], ip, template, self.root / name, labels=labels, injected=injected)
        self.pods.append(pod)
        return pod

    def start(self, pod: Pod) -> None:
        inv = invocation(pod.container, self.objects, {"metadata.name": pod.name, "status.podIP": pod.ip},
                         pod.injected)
        mounts = {m["mountPath"]: m["name"] for m in pod.container.get("volumeMounts", ())}

        def local_path(value: str) -> str:
            for path, volume in mounts.items():
                if volume != "dshm" and (value == path or value.startswith(path + "/")):
                    return str(pod.workdir / volume) + value[len(path):]
            return value

        for volume in mounts.values():
            (pod.workdir / volume).mkdir(parents=True, exist_ok=True)
        args = [a.replace("--host=0.0.0.0", f"--host={pod.ip}").replace("--provider=verbs;ofi_rxm",
                                                                         "--provider=tcp;ofi_rxm")
                for a in inv.args]
        env = {k: local_path(v) for k, v in inv.env.items()}
        if env.get("FI_PROVIDER") == "verbs;ofi_rxm":
            env["FI_PROVIDER"] = "tcp;ofi_rxm"
        pod.log = pod.workdir / "log.txt"
        with open(pod.log, "w") as log:
            pod.proc = subprocess.Popen([sys.executable, "-m", inv.module, *args], cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT,
                                        env=child_env(**env, **{RESOLVER_FILE_ENV: str(self.records_file)}))

    def check(self, pod: Pod, probe: str) -> bool:
        spec = pod.container[probe]["grpc"]
        timeout = pod.container[probe]["timeoutSeconds"]
        with grpc.insecure_channel(f"{pod.ip}:{spec['port']}") as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=spec["service"]),
                                                             timeout=timeout)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_started(self, pod: Pod) -> None:
        """startupProbe within its budget (failureThreshold x periodSeconds)."""
        startup = pod.container["startupProbe"]
        budget = min(startup["failureThreshold"] * startup["periodSeconds"], BOUND_S)

        def started() -> bool:
            assert pod.proc is not None
            if pod.proc.poll() is not None:
                raise AssertionError(f"{pod.name} exited {pod.proc.returncode}:\n{pod.tail()}")
            return self.check(pod, "startupProbe")

        try:
            wait_until(started, budget, f"{pod.name}'s startupProbe", interval=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{pod.name} log:\n{pod.tail()}") from None

    def wait_ready(self, pod: Pod) -> None:
        """readinessProbe (once started); then the pod joins its Services' records."""
        try:
            wait_until(lambda: self.check(pod, "readinessProbe"), 30, f"{pod.name}'s readinessProbe", interval=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{pod.name} log:\n{pod.tail()}") from None
        assert self.check(pod, "livenessProbe"), f"{pod.name}: livenessProbe fails while ready"
        pod.ready = True
        self._publish()

    def wait_started_and_ready(self, pod: Pod) -> None:
        self.wait_started(pod)
        self.wait_ready(pod)

    def delete(self, *pods: Pod) -> list[int]:
        """As pod deletions: out of the records first, the preStop hooks (together), then SIGTERM,
        SIGKILL after the grace period; the exit codes."""
        for pod in pods:
            pod.ready = False
        self._publish()
        hooks = [subprocess.Popen(hook) for pod in pods
                 if (hook := pod.container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command"))]
        grace = max(pod.template["spec"]["terminationGracePeriodSeconds"] for pod in pods)
        for hook in hooks:
            assert hook.wait(grace) == 0
        codes = []
        for pod in pods:
            assert pod.proc is not None
            pod.proc.send_signal(signal.SIGTERM)
        for pod in pods:
            assert pod.proc is not None
            try:
                codes.append(pod.proc.wait(grace))
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                codes.append(pod.proc.wait(10))
        return codes

    def _publish(self) -> None:
        records: dict[str, list[str]] = {}
        for svc in self.services:
            host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
            selector = svc["spec"]["selector"]
            port = svc["spec"]["ports"][0]["port"]
            records[host] = sorted(f"{p.ip}:{port}" for p in self.pods
                                   if p.ready and selector.items() <= p.labels.items())
        tmp = self.records_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(self.records_file)   # readers never see half a file

    def records(self, role: str) -> list[str]:
        return json.loads(self.records_file.read_text())[f"pdserve-{role}.pdserve.svc.cluster.local"]

    def stop_all(self) -> None:
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.send_signal(signal.SIGTERM)
        for pod in self.pods:
            if pod.proc is not None:
                try:
                    pod.proc.wait(20)
                except subprocess.TimeoutExpired:
                    pod.proc.kill()
                    pod.proc.wait(10)


def _replace_decode_pods(kubelet: LocalKubelet, pods: list[Pod], workload: dict[str, Any], url: str,
                         params: SamplingParams) -> None:
    # a decode pod replaced by one at a new address (started first, as a rolling update's surge
    # pod, loading while the old one drains), then the other two deleted: only the new one is
    # left, and requests still get through, so the router found it without a restart
    old = [p for p in pods if p.role == "decode"]
    new = kubelet.new_pod(workload, 3)
    kubelet.start(new)
    assert kubelet.delete(old[0]) == [0]
    kubelet.wait_started_and_ready(new)
    assert kubelet.delete(*old[1:]) == [0, 0]
    assert kubelet.records("decode") == [f"{new.ip}:{deploy.DECODE_PORT}"]
    with Client(url, timeout=60) as client:
        out = wait_until(lambda: _complete(client, "Hello again", params), 30,
                         "a completion once only the new decode pod is left", interval=0.5,
                         retry_on=(ClientError,))
        assert len(out.token_ids) == 4
    metrics = f"http://{new.ip}:{new.port('metrics')}/metrics"
    served = prometheus.total(prometheus.parse(prometheus.fetch(metrics)[0]), "pdserve:request_success_total")
    assert served >= 1, "the new decode pod served the request"


def _check_leader_holds_its_ranks(leader: Pod, tp: int) -> None:
    """The group's leader pod is rank 0: ranks 1..tp-1 are its child processes (in its pod, on its
    /dev/shm), and its metrics place one KV shard per rank."""
    assert leader.proc is not None and leader.labels[deploy.LWS_WORKER_INDEX] == "0"
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):   # a process that exited meanwhile
            continue
        if int(fields[1]) == leader.proc.pid and b"pdserve.parallel.worker" in cmdline:
            children.append(stat.parent.name)
    assert len(children) == tp - 1, f"{leader.name}: rank processes {children}, want {tp - 1}"
    metrics = prometheus.parse(prometheus.fetch(f"http://{leader.ip}:{leader.port('metrics')}/metrics")[0])
    ranks = sorted(dict(labels)["rank"] for (name, labels) in metrics if name == "pdserve:kv_shard_placement_info")
    assert ranks == [str(r) for r in range(tp)], f"{leader.name}: KV shard placements of ranks {ranks}"


def _complete(client: Client, prompt: str, params: SamplingParams):
    """One completion; an error that no retry can cure fails at once (a refused KV layout)."""
    try:
        return client.complete(prompt, params)
    except ClientError as e:
        if "KV layouts differ" in str(e):
            raise AssertionError(f"the nodes refuse each other: {e}") from e
        raise


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.mark.parametrize("overlay", ["1p3d", "tp2"])
def test_the_manifests_run_serve_and_follow_pods_that_move(overlay, tmp_path, tiny_llama):
    """1p3d: serve, then replace the decode pods; tp2: a prefill LeaderWorkerSet group, one leader pod
    holding 2 ranks, serves a decode node (TP 2 -> TP 1 over the fabric)."""
    base = deploy.OVERLAYS[overlay]
    small = {"cpu": "1", "memory": "2Gi"}
    spec = dataclasses.replace(
        base, model=str(tiny_llama), router_replicas=1,
        prefill=dataclasses.replace(base.prefill, engine=base.prefill.engine + (("num-blocks", "64"),), **small),
        decode=dataclasses.replace(base.decode, engine=base.decode.engine + (("num-blocks", "64"),), **small))
    objects = deploy.render(spec)
    ratio = {"1p3d": 3, "tp2": 1}[overlay]
    kubelet = LocalKubelet(objects, tmp_path)
    workloads = {o["metadata"]["labels"][deploy.LABEL_ROLE]: o for o in objects
                 if o["kind"] in ("Deployment", "LeaderWorkerSet")}
    assert [workloads[r]["spec"]["replicas"] for r in ("prefill", "decode", "router")] == [1, ratio, 1]
    assert workloads["prefill"]["kind"] == {"1p3d": "Deployment", "tp2": "LeaderWorkerSet"}[overlay]
    try:
        pods = [kubelet.new_pod(w, i) for w in workloads.values() for i in range(w["spec"]["replicas"])]
        # Every pod starts at once (the model loads overlap), but the prefill pods join their
        # Service's records last: started decode nodes are not ready without them (GenerateService
        # NOT_SERVING, so not in the decode records) nor is the router without a decode node; once
        # the prefill pods are ready, the decode nodes find them through discovery and become ready.
        first = sorted((p for p in pods if p.role != "prefill"), key=lambda p: p.role == "router")
        last = [p for p in pods if p.role == "prefill"]
        for pod in pods:
            kubelet.start(pod)
        for pod in first:
            kubelet.wait_started(pod)
        assert not [p.name for p in first if kubelet.check(p, "readinessProbe")], "ready with no prefill node"
        assert kubelet.records("prefill") == [] and kubelet.records("decode") == []
        for pod in last:
            kubelet.wait_started_and_ready(pod)
        for pod in first:   # decode pods, then the router
            kubelet.wait_ready(pod)
        assert len(kubelet.records("decode")) == ratio and len(kubelet.records("prefill")) == 1
        if overlay == "tp2":
            _check_leader_holds_its_ranks(next(p for p in pods if p.role == "prefill"), spec.prefill.tp)
        (router,) = [p for p in pods if p.role == "router"]
        url = f"{router.ip}:{router.port('grpc')}"
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        with Client(url, timeout=60) as client:
            # the decode nodes resolve the prefill Service and the router the decode Service
            # each poll round: the first request may find a node not yet polled
            out = wait_until(lambda: _complete(client, "The capital of France is", params), 30,
                             "a gRPC completion through the router", interval=0.5, retry_on=(ClientError,))
            assert len(out.token_ids) == 4
        http = f"http://{router.ip}:{router.port('http')}"
        with urllib.request.urlopen(f"{http}/v1/models", timeout=30) as r:
            (model,) = [m["id"] for m in json.loads(r.read())["data"]]
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["text"]

        if overlay == "1p3d":
            _replace_decode_pods(kubelet, pods, workloads["decode"], url, params)
        assert router.proc is not None and router.proc.poll() is None, "the router was never restarted"
    finally:
        kubelet.stop_all()
    for pod in kubelet.pods:
        assert pod.proc is not None and pod.proc.returncode == 0, f"{pod.name} exited {pod.proc.returncode}"
