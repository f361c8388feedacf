"""The Kubernetes manifests (deploy/k8s, pdserve/tools/deploy.py; K2, K4): the checked-in tree is the
renderer's output, every overlay builds with `kubectl kustomize` into exactly what the renderer makes
of its spec, validates against the Kubernetes schemas (kubernetes-validate, strict) and the vendored
CRD schemas (deploy/schemas), keeps the invariants a cluster relies on, and runs only flags the
real command-line parsers accept.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from k8s_pods import invocation, lws_leader_labels, parse, pod_templates

from pdserve.serving.engine_args import engine_config
from pdserve.serving.node_server import DECODE_PORT, PREFILL_PORT
from pdserve.tools import deploy
from pdserve.tools.cli import main as pdserve_main
from router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "deploy" / "schemas"
KUBERNETES_VERSION = "1.32.0"   # the oldest release the manifests target (native gRPC probes: GA in 1.27)
# Each overlay's prefill:decode ratio, written out here rather than read from the spec it checks.
RATIOS = {"1p1d": (1, 1), "1p3d": (1, 3), "2p4d": (2, 4), "tp2": (1, 1), "efa": (1, 3),
          "cpu-tcp": (1, 1), "hpa": (1, 3), "mtls": (1, 1)}
FIELDS = {"metadata.name": "pod-0", "status.podIP": "127.0.0.1"}
SERVICES = {"prefill": "pdserve.api.v1.PrefillService", "decode": "pdserve.api.v1.GenerateService",
            "router": "pdserve.api.v1.GenerateService"}


def test_every_overlay_has_its_ratio_written_here():
    assert set(RATIOS) == set(deploy.OVERLAYS)


def test_the_checked_in_tree_is_the_render():
    drift = deploy.tree_drift(K8S)
    assert not drift, f"deploy/k8s differs from `pdserve deploy tree` in {drift}; run `pdserve deploy tree`"


@cache
def kustomized(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay}: {out.stderr}"
    return tuple(yaml.safe_load_all(out.stdout))


def objects_of(overlay: str) -> list[dict[str, Any]]:
    """The overlay as kustomize builds it where kubectl exists, else as the renderer makes it (the
    test above and the one below tie the two together)."""
    if shutil.which("kubectl"):
        return [copy.deepcopy(o) for o in kustomized(overlay)]
    return deploy.render(deploy.OVERLAYS[overlay])


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_kustomize_builds_the_render_of_the_spec(overlay):
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed: the overlays are checked as rendered only")
    got = {deploy.object_key(o): o for o in kustomized(overlay)}
    want = {deploy.object_key(o): o for o in deploy.render(deploy.OVERLAYS[overlay])}
    assert sorted(got) == sorted(want)
    for key, o in want.items():
        assert got[key] == o, f"overlays/{overlay}: {key} differs from the render"


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    schemas = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        s = json.loads(path.read_text())
        schemas[(s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"])] = s
    return schemas


def validate(o: dict[str, Any]) -> None:
    schema = crd_schemas().get((o["apiVersion"], o["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(o)
    else:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


def test_every_crd_the_manifests_use_has_a_vendored_schema_with_its_source():
    sources = (SCHEMAS / "SOURCES.md").read_text()
    kinds = {(o["apiVersion"], o["kind"]) for spec in deploy.OVERLAYS.values() for o in deploy.render(spec)
             if not o["apiVersion"].startswith(("v1", "apps/", "policy/", "networking.k8s.io/", "autoscaling/"))}
    assert kinds == set(crd_schemas())
    for path in SCHEMAS.glob("*.json"):
        assert f"`{path.name}`" in sources, f"deploy/schemas/SOURCES.md does not say where {path.name} came from"


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_every_object_validates_strictly(overlay):
    for o in objects_of(overlay):
        try:
            validate(o)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
            pytest.fail(f"overlays/{overlay}: {o['kind']}/{o['metadata']['name']}: {e.message}")


@pytest.mark.parametrize(("kind", "where"), [
    ("Deployment", ("spec", "template", "spec", "containers", 0)),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0)),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate")),
    ("ScaledObject", ("spec", "triggers", 0, "metadata")),   # trigger metadata: free-form strings, allowed
    ("ScaledObject", ("spec", "scaleTargetRef")),
    ("ServiceMonitor", ("spec", "endpoints", 0)),
])
def test_strict_validation_refuses_an_unknown_field(kind, where):
    o = copy.deepcopy(next(o for o in deploy.render(deploy.OVERLAYS["tp2"]) if o["kind"] == kind))
    node = o
    for step in where:
        node = node[step]
    node["readinessprobe"] = "typo"
    if where[-1] == "metadata":   # KEDA's trigger metadata is a map of strings: any key goes
        validate(o)
        return
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(o)


# --- invariants --------------------------------------------------------------------------------------

def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def role_of(o: dict[str, Any]) -> str:
    return o["metadata"]["labels"][deploy.LABEL_ROLE]


def workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {role_of(o): o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet")}


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_replicas_match_the_ratio_and_autoscalers_start_there(overlay):
    objects = objects_of(overlay)
    w = workloads(objects)
    assert set(w) == {"prefill", "decode", "router"}
    assert (w["prefill"]["spec"]["replicas"], w["decode"]["spec"]["replicas"]) == RATIOS[overlay]
    for a in by_kind(objects, "ScaledObject"):
        target = w[role_of(a)]
        assert a["spec"]["scaleTargetRef"]["kind"] == target["kind"]
        assert a["spec"]["scaleTargetRef"]["name"] == target["metadata"]["name"]
        assert a["spec"]["minReplicaCount"] == target["spec"]["replicas"] <= a["spec"]["maxReplicaCount"]
    for a in by_kind(objects, "HorizontalPodAutoscaler"):
        target = w[role_of(a)]
        assert a["spec"]["scaleTargetRef"]["name"] == target["metadata"]["name"]
        assert a["spec"]["minReplicas"] == target["spec"]["replicas"] <= a["spec"]["maxReplicas"]
    assert len(by_kind(objects, "ScaledObject") + by_kind(objects, "HorizontalPodAutoscaler")) == 2


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_every_pod_runs_the_same_image_with_grpc_probes_on_the_right_services(overlay):
    objects = objects_of(overlay)
    images = set()
    for where, pod in pod_templates(objects):
        role = pod["metadata"]["labels"][deploy.LABEL_ROLE]
        (container,) = pod["spec"]["containers"]
        images.add(container["image"])
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert grace >= deploy.drain_seconds(), f"{where}: grace {grace} s is shorter than the drain"
        # every pod serves (no rank-only pods): it waits for its callers to drop it, then drains
        assert not where.endswith("worker"), f"{where}: a pod that serves nothing"
        hook = container["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[0] == "sleep" and int(hook[1]) + 20 <= grace, where
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        port = {"prefill": PREFILL_PORT, "decode": DECODE_PORT, "router": deploy.ROUTER_PORT}[role]
        for probe, service in (("startupProbe", ""), ("readinessProbe", SERVICES[role]),
                               ("livenessProbe", "")):
            assert probe_target(container[probe]) == (port, service), (where, probe)
        startup = container["startupProbe"]
        if role != "router":   # the model load: 15 minutes by default
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, where
    assert len(images) == 1, f"overlays/{overlay}: more than one image: {images}"


def probe_target(probe: dict[str, Any]) -> tuple[int, str]:
    """(port, service) a probe checks: a native gRPC probe, or (under mTLS) an exec probe running
    pdserve.tools.probe, whose command the real probe parser must accept."""
    if "grpc" in probe:
        assert "exec" not in probe
        return probe["grpc"]["port"], probe["grpc"]["service"]
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "pdserve.tools.probe"], command
    args = probe_parser().parse_args(command[3:])
    assert args.tls_cert and args.tls_key and args.tls_ca and args.tls_server_name, command
    return args.port, args.service


def probe_parser():
    from pdserve.tools.probe import build_parser

    parser = build_parser()
    parser.exit_on_error = False
    return parser


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _memory_gi(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_tensor_parallel_nodes_request_as_many_ranks_as_their_tp_size(overlay):
    """A node is one pod holding every rank (they share its /dev/shm, D15): it asks for TP ranks' CPU
    and memory; a TP > 1 node is a LeaderWorkerSet group of size 1, its leader rank 0."""
    spec = deploy.OVERLAYS[overlay]
    w = workloads(objects_of(overlay))
    any_tp = max(spec.role(x).tp for x in deploy.ROLES) > 1
    for role in deploy.ROLES:
        r = spec.role(role)
        (pod,) = [pod for _, pod in pod_templates([w[role]])]   # one pod per node, never one per rank
        (container,) = pod["spec"]["containers"]
        args = container["args"]
        assert ("--tensor-parallel-size=%d" % r.tp in args) == (r.tp > 1), (overlay, role, args)
        # any TP > 1 role: every node sums TP-invariantly, so TP 1 nodes match it bit for bit
        assert ("--tp-invariant" in args) == any_tp, (overlay, role, args)
        limits = container["resources"]["limits"]
        assert _cpus(limits["cpu"]) == r.tp * _cpus(r.cpu), (overlay, role, limits)
        assert _memory_gi(limits["memory"]) == r.tp * _memory_gi(r.memory), (overlay, role, limits)
        assert container["resources"]["requests"] == limits
        assert w[role]["kind"] == ("LeaderWorkerSet" if r.tp > 1 else "Deployment"), (overlay, role)
        if r.tp > 1:
            lwt = w[role]["spec"]["leaderWorkerTemplate"]
            assert lwt["size"] == 1 and "leaderTemplate" not in lwt, (overlay, role)
            assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
            rolling = w[role]["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
            assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0)
    if overlay == "tp2":
        assert spec.prefill.tp == 2 and spec.decode.tp == 1


def test_a_tp_group_asks_for_every_ranks_gpus():
    spec = dataclasses.replace(deploy.BASE, prefill=dataclasses.replace(deploy.BASE.prefill, tp=4, gpus=1))
    (pod,) = [pod for _, pod in pod_templates([workloads(deploy.render(spec))["prefill"]])]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_the_leader_pods_of_a_tp_group_are_what_its_service_pdb_policies_and_autoscaler_select():
    """tp2's prefill LeaderWorkerSet: its leader pods, with the labels the LWS controller gives them,
    are the endpoints of the role's headless Service (which the ServiceMonitor scrapes), the pods of
    its PDB and of its NetworkPolicies (as target and as the decode policy's source), and the KEDA
    target is the LeaderWorkerSet itself; the LWS's own name is not the Service's, which the
    controller would adopt."""
    objects = objects_of("tp2")
    lws = workloads(objects)["prefill"]
    leaders = [lws_leader_labels(lws, group) for group in range(lws["spec"]["replicas"])]

    def selects(selector: dict[str, str]) -> bool:
        return all(selector.items() <= labels.items() for labels in leaders)

    (service,) = [o for o in by_kind(objects, "Service") if o["metadata"]["name"] == "pdserve-prefill"]
    assert selects(service["spec"]["selector"]) and service["spec"]["selector"][deploy.LWS_WORKER_INDEX] == "0"
    assert service["metadata"]["name"] != lws["metadata"]["name"]
    (sm,) = by_kind(objects, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (pdb,) = [o for o in by_kind(objects, "PodDisruptionBudget") if role_of(o) == "prefill"]
    assert selects(pdb["spec"]["selector"]["matchLabels"])
    policies = {p["metadata"]["labels"].get(deploy.LABEL_ROLE, "*"): p for p in by_kind(objects, "NetworkPolicy")}
    assert selects(policies["prefill"]["spec"]["podSelector"]["matchLabels"])
    decode_sources = [peer["podSelector"]["matchLabels"] for rule in policies["decode"]["spec"]["ingress"]
                      for peer in rule.get("from", ()) if "podSelector" in peer]
    assert any(selects(s) for s in decode_sources), "prefill leaders may not write KV to decode nodes"
    (scaler,) = [a for a in by_kind(objects, "ScaledObject") if role_of(a) == "prefill"]
    assert scaler["spec"]["scaleTargetRef"] == {"apiVersion": deploy.LWS_API, "kind": "LeaderWorkerSet",
                                                "name": lws["metadata"]["name"]}


def test_tp_workload_deployment_runs_the_same_pod_without_the_lws_controller():
    """--tp-workload deployment: the same pod template as the LeaderWorkerSet's leader (so what the
    run test runs for tp2 is what it deploys), in a Deployment the other objects point at."""
    spec = dataclasses.replace(deploy.OVERLAYS["tp2"], tp_workload="deployment")
    objects = deploy.render(spec)
    w = workloads(objects)
    assert w["prefill"]["kind"] == "Deployment" and w["prefill"]["metadata"]["name"] == "pdserve-prefill"
    lws = workloads(deploy.render(deploy.OVERLAYS["tp2"]))["prefill"]
    assert w["prefill"]["spec"]["template"] == deploy.leader_template(lws)
    assert not by_kind(objects, "LeaderWorkerSet")
    (service,) = [o for o in by_kind(objects, "Service") if o["metadata"]["name"] == "pdserve-prefill"]
    assert service["spec"]["selector"] == w["prefill"]["spec"]["selector"]["matchLabels"]
    (scaler,) = [a for a in by_kind(objects, "ScaledObject") if role_of(a) == "prefill"]
    assert scaler["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    for o in objects:
        validate(o)


def test_efa_overlay_pins_memory_and_keeps_one_node_pod_per_host():
    objects = objects_of("efa")
    for where, pod in pod_templates(objects):
        role = pod["metadata"]["labels"][deploy.LABEL_ROLE]
        (container,) = pod["spec"]["containers"]
        if role == "router":
            assert "add" not in container["securityContext"]["capabilities"]
            continue
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"], where
        limits = container["resources"]["limits"]
        assert limits["vpc.amazonaws.com/efa"] >= 1 and "hugepages-2Mi" in limits, where
        assert {"name": "FI_PROVIDER", "value": "efa"} in container["env"], where
        assert "--provider=efa" in container["args"], where
        (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        roles = next(e for e in term["labelSelector"]["matchExpressions"] if e["key"] == deploy.LABEL_ROLE)
        assert set(roles["values"]) == {"prefill", "decode"}


def test_mtls_overlay_gives_every_process_the_secrets_and_probes_through_tls():
    spec = deploy.OVERLAYS["mtls"]
    objects = objects_of("mtls")
    for where, pod in pod_templates(objects):
        (container,) = pod["spec"]["containers"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == spec.tls_secret, where
        assert volumes["token"]["secret"]["secretName"] == spec.token_secret, where
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["tls"] == deploy.TLS_DIR and mounts["token"] == deploy.TOKEN_DIR, where
        inv = invocation(container, objects, FIELDS)
        args = parse(inv)
        assert args.tls_cert == f"{deploy.TLS_DIR}/tls.crt" and args.tls_ca == f"{deploy.TLS_DIR}/ca.crt", where
        assert args.tls_server_name == "pdserve.pdserve.svc", where
        assert args.auth_token_file == f"{deploy.TOKEN_DIR}/token", where
        assert all("exec" in container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")), where
        assert pod["spec"]["securityContext"]["fsGroup"] == 10001, where   # the Secret files are group-readable


def test_cpu_tcp_overlay_uses_tcp_and_no_rdma_device():
    for where, pod in pod_templates(objects_of("cpu-tcp")):
        (container,) = pod["spec"]["containers"]
        if pod["metadata"]["labels"][deploy.LABEL_ROLE] == "router":
            continue
        assert "--provider=tcp;ofi_rxm" in container["args"], where
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}, where
        assert "add" not in container["securityContext"]["capabilities"], where


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_autoscaler_queries_pin_the_namespace_and_the_role(overlay):
    objects = objects_of(overlay)
    ns = deploy.OVERLAYS[overlay].namespace
    for a in by_kind(objects, "ScaledObject"):
        role = role_of(a)
        queries = [t["metadata"]["query"] for t in a["spec"]["triggers"]]
        assert queries and all(q.startswith("sum(") and q.endswith(" or vector(0)") for q in queries)
        assert all(f'namespace="{ns}"' in q for q in queries)
        # each role scales on its own engines' queue (prefill also on the decode side's wait for its KV)
        assert f'pdserve:num_requests_waiting{{namespace="{ns}",role="{role}"}}' in queries[0]
    for a in by_kind(objects, "HorizontalPodAutoscaler"):
        for m in a["spec"]["metrics"]:
            labels = m["external"]["metric"]["selector"]["matchLabels"]
            assert labels["namespace"] == ns and labels["role"] in deploy.ROLES


def test_queue_metrics_the_autoscalers_read_exist():
    from pdserve.serving.metrics.engine_collector import GAUGES

    exported = {name for name, _, _ in GAUGES}
    for role in deploy.ROLES:
        for q in deploy.queue_queries(deploy.BASE, role).values():
            metric = q.removeprefix("sum(").split("{", 1)[0]
            assert metric in exported, f"{role} autoscaler reads {metric}, which no engine exports"


def test_service_monitor_labels_series_with_the_role_the_queries_pin():
    (sm,) = by_kind(objects_of("1p1d"), "ServiceMonitor")
    for endpoint in sm["spec"]["endpoints"]:
        (relabel,) = endpoint["relabelings"]
        assert relabel["targetLabel"] == "role"
        assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]


def test_network_policies_let_only_the_router_reach_decode_and_only_decode_reach_prefill():
    objects = objects_of("1p1d")
    policies = {p["spec"]["podSelector"].get("matchLabels", {}).get(deploy.LABEL_ROLE, "*"): p
                for p in by_kind(objects, "NetworkPolicy")}
    assert policies["*"]["spec"]["ingress"] == []   # default deny

    def sources(role: str, port: int) -> set[str]:
        out = set()
        for rule in policies[role]["spec"]["ingress"]:
            if any(p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"]):
                for peer in rule["from"]:
                    out.add(peer["podSelector"]["matchLabels"][deploy.LABEL_ROLE] if "podSelector" in peer
                            else "monitoring")
        return out

    low, high = deploy.BASE.fabric_ports
    assert sources("decode", DECODE_PORT) == {"router"}
    assert sources("prefill", PREFILL_PORT) == {"decode"}
    assert sources("decode", low) == {"prefill"} and sources("prefill", high) == {"decode"}
    assert sources("decode", deploy.NODE_METRICS_PORT) == {"monitoring"}
    for where, pod in pod_templates(objects):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        if pod["metadata"]["labels"][deploy.LABEL_ROLE] != "router":
            assert (env["FI_TCP_PORT_LOW_RANGE"], env["FI_TCP_PORT_HIGH_RANGE"]) == (str(low), str(high)), where


# --- the containers' command lines against the real parsers --------------------------------------------

def has_option(module: str, option: str) -> bool:
    from k8s_pods import parser_of

    return any(option in a.option_strings for a in parser_of(module)._actions)


@pytest.mark.parametrize("overlay", sorted(deploy.OVERLAYS))
def test_every_container_arg_is_a_flag_the_real_parser_accepts(overlay):
    objects = objects_of(overlay)
    for where, pod in pod_templates(objects):
        (container,) = pod["spec"]["containers"]
        inv = invocation(container, objects, FIELDS)
        if any(a.startswith("--tensor-parallel-size") for a in inv.args) and not has_option(
                inv.module, "--tensor-parallel-size"):
            pytest.skip(f"{where}: python -m {inv.module} has no --tensor-parallel-size yet (issue 16)")
        args = parse(inv)
        if inv.module == "router":
            RouterConfig(host=args.host, port=args.port, decode_nodes=args.decode)
            assert args.decode.startswith("dns:"), where
        else:
            engine_config(args)   # the ConfigMap's engine values are valid, not only well-formed
            assert args.node_id == FIELDS["metadata.name"] and args.fabric_node == FIELDS["status.podIP"]
            if inv.module == "decode_node":
                assert args.prefill == f"dns:{deploy.OVERLAYS[overlay].service_host('prefill')}:{PREFILL_PORT}"


def test_a_renamed_flag_fails_the_check():
    objects = deploy.render(deploy.BASE)
    (decode,) = [o for o in objects if o["kind"] == "Deployment" and role_of(o) == "decode"]
    container = decode["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [a.replace("--prefill=", "--prefill-nodes=") for a in container["args"]]
    with pytest.raises(AssertionError, match="refuses"):
        parse(invocation(container, objects, FIELDS))
    # and a ConfigMap key that a container reads but nobody wrote
    container["env"][-1]["valueFrom"]["configMapKeyRef"]["key"] = "decode.no-such-flag"
    with pytest.raises(AssertionError, match="no key"):
        invocation(container, objects, FIELDS)


def test_render_command_makes_any_ratio():
    out = io.StringIO()
    with redirect_stdout(out):
        rc = pdserve_main(["deploy", "render", "--prefill", "3", "--decode", "5", "--decode-tp", "2",
                           "--namespace", "llm", "--decode-engine", "num-blocks=4096"])
    assert rc == 0
    objects = list(yaml.safe_load_all(out.getvalue()))
    w = workloads(objects)
    assert w["prefill"]["spec"]["replicas"] == 3 and w["prefill"]["kind"] == "Deployment"
    assert w["decode"]["spec"]["replicas"] == 5 and w["decode"]["kind"] == "LeaderWorkerSet"
    assert w["decode"]["spec"]["leaderWorkerTemplate"]["size"] == 1
    assert all(o["metadata"].get("namespace", "llm") == "llm" for o in objects)
    (cm,) = by_kind(objects, "ConfigMap")
    assert cm["data"]["decode.num-blocks"] == "4096"
    for o in objects:
        validate(o)


def test_spec_refuses_what_cannot_be_deployed():
    with pytest.raises(ValueError, match="efa_devices"):
        deploy.DeploySpec(provider="efa", efa_devices=0)
    with pytest.raises(ValueError, match="replicas"):
        deploy.RoleSpec(replicas=0)
    with pytest.raises(ValueError, match="provider"):
        deploy.DeploySpec(provider="shm")   # one host only: never across pods
    with pytest.raises(ValueError, match="without dashes"):
        deploy.RoleSpec(engine=(("--num-blocks", "1"),))
    with pytest.raises(ValueError, match="tp_workload"):
        deploy.DeploySpec(tp_workload="pod-per-rank")   # ranks share one pod's memory (D15)


def test_the_exec_probe_checks_a_real_mtls_server(tmp_path):
    """pdserve.tools.probe (the mTLS overlay's probe) against a real mTLS server: SERVING with the pod's
    certificate, refused without it; an unknown service is not SERVING."""
    from concurrent import futures

    from grpc import server as grpc_server
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from support.net import free_port

    from pdserve.serving.channels import ChannelSecurity, add_server_port
    from pdserve.tools.certs import make_pki

    pki = make_pki(tmp_path / "pki", ["pdserve.pdserve.svc"], hosts=["127.0.0.1"])
    pair = pki["pdserve.pdserve.svc"]
    security = ChannelSecurity.load(cert_file=pair.cert, key_file=pair.key, ca_file=pki.ca)
    server = grpc_server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set(deploy.READINESS_SERVICES["decode"], health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_server_port(server, f"127.0.0.1:{free_port()}", security)
    server.start()
    try:
        tls = [f"--tls-cert={pair.cert}", f"--tls-key={pair.key}", f"--tls-ca={pki.ca}",
               "--tls-server-name=pdserve.pdserve.svc"]

        def probe(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "pdserve.tools.probe", f"--port={port}", *args],
                                  capture_output=True, text=True, timeout=60, cwd=ROOT)

        ok = probe(f"--service={deploy.READINESS_SERVICES['decode']}", *tls)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
        assert probe("--service=pdserve.api.v1.Nothing", *tls).returncode == 1
        plaintext = probe(f"--service={deploy.READINESS_SERVICES['decode']}", "--timeout=2")
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stdout, plaintext.stdout
    finally:
        server.stop(0)
