"""`pdserve up`: a whole cluster on one machine (K1, D1, D18), and the `Cluster` Python API.

    with Cluster(prefill=1, decode=2, engine_args=("--num-blocks", "256", "--threads", "1")) as cluster:
        client = Client(cluster.url)                       # gRPC
        openai.OpenAI(base_url=f"{cluster.http_url}/v1")   # OpenAI-compatible HTTP

    pdserve up [--prefill N] [--decode M | --colocated M] [--model PATH] [--port 50051] [--http-port 8000]
               [--threads-per-node T [--pin-cores]] ...

Processes, started in this order, each waited for until its grpc.health.v1 Check ("") answers
SERVING: the prefill nodes (`python -m prefill_node`), the decode nodes (`python -m decode_node
--prefill <every prefill address>`, or `--colocated`), then the router (`python -m router --decode
<every decode address> --http-port <P>`). Each child writes stdout and stderr to `<log_dir>/<name>.log`. A child
that exits or misses the startup deadline fails the start with its name and the tail of its log,
and every other child is stopped. Stopping: SIGTERM to every child (router first), then SIGKILL
to any still running after `stop_timeout_s`. On Linux a child also gets SIGTERM when the launcher
dies (PR_SET_PDEATHSIG), so a killed test run leaves no orphans.

Spawning (`spawn`): no preexec_fn. A preexec_fn makes subprocess run the launcher's Python at-fork
handlers around a real fork(), and gRPC's (with GRPC_ENABLE_FORK_SUPPORT) can block there for good
in a process whose gRPC threads are busy (a cluster test once hung inside Popen). Instead the child
sets itself up: it starts as `python -m pdserve.tools.launcher --parent-pid P [--cpus C] -m MODULE ARGS`
(`child_command`), which asks for PR_SET_PDEATHSIG, exits if the launcher is already gone, pins
itself with sched_setaffinity, and only then runs MODULE as __main__ (`child_main`), before any
thread of the child exists. Without a preexec_fn, Popen runs no Python code between fork and exec
(vfork where CPython can), so the launcher's gRPC state, fork support on or off, is never involved.

Ports: every port given as 0 (router gRPC, router HTTP) and each node's `--metrics-port` (with
node_metrics, the default) is chosen free by the launcher before the start and passed explicitly,
so `url`, `http_url` and `metrics_urls` are known up front. With
`pin_cores`, node i runs on its own `threads_per_node` cores (the i-th slice of the launcher's
allowed CPUs, set with sched_setaffinity by the child at its start, see Spawning); the router is not
pinned. Too few cores for every node is a ValueError naming the counts.

Tensor parallelism: `prefill_tp` / `decode_tp` (`--prefill-tp N`, `--decode-tp M`, `--tp N` for
both) give each node `-tp N` (or engine_args give every node the same size; both at once is a
ValueError). When any node runs TP > 1, every node also gets `--tp-invariant` (before engine_args,
so an explicit `--no-tp-invariant` there wins): the engine's default folds in blocks only above
TP 1, and a TP 1 decode node behind TP 2 prefill nodes must sum as they do for the KV it receives
and the KV it computes to agree (EngineConfig.tp_invariant). `pin_cores` still gives each node
`threads_per_node` cores; a TP N node's worker ranks are not pinned apart from them.

Speculative decoding (E20): `speculative_config` (`--speculative-config JSON`, vLLM's form, e.g.
'{"method": "ngram", "num_speculative_tokens": 4}') is parsed with SpeculativeConfig.parse when the
ClusterConfig is made, so a bad one is a ValueError (its own message) before any process starts (what
needs the model, e.g. self_draft_layers beyond its depth, fails that node's start: ClusterStartError
with its log), and is passed as `--speculative-config` to every decode and colocated node, never to a
prefill node (it never decodes). With an eagle head every node also gets `--context-history-rows
128` (EAGLE_HISTORY_ROWS): prefill nodes hand decode nodes the prompt's last 128 hidden states in
the context record, from which the decode node's head writes its history. engine_args go to every
node, so `--speculative-config` there is refused (a ValueError pointing here) rather than also
reaching the prefill nodes; there is one way to give it.

Security (S9): with `tls`, the start makes a throwaway CA and one certificate per child (named
after it: prefill-0, decode-0, router) plus one for clients ("client"), in `<log_dir>/security/`
(pdserve.tools.certs; the CA key is deleted once they are signed), and every child serves mTLS
and calls the others with its own certificate; with `auth_token`, a random token is written to
`<log_dir>/security/token` (owner-only) and every child checks and sends it. `client_security`
is what a client of the cluster needs (Client(url, security=cluster.client_security)).

Blocking waits: each child's start, until startup_timeout_s in all (health polls of 1 s); a stop,
stop_timeout_s before SIGKILL; making the certificates, each openssl run at most
certs.OPENSSL_TIMEOUT_S.

Threads: none of its own. `Cluster` is driven by the caller's thread; `cmd_up` waits in the main
thread for SIGINT/SIGTERM (or a child's unexpected exit).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import runpy
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS, SpeculativeConfig
from pdserve.serving.channels import PLAINTEXT, TOKEN_ENV, ChannelSecurity, open_sync_channel, security_argv
from pdserve.serving.logs import FORMATS
from pdserve.tools.certs import make_pki
from router.policy import POLICIES

logger = logging.getLogger(__name__)

PROVIDERS = ("shm", "tcp;ofi_rxm", "tcp")
SPEC_FLAG = "--speculative-config"  # the engine flag (pdserve.serving.engine_args) a decoding node gets
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class ClusterConfig:
    """What to start. prefill/decode: disaggregated node counts; colocated: colocated decode nodes
    (exclusive with prefill/decode). port: the router's gRPC port (0: any free port). http_port: the
    router's OpenAI-compatible HTTP port (0: any free port, the default here so that clusters started
    from Python never collide; `pdserve up` defaults to 8000; None: no HTTP API). engine_args: extra
    engine flags given to every node (e.g. ("--max-batch-tokens", "32")); router_args: extra router
    flags (e.g. ("--max-inflight-requests", "64")). log_dir: None makes a temp
    dir. pin_cores: pin node i to its own threads_per_node cores (needs threads_per_node).
    node_metrics: give every node a free `--metrics-port` (each node serves its own /metrics there;
    `Cluster.metrics_urls` lists them with the router's). routing: the router's decode-node policy,
    "least-loaded" or "prefix" (prefix-aware; decode nodes of a disaggregated cluster then also
    prefer the prefill node that was sent a prompt's prefix). log_format: "text" or "json" lines
    for every process. tls: mTLS between every process, with certificates made for this cluster;
    auth_token: a shared token on every gRPC call (see Security). prefill_tp / decode_tp: each
    prefill / decode (or colocated) node's tensor_parallel_size (`-tp N`; None: engine_args or 1);
    see Tensor parallelism. kv_checksum: decode nodes verify the CRC32C of every landed KV run
    before scheduling (`--kv-checksum`, S7). speculative_config: speculative decoding on every decode and
    colocated node (a SpeculativeConfig, its dict or its JSON; parsed and validated here, kept as a
    SpeculativeConfig; see Speculative decoding)."""

    prefill: int | None = None
    decode: int | None = None
    colocated: int = 0
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 0
    provider: str = "shm"
    threads_per_node: int | None = None
    num_blocks: int | None = None
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()    # extra flags of every decode node only (e.g. --rotate-key-after 2)
    log_dir: str | None = None
    router_health_interval_s: float = 1.0
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    pin_cores: bool = False
    node_metrics: bool = True
    routing: str = "least-loaded"
    log_format: str = "text"
    tls: bool = False
    auth_token: bool = False
    prefill_tp: int | None = None
    decode_tp: int | None = None
    kv_checksum: bool = False
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_args", tuple(self.engine_args))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        given = [a for a in self.engine_args if a == SPEC_FLAG or a.startswith(SPEC_FLAG + "=")]
        if given:
            raise ValueError(f"engine_args go to every node, prefill nodes included, and give {given[0]!r}: pass "
                             "speculative_config (pdserve up --speculative-config JSON) instead, which goes to the "
                             "decode and colocated nodes only")
        object.__setattr__(self, "router_args", tuple(self.router_args))
        if self.colocated and (self.prefill or self.decode):
            raise ValueError(f"colocated nodes replace prefill/decode nodes: got colocated={self.colocated} "
                             f"with prefill={self.prefill}, decode={self.decode}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {POLICIES}, got {self.routing!r}")
        if self.log_format not in FORMATS:
            raise ValueError(f"log_format must be one of {FORMATS}, got {self.log_format!r}")
        default = 0 if self.colocated else 1  # unset counts: 1P:1D, or none beside colocated nodes
        for name in ("prefill", "decode"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("prefill", "decode", "colocated"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not self.colocated:
            if self.decode < 1:
                raise ValueError(f"a cluster needs at least one decode node (or --colocated M), "
                                 f"got decode={self.decode}")
            if self.prefill < 1:
                raise ValueError(f"a disaggregated cluster needs at least one prefill node, got prefill={self.prefill} "
                                 "(use --colocated M for nodes that prefill themselves)")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}, got {self.provider!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in 0..65535 (or None: no HTTP API), got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"the router's gRPC and HTTP ports must differ, both are {self.port}")
        given_tp = _engine_args_tp(self.engine_args)
        if given_tp is not None and (self.prefill_tp is not None or self.decode_tp is not None):
            raise ValueError(f"engine_args set the tensor-parallel size ({given_tp}) for every node: give either "
                             f"that or prefill_tp / decode_tp ({self.prefill_tp} / {self.decode_tp}), not both")
        for name in ("threads_per_node", "num_blocks", "prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got startup {self.startup_timeout_s}, stop {self.stop_timeout_s}")
        if self.pin_cores and self.threads_per_node is None:
            raise ValueError("pin_cores needs threads_per_node (the cores each node gets)")

    @property
    def num_nodes(self) -> int:
        return self.colocated if self.colocated else self.prefill + self.decode

    @property
    def description(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated"
        return f"{self.prefill} prefill, {self.decode} decode, provider {self.provider}"


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


def _engine_args_tp(engine_args: Sequence[str]) -> int | None:
    """The tensor-parallel size that engine_args give every node (-tp N, --tensor-parallel-size[=]N; the
    last one wins, as argparse takes it); None when they give none. Raises ValueError on a non-integer."""
    tp: str | None = None
    for i, arg in enumerate(engine_args):
        if arg in ("-tp", "--tensor-parallel-size") and i + 1 < len(engine_args):
            tp = engine_args[i + 1]
        elif arg.startswith("--tensor-parallel-size="):
            tp = arg.split("=", 1)[1]
    try:
        return None if tp is None else int(tp)
    except ValueError:
        raise ValueError(f"engine_args: tensor-parallel size must be an integer, got {tp!r}") from None


def cluster_runs_tp(config: ClusterConfig) -> bool:
    """Whether any node of the cluster runs tensor_parallel_size > 1 (then every node gets --tp-invariant)."""
    sizes = [_engine_args_tp(config.engine_args) or 1]
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


class ClusterStartError(RuntimeError):
    """A child failed to start: its name, why, and the tail of its log are in the message."""


def _child_env() -> dict[str, str]:
    """The environment of a child: unbuffered output, and this source tree importable (router,
    prefill_node and decode_node live beside pdserve/ and may postdate an editable install)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(TOKEN_ENV, None)   # a cluster's token is its own (auth_token), never one inherited by accident
    root = str(Path(__file__).resolve().parents[1])
    if (Path(root) / "router").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


PR_SET_PDEATHSIG = 1
CHILD_ENTRY = "pdserve.tools.launcher"  # `python -m pdserve.tools.launcher ...` runs child_main


def child_command(argv: Sequence[str], parent_pid: int, cpus: Sequence[int] = ()) -> list[str]:
    """The command line that runs `argv` ([python, "-m", MODULE, ARGS...] or [python, "-c", CODE,
    ARGS...]) as a child of the process `parent_pid`: the same interpreter starts `child_main`,
    which dies with that parent (Linux), runs on `cpus` when given, then runs MODULE (or CODE)."""
    if len(argv) < 3 or argv[1] not in ("-m", "-c"):
        raise ValueError(f"a child command must be [python, '-m', MODULE, ...] or [python, '-c', CODE, ...], "
                         f"got {list(argv)[:3]}")
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ValueError(f"cpus must be non-negative core numbers, got {list(cpus)}")
    wrapper = [argv[0], "-m", CHILD_ENTRY, "--parent-pid", str(parent_pid)]
    if cpus:
        wrapper += ["--cpus", ",".join(map(str, cpus))]
    return [*wrapper, *argv[1:]]


def spawn(argv: Sequence[str], cpus: Sequence[int] = (), **popen: object) -> subprocess.Popen:
    """Start `argv` (see child_command) as a child of this process that dies with it and runs on
    `cpus`; `popen` are subprocess.Popen's keyword arguments (never preexec_fn: see Spawning)."""
    if "preexec_fn" in popen:
        raise ValueError("spawn sets the child up in the child itself; preexec_fn is not accepted")
    return subprocess.Popen(child_command(argv, os.getpid(), cpus), **popen)  # type: ignore[call-overload]


def _die_with_parent(parent_pid: int) -> None:
    """Child side (Linux): SIGTERM this process when its parent dies, even by SIGKILL, so a killed
    test run or `pdserve up` leaves no orphan nodes behind. (Tied to the parent's thread that
    spawned it: start clusters from a thread that outlives them.) If the parent died before the
    request took effect, no signal will come: exit now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, SIGTERM) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:
        raise SystemExit(f"pdserve child: launcher pid {parent_pid} exited before this child started "
                         f"(parent is now pid {os.getppid()}); exiting")


def child_main(argv: Sequence[str]) -> None:
    """`python -m pdserve.tools.launcher --parent-pid P [--cpus C1,C2] (-m MODULE | -c CODE) ARGS...`:
    set this process up (die with P on Linux; run on cores C), then run MODULE as __main__ (or
    CODE) with sys.argv as `python -m MODULE ARGS` would have it. Runs before any other thread of
    the child exists, so the affinity holds for every thread started later (torch's included)."""
    args = list(argv)
    parent_pid: int | None = None
    cpus: tuple[int, ...] = ()
    while args and args[0] in ("--parent-pid", "--cpus"):
        if len(args) < 2:
            raise SystemExit(f"pdserve child: {args[0]} needs a value")
        flag, value, args = args[0], args[1], args[2:]
        try:
            if flag == "--parent-pid":
                parent_pid = int(value)
            else:
                cpus = tuple(int(c) for c in value.split(","))
        except ValueError:
            raise SystemExit(f"pdserve child: {flag} {value!r} is not a number (list)") from None
    if parent_pid is None or len(args) < 2 or args[0] not in ("-m", "-c"):
        raise SystemExit("usage: python -m pdserve.tools.launcher --parent-pid PID [--cpus C1,C2] "
                         "(-m MODULE | -c CODE) [ARGS...]")
    if sys.platform == "linux":
        _die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)
    kind, target, rest = args[0], args[1], args[2:]
    if kind == "-m":
        sys.argv = [target, *rest]  # run_module puts the module's path in argv[0], as `python -m` does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


# The service whose health says a node can take work (pdserve.serving.node_server: readiness):
# both node kinds report it NOT_SERVING while they cannot (a decode node no prefill node answered
# yet), while the whole server ("") is SERVING as soon as the process is up.
NODE_READINESS_SERVICE = "pdserve.api.v1.NodeService"


def health_status(address: str, timeout: float = 1.0, security: ChannelSecurity = PLAINTEXT,
                  service: str = "") -> str:
    """The grpc.health.v1 status of a server's `service` ("" the whole server: "SERVING",
    "NOT_SERVING", ...) or "UNREACHABLE: why"."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_sync_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@dataclass
class _Child:
    spec: ProcessSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None


class Cluster:
    """A running local cluster; a context manager. Start with `start()` (or `with`), read `url`.

    Keyword arguments are ClusterConfig's (or pass `config=`). `processes` maps names (prefill-0,
    decode-1, colocated-0, router) to their specs; `kill(name)`/`restart(name)` help fault tests.
    """

    def __init__(self, config: ClusterConfig | None = None, **options: object) -> None:
        self.config: ClusterConfig = config or ClusterConfig(**options)  # type: ignore[arg-type]
        self.log_dir = Path(self.config.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self.security_dir = self.log_dir / SECURITY_DIR
        self.specs = plan(self.config, security_dir=str(self.security_dir))
        self._client_security: ChannelSecurity | None = None
        self._children = {s.name: _Child(s, self.log_dir / f"{s.name}.log") for s in self.specs}
        self._lock = threading.Lock()

    # --- addresses ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The router's gRPC address, HOST:PORT."""
        return self.processes["router"].address

    @property
    def http_url(self) -> str | None:
        """The router's HTTP root, http://HOST:PORT (OpenAI base URL: add /v1); None without HTTP."""
        return self.processes["router"].http_url

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every process's Prometheus endpoint by name: the router's on its HTTP API, each node's on its
        own metrics port (with node_metrics)."""
        urls = {}
        for spec in self.specs:
            if spec.http_url is not None:
                urls[spec.name] = f"{spec.http_url}/metrics"
        return urls

    @property
    def processes(self) -> dict[str, ProcessSpec]:
        return {name: child.spec for name, child in self._children.items()}

    def addresses(self, role: str) -> list[str]:
        """Addresses of the children with this role ("prefill", "decode", "colocated", "router")."""
        return [s.address for s in self.specs if s.role == role]

    def commands(self) -> list[str]:
        """The shell command line of every child, in start order (what `pdserve up --dry-run` prints)."""
        return [s.command for s in self.specs]

    @property
    def client_security(self) -> ChannelSecurity:
        """What a client of this cluster needs: the CA and the client certificate (tls), the token
        (auth_token); plaintext for a cluster with neither. Available once started."""
        if not (self.config.tls or self.config.auth_token):
            return PLAINTEXT
        if self._client_security is None:
            raise RuntimeError("the cluster's certificates and token are made by start()")
        return self._client_security

    def _make_security(self) -> None:
        """The certificates (tls) and the token (auth_token) every child's flags name (see Security)."""
        if not (self.config.tls or self.config.auth_token):
            return
        d = self.security_dir
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        cert = key = ca = None
        if self.config.tls:
            pki = make_pki(d, [*(s.name for s in self.specs), CLIENT_CERT], hosts=[self.config.host])
            cert, key, ca = pki[CLIENT_CERT].cert, pki[CLIENT_CERT].key, pki.ca
        token_path = None
        if self.config.auth_token:
            token_path = d / TOKEN_FILE
            fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
        self._client_security = ChannelSecurity.load(cert_file=cert, key_file=key, ca_file=ca,
                                                     token_file=str(token_path) if token_path else None,
                                                     token_env=None)

    def client_flags(self) -> list[str]:
        """The `pdserve generate --url` / Client flags a client of this cluster needs."""
        s = self.client_security
        return security_argv(s, str(self.security_dir / TOKEN_FILE) if s.token else None)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start every node at once (their imports and model loads overlap), wait until each is
        ready, then the router; raises ClusterStartError (all stopped) on failure. A node is ready
        when its NODE_READINESS_SERVICE is SERVING: a decode node only once a prefill node answered
        it (decode_node.service.DecodeNode.readiness), so the nodes need no start order; the router starts last so
        its first health poll finds every decode node ready."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.config.startup_timeout_s
        try:
            self._make_security()
            for phase in (("prefill", "decode", "colocated"), ("router",)):
                names = [s.name for s in self.specs if s.role in phase]
                for name in names:
                    self._spawn(name)
                self._wait_serving(names, deadline)
        except BaseException:
            self.stop()
            raise
        logger.info("cluster serving on %s (%s), logs in %s", self.url, self.config.description, self.log_dir)
        return self

    def _spawn(self, name: str) -> None:
        child = self._children[name]
        log = open(child.log_path, "ab")  # handed to the child, closed below
        try:
            log.write(f"$ {shlex.join(child.spec.argv)}\n".encode())
            log.flush()
            child.proc = spawn(child.spec.argv, child.spec.cpus, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True)
        finally:
            log.close()
        logger.info("started %s pid=%d on %s%s", name, child.proc.pid, child.spec.address,
                    f" cores {','.join(map(str, child.spec.cpus))}" if child.spec.cpus else "")

    def _wait_serving(self, names: Sequence[str], deadline: float) -> None:
        pending = list(names)
        status: dict[str, str] = {}
        while pending:
            for name in list(pending):
                child = self._children[name]
                assert child.proc is not None
                code = child.proc.poll()
                if code is not None:
                    raise ClusterStartError(f"{name} exited with status {code} before serving; "
                                            f"last lines of {child.log_path}:\n{log_tail(child.log_path)}")
                service = "" if child.spec.role == "router" else NODE_READINESS_SERVICE   # a node: ready
                status[name] = health_status(child.spec.address, timeout=1.0, security=self.client_security,
                                             service=service)
                if status[name] == "SERVING":
                    pending.remove(name)
            if not pending:
                return
            if time.monotonic() > deadline:
                name = pending[0]
                child = self._children[name]
                raise ClusterStartError(
                    f"{name} on {child.spec.address} not SERVING after {self.config.startup_timeout_s:.0f} s "
                    f"(health: {status.get(name)}); last lines of {child.log_path}:\n{log_tail(child.log_path)}")
            time.sleep(0.25)

    def poll(self) -> dict[str, int]:
        """Children that have exited, with their exit status."""
        return {n: c.proc.returncode for n, c in self._children.items()
                if c.proc is not None and c.proc.poll() is not None}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one child and reap it (fault tests)."""
        child = self._children[name]
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(sig)
            child.proc.wait(timeout=self.config.stop_timeout_s)

    def send_signal(self, name: str, sig: int) -> None:
        """Send `sig` to one running child without waiting for it (SIGSTOP / SIGCONT in fault tests)."""
        child = self._children[name]
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(sig)

    def restart(self, name: str) -> None:
        """Start a stopped child again with the same command line and wait until it serves."""
        self.kill(name, signal.SIGTERM)
        self._spawn(name)
        self._wait_serving([name], time.monotonic() + self.config.startup_timeout_s)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every running child (router first), SIGKILL what is left after stop_timeout_s.
        Returns each child's exit status (None if it never started)."""
        with self._lock:
            order = sorted(self._children.values(), key=lambda c: ("router", "decode", "colocated", "prefill")
                           .index(c.spec.role))
            for child in order:
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout_s
            for child in order:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s pid=%d ignored SIGTERM for %.0f s; killing it", child.spec.name,
                                   child.proc.pid, self.config.stop_timeout_s)
                    child.proc.kill()
                    child.proc.wait()
            return {n: (c.proc.returncode if c.proc is not None else None) for n, c in self._children.items()}

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the `pdserve up` command -----------------------------------------------------------------------


