"""`pdserve deploy`: the Kubernetes manifests of a cluster, rendered from one typed spec (K2, K4).

    pdserve deploy render --prefill 1 --decode 3 [--prefill-tp 2] [--provider efa --efa-devices 1] ...
                                           # every object of one namespace, as multi-document YAML
    pdserve deploy render --overlay 1p3d   # the spec of a checked-in overlay
    pdserve deploy tree [--root deploy/k8s] [--check]
                                           # (re)write the kustomize base and overlays; --check: exit 1
                                           # naming the files that differ (the drift test runs it)

One `DeploySpec` (two `RoleSpec`s, prefill and decode) is rendered by `render(spec)` into plain
dicts: the router Deployment and Service (gRPC 50051, HTTP 8000), one workload per role, a
headless Service per role (the router resolves the decode Service's records, decode nodes the
prefill Service's: `--decode dns:NAME:PORT`, `--prefill dns:NAME:PORT`, see
pdserve.serving.discovery), a ConfigMap of engine flags (each container arg `--flag=$(VAR)` reads
one key), PodDisruptionBudgets, a ServiceMonitor, autoscaling per role on queue depth (KEDA
ScaledObjects, or HPAs on external metrics), and NetworkPolicies (only the router reaches decode
nodes, only decode nodes reach prefill nodes; the fabric's TCP port range between the two roles).

A role's workload is a Deployment at TP 1. A tensor-parallel node (TP N > 1) is a LeaderWorkerSet
whose groups have size 1: each TP group is one leader pod, rank 0, which starts ranks 1..N-1 as
local processes in its own container (pdserve.parallel.group) and asks for N ranks' CPU, memory and
GPUs. The decision, and why: pdserve's ranks share their KV pools through shared memory that rank
0's messenger maps and drives (D15: one messenger per node drives every shard's memory; /dev/shm
segments, cuMem IPC handles on GPU), so every rank of a group must be a process on one host, in one
pod's /dev/shm: a group of one pod per rank cannot run, and is not rendered. Size 1 still gives the
group LWS semantics: group-wise rolling updates (maxSurge 1, maxUnavailable 0, like the
Deployments), RecreateGroupOnPodRestart (a restarted container gets a new pod with a new /dev/shm: a
Memory emptyDir outlives a container restart, and pool files a leader killed while starting left
there would stay, counted against the pod's memory, since the next leader sweeps only files of pids
that no longer run and is PID 1 again in its container), the leaderworkerset.sigs.k8s.io labels (the
role's Service and PDB select worker-index 0, the leader), and the LWS scale subresource for the
autoscalers. The LWS API takes a size-1 group with `workerTemplate` only (the field the CRD
requires; the leader is made from it when `leaderTemplate` is absent, and the workers' StatefulSet
has 0 replicas). Not set, as they mean nothing at size 1: `startupPolicy` (when workers start) and
the exclusive-topology annotation (a one-pod group's placement is its pod's anti-affinity, already
in the template: preferred, required under EFA). `tp_workload="deployment"` renders the same pod
template as a Deployment instead, for clusters without the LWS controller.

`tree()` writes `base/` (the spec of `BASE`) and one folder per `OVERLAYS` entry whose
kustomization takes the base and JSON patches (RFC 6902) computed from the two renderings, so
`kubectl kustomize deploy/k8s/overlays/NAME` gives exactly `render(OVERLAYS[NAME])`.

Probes are the kubelet's native gRPC probes on grpc.health.v1 (exec probes through
pdserve.tools.probe under mTLS, which the kubelet's gRPC probe cannot speak): startup and readiness on the
role's serving service (a node answers NOT_SERVING while its model loads and while it drains;
the router's GenerateService entry is SERVING only while a decode node is healthy), liveness on
the whole server (""). terminationGracePeriodSeconds covers a node's drain: the gRPC server's
stop grace plus the fabric's close bound plus a margin (`drain_seconds`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fabric.config import FabricConfig
from pdserve.serving.node_server import DECODE_PORT, PREFILL_PORT, STOP_GRACE_S

ROUTER_PORT = 50051          # router gRPC (router/__main__.py default)
ROUTER_HTTP_PORT = 8000      # router OpenAI-compatible HTTP and its /metrics (pdserve up's default)
NODE_METRICS_PORT = 9100     # a node's --metrics-port in the pods
ROLES = ("prefill", "decode")
ROLE_PORTS = {"prefill": PREFILL_PORT, "decode": DECODE_PORT}
ROLE_MODULES = {"prefill": "prefill_node", "decode": "decode_node", "router": "router"}
# The service each role's readiness probe asks for (what the role serves to its callers).
READINESS_SERVICES = {"prefill": "pdserve.api.v1.PrefillService", "decode": "pdserve.api.v1.GenerateService",
                      "router": "pdserve.api.v1.GenerateService"}
PROVIDERS = ("verbs;ofi_rxm", "tcp;ofi_rxm", "efa")
AUTOSCALERS = ("keda", "hpa", "none")
TP_WORKLOADS = ("lws", "deployment")   # how a TP > 1 node is deployed (the module docstring)
PYTHON = "python"            # the image's venv python is first on PATH (deploy/Containerfile)
MODEL_CACHE = "/var/cache/pdserve"   # PDSERVE_CACHE_DIR in the pods: the converted model lives here
TLS_DIR = "/etc/pdserve/tls"         # the TLS Secret: tls.crt, tls.key, ca.crt (kubernetes.io/tls + ca.crt)
TOKEN_DIR = "/etc/pdserve/token"     # the token Secret: key `token`
LWS_API = "leaderworkerset.x-k8s.io/v1"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_ROLE = "app.kubernetes.io/component"   # prefill, decode or router
LABEL_PART = "app.kubernetes.io/part-of"
# Labels the LWS controller puts on its pods (leaderworkerset.sigs.k8s.io/v1 API constants).
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"   # "0": the leader
HEADER = "# Rendered by `pdserve deploy tree` from pdserve/tools/deploy.py: edit the spec there, not this file.\n"


# A deleted pod leaves its Service's DNS records at once, but SIGTERM would make it refuse new work
# before every caller has resolved again (each poll round, 1 s; CoreDNS answers with a 5 s TTL): the
# preStop hook keeps it serving this long first, so callers drop it before it drains.
PRESTOP_S = 5


def drain_seconds() -> int:
    """What a pod's termination may take: the preStop wait, then the node's SIGTERM path
    (node_server: health NOT_SERVING, drain, server stop with STOP_GRACE_S, node close: engine stop
    and the fabric's close bound), rounded up, plus a margin."""
    return PRESTOP_S + int(math.ceil(STOP_GRACE_S + FabricConfig().close_timeout_s)) + 20


def _pre_stop() -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}}


