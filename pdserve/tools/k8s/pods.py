"""The pods of a Kubernetes deployment: a node's workload (Deployment or LeaderWorkerSet) and pod
template, the router's Deployment and Service, and the pieces they share (labels, the engine flags'
ConfigMap, probes, security, volumes, resources) (pdserve.tools.deploy renders them).

A role's workload is a Deployment at TP 1, a LeaderWorkerSet of size-1 groups at TP > 1 (the
leader, rank 0, holds every rank; pdserve.tools.deploy's docstring says why). Probes are the
kubelet's native gRPC probes on grpc.health.v1 (exec probes through pdserve.tools.probe under mTLS,
which the kubelet's gRPC probe cannot speak). Threads: none; no blocking waits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pdserve.tools.k8s.spec import (
    DECODE_PORT,
    LABEL_NAME,
    LABEL_PART,
    LABEL_ROLE,
    LWS_API,
    MODEL_CACHE,
    NODE_METRICS_PORT,
    PREFILL_PORT,
    PRESTOP_S,
    PYTHON,
    READINESS_SERVICES,
    ROLE_MODULES,
    ROLE_PORTS,
    ROLES,
    ROUTER_HTTP_PORT,
    ROUTER_PORT,
    TLS_DIR,
    TOKEN_DIR,
    DeploySpec,
    drain_seconds,
)


def pre_stop_hook() -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}}



def pod_labels(spec: DeploySpec, role: str) -> dict[str, str]:
    return {LABEL_NAME: spec.name, LABEL_ROLE: role, LABEL_PART: "pdserve"}


def object_meta(spec: DeploySpec, name: str, role: str | None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace}
    meta["labels"] = pod_labels(spec, role) if role else {LABEL_NAME: spec.name, LABEL_PART: "pdserve"}
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


def engine_config_map(spec: DeploySpec) -> dict[str, Any]:
    data = {_config_key(role, flag): value for role in ROLES for flag, value in _engine_flags(spec, role)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(spec, f"{spec.name}-engine", None),
            "data": data}


def _config_hash(spec: DeploySpec) -> str:
    """A digest of the ConfigMap, in the pod templates: editing the flags rolls the pods."""
    return hashlib.sha256(json.dumps(engine_config_map(spec)["data"], sort_keys=True).encode()).hexdigest()[:16]


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


def grpc_probes(spec: DeploySpec, role: str, port: int) -> dict[str, Any]:
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


def container_security(spec: DeploySpec, role: str) -> dict[str, Any]:
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


def secret_volumes_and_mounts(spec: DeploySpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
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
    secret_volumes, secret_mounts = secret_volumes_and_mounts(spec)
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
        "resources": _resources(spec, role), "volumeMounts": mounts, "securityContext": container_security(spec, role),
        **grpc_probes(spec, role, port), "lifecycle": pre_stop_hook(),
    }
    return {
        "metadata": {"labels": pod_labels(spec, role),
                     "annotations": {"pdserve.dev/engine-config": _config_hash(spec)}},
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


def node_workload(spec: DeploySpec, role: str) -> dict[str, Any]:
    r = spec.role(role)
    meta = object_meta(spec, spec.workload_name(role), role)
    if not spec.lws_group(role):
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                "spec": {"replicas": r.replicas, "selector": {"matchLabels": pod_labels(spec, role)},
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



def router_objects(spec: DeploySpec) -> list[dict[str, Any]]:
    labels = pod_labels(spec, "router")
    container = {
        "name": "router", "image": spec.image, "imagePullPolicy": "IfNotPresent",
        "command": [PYTHON, "-m", "router"], "args": router_args(spec), "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "grpc", "containerPort": ROUTER_PORT, "protocol": "TCP"},
                  {"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *secret_volumes_and_mounts(spec)[1]],
        "securityContext": container_security(spec, "router"),
        **grpc_probes(dataclasses.replace(spec, startup_s=60), "router", ROUTER_PORT),
        "lifecycle": pre_stop_hook(),
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_meta(spec, f"{spec.name}-router", "router"),
        "spec": {"replicas": spec.router_replicas, "selector": {"matchLabels": labels},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "terminationGracePeriodSeconds": drain_seconds(), "automountServiceAccountToken": False,
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                         "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container],
                     "volumes": [{"name": "tmp", "emptyDir": {}}, *secret_volumes_and_mounts(spec)[0]]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(spec, f"{spec.name}-router", "router"),
               "spec": {"type": "ClusterIP", "selector": labels,
                        "ports": [{"name": "grpc", "port": ROUTER_PORT, "targetPort": "grpc", "protocol": "TCP",
                                   "appProtocol": "kubernetes.io/h2c"},
                                  {"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]}}
    return [deployment, service]