def add_up_args(p: argparse.ArgumentParser) -> None:
    """The `pdserve up` flags (call on the sub-parser, then `p.set_defaults(func=cmd_up)`)."""
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill nodes (default 1)")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode nodes (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="M",
                   help="run M colocated nodes (prefill and decode together, D18) instead of prefill/decode nodes")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="checkpoint for every node (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port (default 50051; 0: any free port)")
    p.add_argument("--http-port", type=int, default=8000, metavar="P",
                   help="the router's OpenAI-compatible HTTP port: /v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics (default 8000; 0: any free port, printed; -1: no HTTP API)")
    p.add_argument("--provider", default="shm", choices=PROVIDERS,
                   help="libfabric provider for KV transfers (default shm: one machine)")
    p.add_argument("--threads-per-node", type=int, default=None, metavar="T", help="torch threads per node")
    p.add_argument("--node-metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="each node serves Prometheus /metrics on a free port of its own, printed at start "
                        "(the router's are on its HTTP port); --no-node-metrics: none")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin each node to its own T cores (--threads-per-node T; the router is not pinned), "
                        "e.g. to compare colocated and disaggregated clusters on the same CPUs")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N", help="KV blocks per node")
    p.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel size of each prefill node (default 1); any node above 1 gives every node "
                        "--tp-invariant, so KV and logits agree bit for bit across TP sizes")
    p.add_argument("--decode-tp", type=int, default=None, metavar="N",
                   help="tensor-parallel size of each decode (or colocated) node (default 1)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel size of every node (--prefill-tp and --decode-tp override it)")
    p.add_argument("--max-batch-tokens", type=int, default=None, metavar="N", help="query tokens per forward pass")
    p.add_argument(SPEC_FLAG, default=None, metavar="JSON",
                   help="speculative decoding on every decode and colocated node (never a prefill node), vLLM's "
                        "JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' or '{\"method\": "
                        "\"draft_model\", \"self_draft_layers\": 8, \"num_speculative_tokens\": 4}'; checked "
                        "before anything starts; greedy output is unchanged (not allowed in --engine-args)")
    p.add_argument("--engine-args", default="", metavar="'FLAGS'",
                   help="more engine flags for every node, as one shell-quoted string (e.g. '--page-size 32')")
    p.add_argument("--routing", default="least-loaded", choices=POLICIES,
                   help="how the router picks a decode node: least outstanding work, or prefix-aware under a "
                        "load cap (decode nodes then also pick prefill nodes by prefix) (default: least-loaded)")
    p.add_argument("--log-format", default="text", choices=FORMATS,
                   help="every process logs one line per event as key=value text or JSON (default: text)")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="child logs (default: a new temp dir, printed)")
    p.add_argument("--startup-timeout", type=float, default=180.0, metavar="S",
                   help="seconds for every process to report SERVING")
    p.add_argument("--tls", action="store_true",
                   help="mTLS between every process, with a throwaway CA and certificates made in "
                        "LOG_DIR/security (clients use client.pem, client.key and ca.pem there)")
    p.add_argument("--auth-token", action="store_true",
                   help="a random shared token on every gRPC call (LOG_DIR/security/token)")
    p.add_argument("--kv-checksum", action="store_true",
                   help="decode nodes verify the CRC32C of every KV page shard and context record that landed "
                        "before scheduling the request (S7; off by default)")
    p.add_argument("--dry-run", action="store_true", help="print the commands that would run, start nothing")


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    engine = shlex.split(args.engine_args or "")
    if args.max_batch_tokens is not None:
        engine += ["--max-batch-tokens", str(args.max_batch_tokens)]
    return ClusterConfig(
        prefill=args.prefill, decode=args.decode, colocated=args.colocated,
        model=args.model, host=args.host, port=args.port, provider=args.provider,
        http_port=None if args.http_port == -1 else args.http_port,
        threads_per_node=args.threads_per_node, num_blocks=args.num_blocks, engine_args=tuple(engine),
        log_dir=args.log_dir, startup_timeout_s=args.startup_timeout, pin_cores=args.pin_cores,
        node_metrics=args.node_metrics, routing=args.routing, log_format=args.log_format,
        tls=args.tls, auth_token=args.auth_token, kv_checksum=args.kv_checksum,
        speculative_config=args.speculative_config,
        prefill_tp=args.prefill_tp if args.prefill_tp is not None else args.tp,
        decode_tp=args.decode_tp if args.decode_tp is not None else args.tp,
    )