@dataclass(frozen=True)
class RoleSpec:
    """One role's pods. replicas: node count (TP groups when tp > 1); tp: ranks per node (one pod
    holding every rank and asking for `tp` ranks' resources; a LeaderWorkerSet group when tp > 1,
    DeploySpec.tp_workload); cpu / memory: per rank (requests = limits, so
    the pods are Guaranteed and can pin cores); gpus: nvidia.com/gpu per rank; max_replicas: the
    autoscaler's ceiling; queue_target: waiting requests per replica the autoscaler aims at;
    engine: engine flags of this role (flag without dashes -> value), through the ConfigMap."""

    replicas: int = 1
    tp: int = 1
    cpu: str = "4"
    memory: str = "16Gi"
    gpus: int = 0
    max_replicas: int = 0      # 0: 4 x replicas
    queue_target: int = 4
    engine: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {self.gpus}")
        if self.max_replicas and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below replicas {self.replicas}")
        if self.queue_target < 1:
            raise ValueError(f"queue_target must be >= 1, got {self.queue_target}")
        for flag, _value in self.engine:
            if flag.startswith("-") or not flag:
                raise ValueError(f"engine flags are named without dashes (num-blocks), got {flag!r}")

    @property
    def ceiling(self) -> int:
        return self.max_replicas or 4 * self.replicas


@dataclass(frozen=True)
class DeploySpec:
    """A whole namespace. provider: the libfabric provider of both roles ("verbs;ofi_rxm" on RoCE /
    InfiniBand, "efa" on AWS, "tcp;ofi_rxm" anywhere); rdma_resource: the device-plugin resource a
    verbs pod asks for (one per pod); efa_devices: vpc.amazonaws.com/efa per pod (with IPC_LOCK,
    huge pages and required prefill/decode anti-affinity); fabric_ports: the TCP port range of the
    tcp provider (FI_TCP_PORT_LOW_RANGE / HIGH_RANGE), opened between the roles by the
    NetworkPolicies; model: --model of both roles (None: the image's default model); cache_pvc: a
    PersistentVolumeClaim holding the converted model (None: an emptyDir, converted at each
    start); startup_s: how long a node may take to load before the kubelet restarts it;
    prometheus: the server KEDA queries; monitoring_namespace: the namespace allowed to scrape;
    tp_workload: how a TP > 1 node is deployed: "lws" (a LeaderWorkerSet of size-1 groups, leader
    = rank 0 holding every rank; the module docstring says why) or "deployment" (the same pod in a
    Deployment, for clusters without the LWS controller);
    tls_secret: a Secret (tls.crt, tls.key, ca.crt) that turns on mTLS between every process
    (S9): one certificate for all, with serverAuth and clientAuth usage and the DNS name
    `tls_server_name` (default NAME.NAMESPACE.svc), which every client checks instead of the pod
    address it dials; token_secret: a Secret whose key `token` every gRPC call carries."""

    name: str = "pdserve"
    namespace: str = "pdserve"
    image: str = "pdserve:0.1.0"
    prefill: RoleSpec = RoleSpec(engine=(("max-batch-tokens", "512"),))
    decode: RoleSpec = RoleSpec(engine=(("max-batch-tokens", "256"),))
    router_replicas: int = 2
    provider: str = "verbs;ofi_rxm"
    rdma_resource: str | None = "rdma/hca_shared_devices_a"
    efa_devices: int = 0
    hugepages_2mi: str | None = None
    fabric_ports: tuple[int, int] = (20000, 20999)
    model: str | None = None
    cache_pvc: str | None = None
    startup_s: int = 900
    autoscaler: str = "keda"
    prometheus: str = "http://prometheus-operated.monitoring.svc:9090"
    monitoring_namespace: str = "monitoring"
    tp_workload: str = "lws"
    tls_secret: str | None = None
    token_secret: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.tp_workload not in TP_WORKLOADS:
            raise ValueError(f"tp_workload must be one of {TP_WORKLOADS}, got {self.tp_workload!r}")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}, got {self.provider!r}")
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(f"autoscaler must be one of {AUTOSCALERS}, got {self.autoscaler!r}")
        if self.efa_devices and self.provider != "efa":
            raise ValueError(f"efa_devices={self.efa_devices} needs provider 'efa', got {self.provider!r}")
        if self.provider == "efa" and self.efa_devices < 1:
            raise ValueError("provider 'efa' needs efa_devices >= 1 (vpc.amazonaws.com/efa per pod)")
        low, high = self.fabric_ports
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"fabric_ports must be 1024 <= low <= high <= 65535, got {self.fabric_ports}")
        if self.router_replicas < 1:
            raise ValueError(f"router_replicas must be >= 1, got {self.router_replicas}")
        if self.startup_s < 30:
            raise ValueError(f"startup_s must be >= 30 (a model load), got {self.startup_s}")
        for label, value in (("name", self.name), ("namespace", self.namespace)):
            if not value or not all(c.isalnum() or c == "-" for c in value) or value != value.lower():
                raise ValueError(f"{label} must be a lowercase DNS label, got {value!r}")

    def role(self, role: str) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    @property
    def server_name(self) -> str:
        return self.tls_server_name or f"{self.name}.{self.namespace}.svc"

    def lws_group(self, role: str) -> bool:
        """Whether the nodes of `role` are LeaderWorkerSet groups (size 1: the leader holds every rank)."""
        return self.role(role).tp > 1 and self.tp_workload == "lws"

    def workload_name(self, role: str) -> str:
        """The role's Deployment or LeaderWorkerSet. A LeaderWorkerSet's name is not the role's
        Service's: its controller makes a headless Service of the LWS's name (the pods' DNS
        subdomain), or takes a Service that already has the name as it is."""
        return f"{self.name}-{role}-group" if self.lws_group(role) else f"{self.name}-{role}"

    def service_host(self, role: str) -> str:
        """The headless Service's DNS name of a role (router, prefill or decode)."""
        return f"{self.name}-{role}.{self.namespace}.svc.cluster.local"


