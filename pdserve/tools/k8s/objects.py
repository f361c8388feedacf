"""Every object of a deployment's namespace, in apply order (`render`): the pods (pdserve.tools.k8s.pods)
plus headless Services, PodDisruptionBudgets, a ServiceMonitor, autoscaling per role on queue depth
(KEDA ScaledObjects, or HPAs on external metrics) and NetworkPolicies (only the router reaches
decode nodes, only decode nodes reach prefill nodes; the fabric's TCP port range between the two
roles). Threads: none; no blocking waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from pdserve.tools.k8s.pods import engine_config_map, node_workload, object_meta, pod_labels, router_objects
from pdserve.tools.k8s.spec import (
    DECODE_PORT,
    LABEL_NAME,
    LABEL_PART,
    LABEL_ROLE,
    LWS_API,
    LWS_WORKER_INDEX,
    NODE_METRICS_PORT,
    PREFILL_PORT,
    ROLE_PORTS,
    ROLES,
    ROUTER_HTTP_PORT,
    ROUTER_PORT,
    DeploySpec,
)


def _headless_service(spec: DeploySpec, role: str) -> dict[str, Any]:
    selector = dict(pod_labels(spec, role))
    if spec.lws_group(role):
        selector[LWS_WORKER_INDEX] = "0"   # a group's leader (rank 0) serves the node's API
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(spec, f"{spec.name}-{role}", role),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": False, "selector": selector,
                     "ports": [{"name": "grpc", "port": ROLE_PORTS[role], "targetPort": "grpc", "protocol": "TCP"},
                               {"name": "metrics", "port": NODE_METRICS_PORT, "targetPort": "metrics",
                                "protocol": "TCP"}]}}



def _pdb(spec: DeploySpec, role: str) -> dict[str, Any]:
    selector = dict(pod_labels(spec, role))
    if role != "router" and spec.lws_group(role):
        selector[LWS_WORKER_INDEX] = "0"
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_meta(spec, f"{spec.name}-{role}", role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}


def _service_monitor(spec: DeploySpec) -> dict[str, Any]:
    # role and namespace become labels of every series, which the autoscalers' queries pin.
    relabel = [{"sourceLabels": [f"__meta_kubernetes_pod_label_{LABEL_ROLE.replace('.', '_').replace('/', '_')}"],
                "targetLabel": "role", "action": "replace"}]
    endpoints = [{"port": port, "path": "/metrics", "interval": "15s", "relabelings": relabel}
                 for port in ("metrics", "http")]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": object_meta(spec, spec.name, None),
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
                "metadata": object_meta(spec, f"{spec.name}-{role}", role),
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
            "metadata": object_meta(spec, f"{spec.name}-{role}", role),
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
                "metadata": object_meta(spec, f"{spec.name}-{name}", role),
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
        engine_config_map(spec)]
    for role in ("prefill", "decode"):
        objects += [_headless_service(spec, role), node_workload(spec, role), _pdb(spec, role)]
    objects += router_objects(spec)
    objects.append(_pdb(spec, "router"))
    objects.append(_service_monitor(spec))
    if spec.autoscaler != "none":
        objects += [_autoscaler(spec, role) for role in ROLES]
    objects += _network_policies(spec)
    return objects


def to_yaml(objects: Iterable[Mapping[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(dict(o), sort_keys=False, width=120) for o in objects)
