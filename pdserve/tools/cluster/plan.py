"""The plan of a local cluster: one `ProcessSpec` per child, in start order, with every flag it gets
(pdserve.tools.launcher starts them).

Processes: the prefill nodes (`python -m prefill_node`), the decode nodes (`python -m decode_node
--prefill <every prefill address>`, or `--colocated`), then the router (`python -m router --decode
<every decode address> --http-port <P>`).

Ports: every port given as 0 (router gRPC, router HTTP) and each node's `--metrics-port` (with
node_metrics, the default) is chosen free here, before the start, and passed explicitly, so the
cluster's `url`, `http_url` and `metrics_urls` are known up front. With `pin_cores`, node i runs on
its own `threads_per_node` cores (the i-th slice of the launcher's allowed CPUs, set by the child at
its start: pdserve.tools.cluster.child); the router is not pinned. Too few cores for every node is
a ValueError naming the counts.

Tensor parallelism: when any node runs TP > 1, every node also gets `--tp-invariant` (before
engine_args, so an explicit `--no-tp-invariant` there wins): the engine's default folds in blocks
only above TP 1, and a TP 1 decode node behind TP 2 prefill nodes must sum as they do for the KV it
receives and the KV it computes to agree (EngineConfig.tp_invariant). `pin_cores` still gives each
node `threads_per_node` cores; a TP N node's worker ranks are not pinned apart from them.

Speculative decoding: `--speculative-config JSON` goes to every decode and colocated node, never to
a prefill node (it never decodes). With an eagle head every node also gets `--context-history-rows
128` (EAGLE_HISTORY_ROWS): prefill nodes hand decode nodes the prompt's last 128 hidden states in
the context record, from which the decode node's head writes its history.

Security: with tls / auth_token, each child's flags name its certificate (named after it) and the
token in the cluster's security folder (made by Cluster.start, pdserve.tools.cluster.running).

Threads: none; called by the caller's thread. No blocking waits (free ports are bound and released).
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS
from pdserve.tools.cluster.config import SPEC_FLAG, ClusterConfig, engine_args_tp


@dataclass(frozen=True)
class ProcessSpec:
    """One child process: name (log file stem and node id), role, listening address, command line.

    http_port: the router's HTTP API port, a node's metrics port (None: none). cpus: the cores the
    child is pinned to (empty: not pinned)."""

    name: str
    role: str  # "prefill", "decode", "colocated", "router"
    host: str
    port: int
    argv: tuple[str, ...]
    http_port: int | None = None
    cpus: tuple[int, ...] = ()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        """http://HOST:PORT of the child's HTTP server (router: the API; node: its /metrics)."""
        if self.http_port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"

    @property
    def command(self) -> str:
        """The shell command line (with the pinning as `taskset -c`, which does the same)."""
        line = shlex.join(self.argv)
        return f"taskset -c {','.join(map(str, self.cpus))} {line}" if self.cpus else line


def free_ports(count: int, host: str = "127.0.0.1", exclude: Sequence[int] = ()) -> list[int]:
    """`count` distinct TCP ports free on `host` now (bound to port 0 and released; a race is possible
    but unlikely), none of them in `exclude`."""
    ports: list[int] = []
    sockets: list[socket.socket] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for s in sockets:
            s.close()
    return ports


def cluster_runs_tp(config: ClusterConfig) -> bool:
    """Whether any node of the cluster runs tensor_parallel_size > 1 (then every node gets --tp-invariant)."""
    sizes = [engine_args_tp(config.engine_args) or 1]
    if not config.colocated:
        sizes.append(config.prefill_tp or 1)
    sizes.append(config.decode_tp or 1)
    return max(sizes) > 1


def _engine_flags(config: ClusterConfig) -> list[str]:
    flags: list[str] = []
    if cluster_runs_tp(config):
        # TP 1 nodes sum as the TP > 1 ones do, so KV and logits agree bit for bit across the cluster
        # (EngineConfig.tp_invariant); before engine_args, so an explicit --no-tp-invariant there wins.
        flags.append("--tp-invariant")
    if config.model:
        flags += ["--model", config.model]
    if config.num_blocks is not None:
        flags += ["--num-blocks", str(config.num_blocks)]
    if config.threads_per_node is not None:
        flags += ["--threads", str(config.threads_per_node)]
    spec = config.speculative_config
    if spec is not None and spec.method == "eagle" and config.prefill:
        # the decode nodes' head writes its history from the prompt's last hidden states, which every
        # node's context record then carries (both sides' KV layout: prefill and decode nodes alike)
        flags += ["--context-history-rows", str(EAGLE_HISTORY_ROWS)]
    return flags + list(config.engine_args)


def _spec_flags(config: ClusterConfig) -> list[str]:
    """`--speculative-config JSON` for a decode or colocated node (none without a speculative_config)."""
    spec = config.speculative_config
    return [] if spec is None else [SPEC_FLAG, spec.to_json()]


def _tp_flags(tp: int | None) -> list[str]:
    return [] if tp is None else ["-tp", str(tp)]