# The spec of deploy/k8s/base/, and the checked-in overlays (the drift test re-renders all of them).
BASE = DeploySpec()
_CPU_ROLE = {"cpu": "2", "memory": "4Gi"}
OVERLAYS: dict[str, DeploySpec] = {
    "1p1d": BASE,
    "1p3d": dataclasses.replace(BASE, decode=dataclasses.replace(BASE.decode, replicas=3)),
    "2p4d": dataclasses.replace(BASE, prefill=dataclasses.replace(BASE.prefill, replicas=2),
                                decode=dataclasses.replace(BASE.decode, replicas=4)),
    "tp2": dataclasses.replace(BASE, prefill=dataclasses.replace(BASE.prefill, tp=2)),   # a LeaderWorkerSet
    "efa": dataclasses.replace(BASE, provider="efa", rdma_resource=None, efa_devices=1, hugepages_2mi="2Gi",
                               decode=dataclasses.replace(BASE.decode, replicas=3)),
    "cpu-tcp": dataclasses.replace(BASE, provider="tcp;ofi_rxm", rdma_resource=None,
                                   prefill=dataclasses.replace(BASE.prefill, **_CPU_ROLE),
                                   decode=dataclasses.replace(BASE.decode, **_CPU_ROLE)),
    "hpa": dataclasses.replace(BASE, autoscaler="hpa", decode=dataclasses.replace(BASE.decode, replicas=3)),
    "mtls": dataclasses.replace(BASE, tls_secret="pdserve-tls", token_secret="pdserve-token"),
}


# --- pieces ----------------------------------------------------------------------------------------

def _labels(spec: DeploySpec, role: str) -> dict[str, str]:
    return {LABEL_NAME: spec.name, LABEL_ROLE: role, LABEL_PART: "pdserve"}


def _meta(spec: DeploySpec, name: str, role: str | None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace}
    meta["labels"] = _labels(spec, role) if role else {LABEL_NAME: spec.name, LABEL_PART: "pdserve"}
    meta.update(extra)
    return meta


def _env_name(flag: str) -> str:
    return "PDSERVE_ENGINE_" + flag.upper().replace("-", "_")


def _engine_flags(spec: DeploySpec, role: str) -> list[tuple[str, str]]:
    """(flag, value) of a role's engine flags, in ConfigMap order: --model, --threads, then the role's own."""
    r = spec.role(role)
    flags: list[tuple[str, str]] = []
    if spec.model:
        flags.append(("model", spec.model))
    cpu = r.cpu[:-1] if r.cpu.endswith("m") else r.cpu
    threads = max(1, int(float(cpu) / (1000 if r.cpu.endswith("m") else 1)))
    flags.append(("threads", str(threads)))
    own = dict(r.engine)
    for flag in own:
        if flag in ("model", "threads"):
            raise ValueError(f"engine flag {flag!r} is set by the spec (model / the role's cpu), not per role")
    flags.extend(own.items())
    return flags


def _config_key(role: str, flag: str) -> str:
    return f"{role}.{flag}"


def _config_map(spec: DeploySpec) -> dict[str, Any]:
    data = {_config_key(role, flag): value for role in ROLES for flag, value in _engine_flags(spec, role)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, f"{spec.name}-engine", None),
            "data": data}


def _config_hash(spec: DeploySpec) -> str:
    """A digest of the ConfigMap, in the pod templates: editing the flags rolls the pods."""
    return hashlib.sha256(json.dumps(_config_map(spec)["data"], sort_keys=True).encode()).hexdigest()[:16]


def security_args(spec: DeploySpec) -> list[str]:
    """The TLS / token flags every process (and its exec probes) takes (pdserve.serving.channels)."""
    args: list[str] = []
    if spec.tls_secret:
        args += [f"--tls-cert={TLS_DIR}/tls.crt", f"--tls-key={TLS_DIR}/tls.key", f"--tls-ca={TLS_DIR}/ca.crt",
                 f"--tls-server-name={spec.server_name}"]
    if spec.token_secret:
        args.append(f"--auth-token-file={TOKEN_DIR}/token")
    return args


