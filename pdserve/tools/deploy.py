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

This module is the public path and holds the checked-in specs (`BASE`, `OVERLAYS`) and the command
line; the rendering is one job a module in pdserve.tools.k8s (spec: the typed spec and shared
constants; pods: workloads, pod templates and the router; objects: `render`, every object in apply
order; kustomize: the tree and its JSON patches), every name re-exported here.

Threads: none; called by the CLI's main thread or a test. No blocking waits (tree writes files).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.tools.k8s import spec as _spec
from pdserve.tools.k8s.kustomize import HEADER, files_drift, json_patch, object_key, render_tree, write_files
from pdserve.tools.k8s.objects import queue_queries, render, to_yaml
from pdserve.tools.k8s.pods import leader_template, node_args, router_args, security_args
from pdserve.tools.k8s.spec import AUTOSCALERS, PROVIDERS, ROLES, TP_WORKLOADS, DeploySpec, RoleSpec

# The spec module's constants and `drain_seconds`, re-exported under this public path (callers and
# tests read deploy.LABEL_ROLE, deploy.TLS_DIR, ...): the same objects, bound here by name.
_SPEC_REEXPORTS = ("DECODE_PORT", "LABEL_NAME", "LABEL_PART", "LABEL_ROLE", "LWS_API", "LWS_GROUP_INDEX",
                   "LWS_GROUP_KEY", "LWS_NAME", "LWS_WORKER_INDEX", "MODEL_CACHE", "NODE_METRICS_PORT",
                   "PREFILL_PORT", "PRESTOP_S", "PYTHON", "READINESS_SERVICES", "ROLE_MODULES", "ROLE_PORTS",
                   "ROUTER_HTTP_PORT", "ROUTER_PORT", "TLS_DIR", "TOKEN_DIR", "drain_seconds")
globals().update({name: getattr(_spec, name) for name in _SPEC_REEXPORTS})

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


# --- the kustomize tree ------------------------------------------------------------------------------

def tree() -> dict[str, str]:
    """Relative path under deploy/k8s -> file text: base/ (`BASE`) and overlays/NAME/ (`OVERLAYS`),
    see the module docstring."""
    return render_tree(BASE, OVERLAYS)


def default_root() -> Path:
    return Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def tree_drift(root: Path) -> list[str]:
    """Files under `root` that differ from `tree()` (missing, changed, or not rendered any more)."""
    return files_drift(root, tree())


def write_tree(root: Path) -> list[str]:
    """Write `tree()` under `root`, removing rendered files no longer rendered; returns what changed."""
    return write_files(root, tree())


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


__all__ = ["AUTOSCALERS", "HEADER", "PROVIDERS", "ROLES", "TP_WORKLOADS", *_SPEC_REEXPORTS,
           "BASE", "OVERLAYS", "DeploySpec", "RoleSpec", "add_deploy_parser", "json_patch",
           "leader_template", "node_args", "object_key", "queue_queries", "render", "router_args", "security_args",
           "to_yaml", "tree", "tree_drift", "write_tree"]