def cmd_up(args: argparse.Namespace) -> int:
    """Run `pdserve up`: start the cluster, print the endpoint, serve until Ctrl-C/SIGTERM (exit 0).
    Exit 1 when a process fails to start or dies while serving; 2 for invalid flags."""
    config = config_from_args(args)
    cluster = Cluster(config)
    if args.dry_run:
        for line in cluster.commands():
            print(line)
        return 0
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"starting {config.description} cluster; logs in {cluster.log_dir}", flush=True)
        try:
            cluster.start()
        except ClusterStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if stop.is_set():
            cluster.stop()
            return 0
        http = f", OpenAI-compatible HTTP on {cluster.http_url}/v1" if cluster.http_url else ""
        print(f"pdserve cluster serving on {cluster.url} (gRPC){http} ({config.description})", flush=True)
        for name, url in cluster.metrics_urls.items():
            print(f"  metrics of {name}: {url}", flush=True)
        if config.tls or config.auth_token:
            print(f"  clients: pdserve generate --url {cluster.url} {shlex.join(cluster.client_flags())} ...",
                  flush=True)
        status = 0
        while not stop.wait(0.5):
            dead = cluster.poll()
            if dead:
                for name, code in dead.items():
                    child = cluster._children[name]
                    print(f"error: {name} exited with status {code}; last lines of {child.log_path}:\n"
                          f"{log_tail(child.log_path)}", file=sys.stderr)
                status = 1
                break
        print("pdserve cluster shutting down", flush=True)
        cluster.stop()
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":  # a child's entry: see child_main
    child_main(sys.argv[1:])