def _grpc_probe(spec: DeploySpec, port: int, service: str, period: int, failures: int,
                timeout: int = 2) -> dict[str, Any]:
    if spec.tls_secret:   # the kubelet's gRPC probe speaks plaintext only
        check: dict[str, Any] = {"exec": {"command": [PYTHON, "-m", "pdserve.tools.probe", f"--port={port}",
                                                      f"--service={service}", f"--timeout={timeout}",
                                                      *security_args(spec)]}}
    else:
        check = {"grpc": {"port": port, "service": service}}
    return {**check, "periodSeconds": period, "failureThreshold": failures, "timeoutSeconds": timeout + 1}


def _probes(spec: DeploySpec, role: str, port: int) -> dict[str, Any]:
    ready = READINESS_SERVICES[role]
    startup_period = 10
    return {
        # Until it passes, no liveness: the model load may take `startup_s`. The whole server (""),
        # SERVING once the model is loaded: the named service is readiness, which may wait on peers
        # (a decode node with no prefill node reachable, a router with no decode node ready).
        "startupProbe": _grpc_probe(spec, port, "", startup_period, max(1, spec.startup_s // startup_period)),
        "readinessProbe": _grpc_probe(spec, port, ready, 5, 2),
        "livenessProbe": _grpc_probe(spec, port, "", 10, 3),
    }


def _security(spec: DeploySpec, role: str) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if role != "router" and (spec.efa_devices or spec.rdma_resource):
        caps["add"] = ["IPC_LOCK"]   # RDMA memory registration pins the KV pool (memlock)
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": caps}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def node_args(spec: DeploySpec, role: str) -> list[str]:
    """The container args of a node of `role` (after `python -m <module>`)."""
    port = ROLE_PORTS[role]
    args = ["--host=0.0.0.0", f"--port={port}", "--node-id=$(POD_NAME)", f"--provider={spec.provider}",
            "--fabric-node=$(POD_IP)", f"--metrics-port={NODE_METRICS_PORT}", "--log-format=json"]
    if role == "decode":
        args.append(f"--prefill=dns:{spec.service_host('prefill')}:{PREFILL_PORT}")
    r = spec.role(role)
    if r.tp > 1:
        args.append(f"--tensor-parallel-size={r.tp}")
    if max(spec.role(x).tp for x in ("prefill", "decode")) > 1:
        # Every node of a cluster with a TP > 1 role sums in the TP-invariant order, so a TP 1 node's
        # KV and logits equal the TP > 1 nodes' bit for bit (EngineConfig.tp_invariant).
        args.append("--tp-invariant")
    args.extend(f"--{flag}=$({_env_name(flag)})" for flag, _ in _engine_flags(spec, role))
    return args + security_args(spec)


def router_args(spec: DeploySpec) -> list[str]:
    return ["--host=0.0.0.0", f"--port={ROUTER_PORT}", f"--http-port={ROUTER_HTTP_PORT}",
            f"--decode=dns:{spec.service_host('decode')}:{DECODE_PORT}", "--log-format=json", *security_args(spec)]


def _node_env(spec: DeploySpec, role: str) -> list[dict[str, Any]]:
    env = [_field_env("POD_NAME", "metadata.name"), _field_env("POD_IP", "status.podIP"),
           {"name": "FI_PROVIDER", "value": spec.provider},
           {"name": "FI_TCP_PORT_LOW_RANGE", "value": str(spec.fabric_ports[0])},
           {"name": "FI_TCP_PORT_HIGH_RANGE", "value": str(spec.fabric_ports[1])},
           {"name": "PDSERVE_CACHE_DIR", "value": MODEL_CACHE},
           {"name": "HOME", "value": "/tmp"}]
    if spec.provider == "efa":
        env.append({"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"})
    for flag, _ in _engine_flags(spec, role):
        env.append({"name": _env_name(flag),
                    "valueFrom": {"configMapKeyRef": {"name": f"{spec.name}-engine", "key": _config_key(role, flag)}}})
    return env


def _times(quantity: str, n: int) -> str:
    """A Kubernetes quantity times n ('4' x 2 = '8', '16Gi' x 2 = '32Gi', '500m' x 3 = '1500m')."""
    digits = len(quantity) - len(quantity.lstrip("0123456789."))
    number, unit = quantity[:digits], quantity[digits:]
    if not number:
        raise ValueError(f"quantity {quantity!r} does not start with a number")
    value = float(number) * n
    return f"{int(value) if value.is_integer() else value}{unit}"


def _resources(spec: DeploySpec, role: str) -> dict[str, Any]:
    r = spec.role(role)
    ranks = r.tp   # one pod holds every rank of its node (D15)
    amounts: dict[str, Any] = {"cpu": _times(r.cpu, ranks), "memory": _times(r.memory, ranks)}
    if r.gpus:
        amounts["nvidia.com/gpu"] = r.gpus * ranks
    if spec.efa_devices:
        amounts["vpc.amazonaws.com/efa"] = spec.efa_devices
    elif spec.rdma_resource:
        amounts[spec.rdma_resource] = 1
    if spec.hugepages_2mi:
        amounts["hugepages-2Mi"] = spec.hugepages_2mi
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _secret_volumes(spec: DeploySpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes, mounts = [], []
    for name, secret, path in (("tls", spec.tls_secret, TLS_DIR), ("token", spec.token_secret, TOKEN_DIR)):
        if secret:
            volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": 0o440}})
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
    return volumes, mounts


def _volumes(spec: DeploySpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache: dict[str, Any] = ({"persistentVolumeClaim": {"claimName": spec.cache_pvc}} if spec.cache_pvc
                             else {"emptyDir": {"sizeLimit": "4Gi"}})
    volumes = [{"name": "model-cache", **cache}, {"name": "tmp", "emptyDir": {}},
               # the KV pool and fabric doorbells live in shared memory; the container runtime's 64 MiB is too small
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "model-cache", "mountPath": MODEL_CACHE}, {"name": "tmp", "mountPath": "/tmp"},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.hugepages_2mi:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}})
        mounts.append({"name": "hugepages", "mountPath": "/dev/hugepages"})
    secret_volumes, secret_mounts = _secret_volumes(spec)
    return volumes + secret_volumes, mounts + secret_mounts


def _affinity(spec: DeploySpec, role: str) -> dict[str, Any]:
    nodes = {"matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(ROLES)},
                                  {"key": LABEL_NAME, "operator": "In", "values": [spec.name]}]}
    term = {"labelSelector": nodes, "topologyKey": "kubernetes.io/hostname"}
    if spec.efa_devices:
        # One node pod per host: each gets the host's EFA devices and memory bandwidth to itself.
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def _node_pod(spec: DeploySpec, role: str) -> dict[str, Any]:
    port = ROLE_PORTS[role]
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": role, "image": spec.image, "imagePullPolicy": "IfNotPresent",
        "command": [PYTHON, "-m", ROLE_MODULES[role]], "args": node_args(spec, role),
        "env": _node_env(spec, role),
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": NODE_METRICS_PORT, "protocol": "TCP"}],
        "resources": _resources(spec, role), "volumeMounts": mounts, "securityContext": _security(spec, role),
        **_probes(spec, role, port), "lifecycle": _pre_stop(),
    }
    return {
        "metadata": {"labels": _labels(spec, role), "annotations": {"pdserve.dev/engine-config": _config_hash(spec)}},
        "spec": {
            "terminationGracePeriodSeconds": drain_seconds(),
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "affinity": _affinity(spec, role),
            "containers": [container],
            "volumes": volumes,
        },
    }