def core_slices(num_nodes: int, per_node: int, available: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Disjoint sets of `per_node` cores for `num_nodes` nodes, taken in order from `available`
    (default: the cores this process may run on). Raises ValueError naming the counts when short."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    need = num_nodes * per_node
    if need > len(cores):
        raise ValueError(f"pinning {num_nodes} nodes to {per_node} cores each needs {need} cores, but this "
                         f"process may use only {len(cores)} ({','.join(map(str, cores))}); lower "
                         "threads_per_node or the node counts, or drop pin_cores")
    return [tuple(cores[i * per_node:(i + 1) * per_node]) for i in range(num_nodes)]


SECURITY_DIR = "security"       # under the log dir: certificates, keys and the token of a secured cluster
TOKEN_FILE = "token"
CLIENT_CERT = "client"          # the certificate name a secured cluster makes for its clients


def _security_flags(config: ClusterConfig, security_dir: str | None, name: str) -> list[str]:
    """The TLS / token flags of child `name` (none unless config.tls or config.auth_token)."""
    if not (config.tls or config.auth_token):
        return []
    if security_dir is None:
        raise ValueError("a cluster with tls or auth_token needs the folder of its certificates (security_dir)")
    d = Path(security_dir)
    flags: list[str] = []
    if config.tls:
        flags += ["--tls-cert", str(d / f"{name}.pem"), "--tls-key", str(d / f"{name}.key"),
                  "--tls-ca", str(d / "ca.pem")]
    if config.auth_token:
        flags += ["--auth-token-file", str(d / TOKEN_FILE)]
    return flags


def plan(config: ClusterConfig, ports: Sequence[int] | None = None,
         cores: Sequence[int] | None = None, security_dir: str | None = None) -> list[ProcessSpec]:
    """The processes to start, in order. ports: one per node, then the router's when config.port is 0,
    then the HTTP API's when config.http_port is 0, then one metrics port per node when
    config.node_metrics (default: fresh free ports). cores: the CPUs to pin nodes to with
    config.pin_cores (default: this process's allowed CPUs). security_dir: where the certificates
    and token of a cluster with tls / auth_token are (made by Cluster.start)."""
    n_nodes = config.num_nodes
    need = n_nodes + (config.port == 0) + (config.http_port == 0) + (n_nodes if config.node_metrics else 0)
    fixed = tuple(p for p in (config.port, config.http_port) if p)
    ports = list(ports) if ports is not None else free_ports(need, config.host, exclude=fixed)
    if len(ports) < need:
        raise ValueError(f"plan needs {need} ports, got {len(ports)}: {ports}")
    pinned = core_slices(n_nodes, config.threads_per_node or 1, cores) if config.pin_cores else [()] * n_nodes
    py = sys.executable
    engine = _engine_flags(config)
    common = ["--host", config.host, "--log-format", config.log_format]
    nodes: list[tuple[str, str, int, list[str]]] = []  # name, role, port, argv
    it = iter(ports)
    if config.colocated:
        for i in range(config.colocated):
            port = next(it)
            name = f"colocated-{i}"
            argv = [py, "-m", "decode_node", *common, "--port", str(port), "--node-id", name, "--colocated",
                    *_tp_flags(config.decode_tp), *engine, *_spec_flags(config),
                    *_security_flags(config, security_dir, name)]
            nodes.append((name, "colocated", port, argv))
    else:
        fabric = ["--provider", config.provider, "--fabric-node", config.host]
        for i in range(config.prefill):
            port = next(it)
            name = f"prefill-{i}"
            argv = [py, "-m", "prefill_node", *common, "--port", str(port), "--node-id", name, *fabric,
                    *_tp_flags(config.prefill_tp), *engine,
                    *_security_flags(config, security_dir, name)]
            nodes.append((name, "prefill", port, argv))
        prefill_addrs = ",".join(f"{config.host}:{port}" for _, _, port, _ in nodes)
        for i in range(config.decode):
            port = next(it)
            name = f"decode-{i}"
            argv = [py, "-m", "decode_node", *common, "--port", str(port), "--node-id", name, *fabric,
                    "--prefill", prefill_addrs, "--prefill-routing", config.routing, *_tp_flags(config.decode_tp),
                    *(["--kv-checksum"] if config.kv_checksum else []), *engine, *_spec_flags(config),
                    *_security_flags(config, security_dir, name), *config.decode_args]
            nodes.append((name, "decode", port, argv))
    router_port = config.port or next(it)
    http_port = config.http_port if config.http_port != 0 else next(it)
    specs: list[ProcessSpec] = []
    for (name, role, port, argv), cpus in zip(nodes, pinned, strict=True):
        metrics_port = next(it) if config.node_metrics else None
        if metrics_port is not None:
            argv = [*argv, "--metrics-port", str(metrics_port)]
        specs.append(ProcessSpec(name, role, config.host, port, tuple(argv), metrics_port, tuple(cpus)))
    decode_addrs = ",".join(s.address for s in specs if s.role != "prefill")
    argv = [py, "-m", "router", *common, "--port", str(router_port), "--decode", decode_addrs,
            "--health-interval", str(config.router_health_interval_s), "--routing", config.routing,
            *_security_flags(config, security_dir, "router"), *config.router_args]
    if http_port is not None:
        argv += ["--http-port", str(http_port)]
    specs.append(ProcessSpec("router", "router", config.host, router_port, tuple(argv), http_port))
    return specs
