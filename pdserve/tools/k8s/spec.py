"""The typed spec of a Kubernetes deployment: `RoleSpec`, `DeploySpec` and the ports, paths and labels
every rendered object shares (pdserve deploy, pdserve.tools.deploy; K2, K4).

Validated when built (a ValueError naming the offending value). The checked-in specs (`BASE`, the
`OVERLAYS`) are in pdserve.tools.deploy. Threads: none; no blocking waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# A deleted pod leaves its Service's DNS records at once, but SIGTERM would make it refuse new work
# before every caller has resolved again (each poll round, 1 s; CoreDNS answers with a 5 s TTL): the
# preStop hook keeps it serving this long first, so callers drop it before it drains.
PRESTOP_S = 5


def drain_seconds() -> int:
    """What a pod's termination may take: the preStop wait, then the node's SIGTERM path
    (node_server: health NOT_SERVING, drain, server stop with STOP_GRACE_S, node close: engine stop
    and the fabric's close bound), rounded up, plus a margin."""
    return PRESTOP_S + int(math.ceil(STOP_GRACE_S + FabricConfig().close_timeout_s)) + 20



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