def _node_workload(spec: DeploySpec, role: str) -> dict[str, Any]:
    r = spec.role(role)
    meta = _meta(spec, spec.workload_name(role), role)
    if not spec.lws_group(role):
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                "spec": {"replicas": r.replicas, "selector": {"matchLabels": _labels(spec, role)},
                         # one node at a time: a new pod must be SERVING before an old one drains
                         "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                         "template": _node_pod(spec, role)}}
    # One TP group per replica, of size 1: its leader pod is rank 0 and starts ranks 1..tp-1 as
    # processes of its container (they share its /dev/shm, D15). workerTemplate is the leader's template
    # (no leaderTemplate); see the module docstring for the fields left out.
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta,
            "spec": {"replicas": r.replicas,
                     # group by group, like the Deployments: a new group SERVING before an old one drains
                     "rolloutStrategy": {"type": "RollingUpdate",
                                         "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
                     "leaderWorkerTemplate": {"size": 1, "restartPolicy": "RecreateGroupOnPodRestart",
                                              "workerTemplate": _node_pod(spec, role)}}}


def leader_template(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod template a workload's serving pods are made from: a Deployment's, or a LeaderWorkerSet
    group's leader (leaderTemplate, else workerTemplate, as the LWS controller does)."""
    if workload["kind"] == "Deployment":
        return workload["spec"]["template"]
    lwt = workload["spec"]["leaderWorkerTemplate"]
    return lwt.get("leaderTemplate") or lwt["workerTemplate"]


def _headless_service(spec: DeploySpec, role: str) -> dict[str, Any]:
    selector = dict(_labels(spec, role))
    if spec.lws_group(role):
        selector[LWS_WORKER_INDEX] = "0"   # a group's leader (rank 0) serves the node's API
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, f"{spec.name}-{role}", role),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": selector,
                     "ports": [{"name": "grpc", "port": ROLE_PORTS[role], "targetPort": "grpc", "protocol": "TCP"},
                               {"name": "metrics", "port": NODE_METRICS_PORT, "targetPort": "metrics",
                                "protocol": "TCP"}]}}


def _router(spec: DeploySpec) -> list[dict[str, Any]]:
    labels = _labels(spec, "router")
    container = {
        "name": "router", "image": spec.image, "imagePullPolicy": "IfNotPresent",
        "command": [PYTHON, "-m", "router"], "args": router_args(spec), "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "grpc", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *_secret_volumes(spec)[1]],
        "securityContext": _security(spec, "router"),
        **_probes(dataclasses.replace(spec, startup_s=60), "router", ROUTER_PORT),
        "lifecycle": _pre_stop(),
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, f"{spec.name}-router", "router"),
        "spec": {"replicas": spec.router_replicas, "selector": {"matchLabels": labels},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "terminationGracePeriodSeconds": drain_seconds(), "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                         "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container],
                     "volumes": [{"name": "tmp", "emptyDir": {}}, *_secret_volumes(spec)[0]]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, f"{spec.name}-router", "router"),
               "spec": {"type": "ClusterIP", "selector": labels,
                        "ports": [{"name": "grpc", "port": ROUTER_PORT, "targetPort": "grpc", "protocol": "TCP",
                                   "appProtocol": "kubernetes.io/h2c"},
                                  {"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]}}
    return [deployment, service]


def _pdb(spec: DeploySpec, role: str) -> dict[str, Any]:
    selector = dict(_labels(spec, role))
    if role != "router" and spec.lws_group(role):
        selector[LWS_WORKER_INDEX] = "0"
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(spec, f"{spec.name}-{role}", role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}


def _service_monitor(spec: DeploySpec) -> dict[str, Any]:
    # role and namespace become labels of every series, which the autoscalers' queries pin.
    relabel = [{"sourceLabels": [f"__meta_kubernetes_pod_label_{LABEL_ROLE.replace('.', '_').replace('/', '_')}"],
                "targetLabel": "role", "action": "replace"}]
    endpoints = [{"port": port, "path": "/metrics", "interval": "15s", "relabelings": relabel}
                 for port in ("metrics", "http")]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(spec, spec.name, None),
            "spec": {"selector": {"matchLabels": {LABEL_PART: "pdserve", LABEL_NAME: spec.name}},
                     "namespaceSelector": {"matchNames": [spec.namespace]}, "endpoints": endpoints}}


def queue_queries(spec: DeploySpec, role: str) -> dict[str, str]:
    """The autoscaler's PromQL per trigger: waiting requests of the role's engines, summed over the
    namespace's pods of that role (`or vector(0)`: no series yet is an empty queue, not an error).
    Prefill also scales on the decode nodes' requests waiting for KV: the backlog as decode sees it."""
    def q(metric: str, of: str) -> str:
        return f'sum({metric}{{namespace="{spec.namespace}",role="{of}"}}) or vector(0)'
    if role == "decode":
        return {"waiting": q("pdserve:num_requests_waiting", "decode")}
    return {"waiting": q("pdserve:num_requests_waiting", "prefill"),
            "waiting-for-kv": q("pdserve:num_requests_waiting_for_kv", "decode")}


def _scale_target(spec: DeploySpec, role: str) -> dict[str, Any]:
    # a LeaderWorkerSet scales by groups through its scale subresource (spec.replicas)
    kind = (LWS_API, "LeaderWorkerSet") if spec.lws_group(role) else ("apps/v1", "Deployment")
    return {"apiVersion": kind[0], "kind": kind[1], "name": spec.workload_name(role)}


def _autoscaler(spec: DeploySpec, role: str) -> dict[str, Any]:
    r = spec.role(role)
    if spec.autoscaler == "keda":
        triggers = [{"type": "prometheus", "name": name,
                     "metadata": {"serverAddress": spec.prometheus, "query": query,
                                  "threshold": str(r.queue_target), "activationThreshold": "0"}}
                    for name, query in queue_queries(spec, role).items()]
        return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                "metadata": _meta(spec, f"{spec.name}-{role}", role),
                "spec": {"scaleTargetRef": _scale_target(spec, role), "minReplicaCount": r.replicas,
                         "maxReplicaCount": r.ceiling, "pollingInterval": 15, "cooldownPeriod": 300,
                         "triggers": triggers}}
    # HPA: an external metric per trigger, served by a Prometheus adapter (deploy/README.md has its rule).
    metrics = [{"type": "External", "external": {
        "metric": {"name": f"pdserve_{name.replace('-', '_')}",
                   "selector": {"matchLabels": {"namespace": spec.namespace,
                                                "role": "decode" if name == "waiting-for-kv" else role}}},
        "target": {"type": "AverageValue", "averageValue": str(r.queue_target)}}}
        for name in queue_queries(spec, role)]
    target = _scale_target(spec, role)
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(spec, f"{spec.name}-{role}", role),
            "spec": {"scaleTargetRef": target, "minReplicas": r.replicas, "maxReplicas": r.ceiling,
                     "metrics": metrics,
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}}}


def _network_policies(spec: DeploySpec) -> list[dict[str, Any]]:
    def pods(role: str) -> dict[str, Any]:
        return {"podSelector": {"matchLabels": {LABEL_NAME: spec.name, LABEL_ROLE: role}}}

    def tcp(port: int, end: int | None = None) -> dict[str, Any]:
        p: dict[str, Any] = {"protocol": "TCP", "port": port}
        if end is not None:
            p["endPort"] = end
        return p

    scrape = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.monitoring_namespace}}}
    low, high = spec.fabric_ports
    fabric = tcp(low, high)

    def policy(name: str, role: str | None, ingress: list[dict[str, Any]]) -> dict[str, Any]:
        selector = {"matchLabels": {LABEL_NAME: spec.name, LABEL_ROLE: role}} if role else {}
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _meta(spec, f"{spec.name}-{name}", role),
                "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress}}

    return [
        policy("default-deny", None, []),
        policy("router", "router", [{"ports": [tcp(ROUTER_PORT), tcp(ROUTER_HTTP_PORT)]}]),
        # decode: the client API only from routers; KV writes (tcp provider) from prefill nodes; scrapes
        policy("decode", "decode", [{"from": [pods("router")], "ports": [tcp(DECODE_PORT)]},
                                    {"from": [pods("prefill")], "ports": [fabric]},
                                    {"from": [scrape], "ports": [tcp(NODE_METRICS_PORT)]}]),
        # prefill: Prefill / NodeService calls and the fabric's connections only from decode nodes; scrapes
        policy("prefill", "prefill", [{"from": [pods("decode")], "ports": [tcp(PREFILL_PORT), fabric]},
                                      {"from": [scrape], "ports": [tcp(NODE_METRICS_PORT)]}]),
    ]


def render(spec: DeploySpec) -> list[dict[str, Any]]:
    """Every object of the namespace, in apply order."""
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": spec.namespace,
                                                               "labels": {LABEL_PART: "pdserve"}}},
        _config_map(spec)]
    for role in ("prefill", "decode"):
        objects += [_headless_service(spec, role), _node_workload(spec, role), _pdb(spec, role)]
    objects += _router(spec)
    objects.append(_pdb(spec, "router"))
    objects.append(_service_monitor(spec))
    if spec.autoscaler != "none":
        objects += [_autoscaler(spec, role) for role in ROLES]
    objects += _network_policies(spec)
    return objects


def to_yaml(objects: Iterable[Mapping[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(dict(o), sort_keys=False, width=120) for o in objects)


# --- the kustomize tree ------------------------------------------------------------------------------

def object_key(o: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name): what identifies an object in one namespace."""
    return (o["apiVersion"], o["kind"], o["metadata"]["name"])


def _file_name(o: Mapping[str, Any]) -> str:
    return f"{o['kind'].lower()}-{o['metadata']['name']}.yaml"


def _pointer(path: Sequence[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def json_patch(old: Any, new: Any, path: tuple[str | int, ...] = ()) -> list[dict[str, Any]]:
    """RFC 6902 operations that turn `old` into `new` (lists of equal length element by element,
    other lists replaced whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        ops: list[dict[str, Any]] = []
        for k in old:
            if k not in new:
                ops.append({"op": "remove", "path": _pointer((*path, k))})
        for k, v in new.items():
            if k not in old:
                ops.append({"op": "add", "path": _pointer((*path, k)), "value": v})
            else:
                ops += json_patch(old[k], v, (*path, k))
        return ops
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [op for i, (a, b) in enumerate(zip(old, new, strict=True)) for op in json_patch(a, b, (*path, i))]
    if old == new and type(old) is type(new):
        return []
    return [{"op": "replace", "path": _pointer(path), "value": new}]


def _target(o: Mapping[str, Any]) -> dict[str, str]:
    group, _, version = o["apiVersion"].rpartition("/")
    target = {"version": version, "kind": o["kind"], "name": o["metadata"]["name"]}
    if group:
        target = {"group": group, **target}
    return target


def tree() -> dict[str, str]:
    """Relative path under deploy/k8s -> file text: base/ and overlays/NAME/ (see the module docstring)."""
    files: dict[str, str] = {}
    base = render(BASE)
    for o in base:
        files[f"base/{_file_name(o)}"] = HEADER + to_yaml([o])
    files["base/kustomization.yaml"] = HEADER + yaml.safe_dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
         "resources": [_file_name(o) for o in base]}, sort_keys=False)
    base_by_key = {object_key(o): o for o in base}
    for name, spec in OVERLAYS.items():
        objects = render(spec)
        by_key = {object_key(o): o for o in objects}
        resources: list[str] = ["../../base"]
        patches: list[dict[str, Any]] = []
        for key, o in base_by_key.items():
            if key not in by_key:
                patches.append({"patch": yaml.safe_dump({"$patch": "delete", "apiVersion": o["apiVersion"],
                                                         "kind": o["kind"], "metadata": {
                                                             "name": o["metadata"]["name"],
                                                             "namespace": o["metadata"]["namespace"]}},
                                                        sort_keys=False)})
        for key, o in by_key.items():
            if key not in base_by_key:
                files[f"overlays/{name}/{_file_name(o)}"] = HEADER + to_yaml([o])
                resources.append(_file_name(o))
                continue
            ops = json_patch(base_by_key[key], o)
            if ops:
                patch_file = f"patch-{_file_name(o)}"
                files[f"overlays/{name}/{patch_file}"] = HEADER + yaml.safe_dump(ops, sort_keys=False, width=120)
                patches.append({"path": patch_file, "target": _target(o)})
        kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                         "resources": resources}
        if patches:
            kustomization["patches"] = patches
        files[f"overlays/{name}/kustomization.yaml"] = HEADER + yaml.safe_dump(kustomization, sort_keys=False,
                                                                                width=120)
    return files


def default_root() -> Path:
    return Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def tree_drift(root: Path) -> list[str]:
    """Files under `root` that differ from `tree()` (missing, changed, or not rendered any more)."""
    want = tree()
    drift = [p for p, text in want.items() if not (root / p).is_file() or (root / p).read_text() != text]
    for sub in ("base", "overlays"):
        for path in sorted((root / sub).rglob("*.yaml")) if (root / sub).is_dir() else ():
            rel = path.relative_to(root).as_posix()
            if rel not in want:
                drift.append(rel)
    return sorted(drift)


def write_tree(root: Path) -> list[str]:
    """Write `tree()` under `root`, removing rendered files no longer rendered; returns what changed."""
    changed = tree_drift(root)
    want = tree()
    for rel in changed:
        path = root / rel
        if rel in want:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(want[rel])
        else:
            path.unlink()
    return changed


# --- the command line --------------------------------------------------------------------------------

def _engine_pairs(values: Sequence[str] | None, what: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for v in values or ():
        flag, sep, value = v.partition("=")
        if not sep:
            raise ValueError(f"{what} takes FLAG=VALUE (e.g. num-blocks=4096), got {v!r}")
        pairs.append((flag.lstrip("-"), value))
    return tuple(pairs)


def spec_from_args(args: argparse.Namespace) -> DeploySpec:
    if args.overlay:
        if args.overlay not in OVERLAYS:
            raise ValueError(f"--overlay must be one of {sorted(OVERLAYS)}, got {args.overlay!r}")
        return OVERLAYS[args.overlay]

    def role(which: str, replicas: int, tp: int, extra: Sequence[str] | None) -> RoleSpec:
        base = BASE.role(which)
        kw: dict[str, Any] = {"replicas": replicas, "tp": tp}
        for name in ("cpu", "memory", "gpus"):
            value = getattr(args, f"{which}_{name}")
            if value is not None:
                kw[name] = value
        return dataclasses.replace(base, engine=base.engine + _engine_pairs(extra, f"--{which}-engine"), **kw)

    provider = args.provider or ("efa" if args.efa else BASE.provider)
    rdma = args.rdma_resource if provider == "verbs;ofi_rxm" else None
    return DeploySpec(
        namespace=args.namespace, image=args.image, model=args.model, cache_pvc=args.cache_pvc,
        prefill=role("prefill", args.prefill, args.prefill_tp, args.prefill_engine),
        decode=role("decode", args.decode, args.decode_tp, args.decode_engine),
        router_replicas=args.routers, provider=provider, rdma_resource=rdma,
        efa_devices=args.efa_devices if provider == "efa" else 0,
        hugepages_2mi=args.hugepages or ("2Gi" if provider == "efa" else None),
        autoscaler=args.autoscaler, prometheus=args.prometheus, tp_workload=args.tp_workload,
        tls_secret=args.tls_secret, tls_server_name=args.tls_server_name, token_secret=args.token_secret)


def add_deploy_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("deploy", help="Kubernetes manifests of a cluster (render, or write the kustomize tree)")
    dsub = d.add_subparsers(dest="deploy_command", required=True)
    r = dsub.add_parser("render", help="print the manifests of one spec as multi-document YAML")
    r.add_argument("--overlay", default=None, help=f"a checked-in overlay's spec: {', '.join(OVERLAYS)}")
    r.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill nodes (TP groups) (default 1)")
    r.add_argument("--decode", type=int, default=1, metavar="M", help="decode nodes (TP groups) (default 1)")
    r.add_argument("--prefill-tp", type=int, default=1, metavar="A", help="ranks per prefill node (default 1)")
    r.add_argument("--decode-tp", type=int, default=1, metavar="B", help="ranks per decode node (default 1)")
    r.add_argument("--tp-workload", default=BASE.tp_workload, choices=TP_WORKLOADS,
                   help="a TP > 1 node (one pod with every rank) as a LeaderWorkerSet group of size 1, "
                        "leader = rank 0 (lws), or in a Deployment for clusters without the LWS "
                        f"controller (deployment) (default: {BASE.tp_workload})")
    r.add_argument("--provider", default=None, choices=PROVIDERS,
                   help=f"libfabric provider of every node (default {BASE.provider}; efa with --efa)")
    r.add_argument("--efa", action="store_true", help="AWS EFA: provider efa, EFA devices, IPC_LOCK, huge "
                                                      "pages, one node pod per host")
    r.add_argument("--efa-devices", type=int, default=1, metavar="N", help="vpc.amazonaws.com/efa per pod")
    r.add_argument("--rdma-resource", default=BASE.rdma_resource, metavar="NAME",
                   help=f"device-plugin resource of a verbs pod (default {BASE.rdma_resource})")
    r.add_argument("--hugepages", default=None, metavar="QTY", help="hugepages-2Mi per pod (default: 2Gi with EFA)")
    for role in ROLES:
        base = BASE.role(role)
        r.add_argument(f"--{role}-cpu", default=None, help=f"CPU per {role} rank (default {base.cpu})")
        r.add_argument(f"--{role}-memory", default=None, help=f"memory per {role} rank (default {base.memory})")
        r.add_argument(f"--{role}-gpus", type=int, default=None, help=f"nvidia.com/gpu per {role} rank (default 0)")
        r.add_argument(f"--{role}-engine", action="append", metavar="FLAG=VALUE",
                       help=f"an engine flag of the {role} nodes, through the ConfigMap (repeatable)")
    r.add_argument("--routers", type=int, default=BASE.router_replicas, help="router replicas")
    r.add_argument("--namespace", default=BASE.namespace)
    r.add_argument("--image", default=BASE.image)
    r.add_argument("--model", default=None, help="--model of every node (default: the image's default model)")
    r.add_argument("--cache-pvc", default=None, metavar="CLAIM", help="PVC for the converted model (default: "
                                                                      "an emptyDir per pod)")
    r.add_argument("--tls-secret", default=None, metavar="SECRET",
                   help="mTLS between every process with this Secret's tls.crt, tls.key and ca.crt")
    r.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="the DNS name in that certificate (default: NAME.NAMESPACE.svc)")
    r.add_argument("--token-secret", default=None, metavar="SECRET",
                   help="a shared token (the Secret's key `token`) on every gRPC call")
    r.add_argument("--autoscaler", default=BASE.autoscaler, choices=AUTOSCALERS)
    r.add_argument("--prometheus", default=BASE.prometheus, metavar="URL", help="the Prometheus KEDA queries")
    r.set_defaults(func=_cmd_render)
    t = dsub.add_parser("tree", help="write the kustomize base and overlays (deploy/k8s) from the specs")
    t.add_argument("--root", type=Path, default=None, help="default: deploy/k8s of this checkout")
    t.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files that differ")
    t.set_defaults(func=_cmd_tree)


def _cmd_render(args: argparse.Namespace) -> int:
    sys.stdout.write(to_yaml(render(spec_from_args(args))))
    return 0


def _cmd_tree(args: argparse.Namespace) -> int:
    root = args.root or default_root()
    if args.check:
        drift = tree_drift(root)
        for rel in drift:
            print(f"differs from the render: {root / rel}", file=sys.stderr)
        return 1 if drift else 0
    for rel in write_tree(root):
        print(f"wrote {root / rel}")
    return 0


__all__ = ["BASE", "OVERLAYS", "DeploySpec", "RoleSpec", "add_deploy_parser", "drain_seconds", "json_patch",
           "leader_template", "node_args", "object_key", "queue_queries", "render", "router_args", "security_args",
           "to_yaml", "tree", "tree_drift", "write_tree"]
