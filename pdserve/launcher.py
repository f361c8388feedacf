"""`pdserve up`: a whole cluster on one machine (K1, D1, D18), and the `Cluster` Python API.

    with Cluster(prefill=1, decode=2, engine_args=("--num-blocks", "256", "--threads", "1")) as cluster:
        client = Client(cluster.url)

    pdserve up [--prefill N] [--decode M | --colocated M] [--model PATH] [--port 50051] ...

Processes, started in this order, each waited for until its grpc.health.v1 Check ("") answers
SERVING: the prefill nodes (`python -m prefill_node`), the decode nodes (`python -m decode_node
--prefill <every prefill address>`, or `--colocated`), then the router (`python -m router --decode
<every decode address>`). Each child writes stdout and stderr to `<log_dir>/<name>.log`. A child
that exits or misses the startup deadline fails the start with its name and the tail of its log,
and every other child is stopped. Stopping: SIGTERM to every child (router first), then SIGKILL
to any still running after `stop_timeout_s`. On Linux a child also gets SIGTERM when the launcher
dies (PR_SET_PDEATHSIG), so a killed test run leaves no orphans.

Threads: none of its own. `Cluster` is driven by the caller's thread; `cmd_up` waits in the main
thread for SIGINT/SIGTERM (or a child's unexpected exit).
"""

from __future__ import annotations

import argparse
import logging
import os
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

logger = logging.getLogger(__name__)

PROVIDERS = ("shm", "tcp;ofi_rxm", "tcp")
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class ClusterConfig:
    """What to start. prefill/decode: disaggregated node counts; colocated: colocated decode nodes
    (exclusive with prefill/decode). port: the router's (0: any free port). engine_args: extra engine
    flags given to every node (e.g. ("--max-batch-tokens", "32")). log_dir: None makes a temp dir."""

    prefill: int | None = None
    decode: int | None = None
    colocated: int = 0
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    provider: str = "shm"
    threads_per_node: int | None = None
    num_blocks: int | None = None
    engine_args: tuple[str, ...] = ()
    log_dir: str | None = None
    router_health_interval_s: float = 1.0
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_args", tuple(self.engine_args))
        if self.colocated and (self.prefill or self.decode):
            raise ValueError(f"colocated nodes replace prefill/decode nodes: got colocated={self.colocated} "
                             f"with prefill={self.prefill}, decode={self.decode}")
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
                raise ValueError(f"a cluster needs at least one decode node (or --colocated M), got decode={self.decode}")
            if self.prefill < 1:
                raise ValueError(f"a disaggregated cluster needs at least one prefill node, got prefill={self.prefill} "
                                 "(use --colocated M for nodes that prefill themselves)")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}, got {self.provider!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("threads_per_node", "num_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got startup {self.startup_timeout_s}, stop {self.stop_timeout_s}")

    @property
    def description(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated"
        return f"{self.prefill} prefill, {self.decode} decode, provider {self.provider}"


@dataclass(frozen=True)
class ProcessSpec:
    """One child process: name (log file stem and node id), role, listening address, command line."""

    name: str
    role: str  # "prefill", "decode", "colocated", "router"
    host: str
    port: int
    argv: tuple[str, ...]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


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


def _engine_flags(config: ClusterConfig) -> list[str]:
    flags: list[str] = []
    if config.model:
        flags += ["--model", config.model]
    if config.num_blocks is not None:
        flags += ["--num-blocks", str(config.num_blocks)]
    if config.threads_per_node is not None:
        flags += ["--threads", str(config.threads_per_node)]
    return flags + list(config.engine_args)


def plan(config: ClusterConfig, ports: Sequence[int] | None = None) -> list[ProcessSpec]:
    """The processes to start, in order. ports: one per node, then the router's when config.port is 0
    (default: fresh free ports)."""
    n_nodes = config.prefill + config.decode if not config.colocated else config.colocated
    need = n_nodes + (1 if config.port == 0 else 0)
    ports = list(ports) if ports is not None else free_ports(need, config.host, exclude=(config.port,))
    if len(ports) < need:
        raise ValueError(f"plan needs {need} ports, got {len(ports)}: {ports}")
    py = sys.executable
    engine = _engine_flags(config)
    common = ["--host", config.host]
    specs: list[ProcessSpec] = []
    it = iter(ports)
    if config.colocated:
        for i in range(config.colocated):
            port = next(it)
            name = f"colocated-{i}"
            argv = [py, "-m", "decode_node", *common, "--port", str(port), "--node-id", name, "--colocated", *engine]
            specs.append(ProcessSpec(name, "colocated", config.host, port, tuple(argv)))
    else:
        fabric = ["--provider", config.provider, "--fabric-node", config.host]
        for i in range(config.prefill):
            port = next(it)
            name = f"prefill-{i}"
            argv = [py, "-m", "prefill_node", *common, "--port", str(port), "--node-id", name, *fabric, *engine]
            specs.append(ProcessSpec(name, "prefill", config.host, port, tuple(argv)))
        prefill_addrs = ",".join(s.address for s in specs)
        for i in range(config.decode):
            port = next(it)
            name = f"decode-{i}"
            argv = [py, "-m", "decode_node", *common, "--port", str(port), "--node-id", name, *fabric,
                    "--prefill", prefill_addrs, *engine]
            specs.append(ProcessSpec(name, "decode", config.host, port, tuple(argv)))
    router_port = config.port or next(it)
    decode_addrs = ",".join(s.address for s in specs if s.role != "prefill")
    argv = [py, "-m", "router", *common, "--port", str(router_port), "--decode", decode_addrs,
            "--health-interval", str(config.router_health_interval_s)]
    specs.append(ProcessSpec("router", "router", config.host, router_port, tuple(argv)))
    return specs


class ClusterStartError(RuntimeError):
    """A child failed to start: its name, why, and the tail of its log are in the message."""


def _child_env() -> dict[str, str]:
    """The environment of a child: unbuffered output, and this source tree importable (router,
    prefill_node and decode_node live beside pdserve/ and may postdate an editable install)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parents[1])
    if (Path(root) / "router").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _die_with_parent() -> None:
    """Child side of fork (Linux): SIGTERM this child when the launcher dies, even by SIGKILL, so a
    killed test run or `pdserve up` leaves no orphan nodes behind. (Tied to the thread that spawned
    it: start clusters from a thread that outlives them.)"""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: children outlive a killed launcher
        pass


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def health_status(address: str, timeout: float = 1.0) -> str:
    """The grpc.health.v1 status of a server ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE: why"."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
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
        self.specs = plan(self.config)
        self.log_dir = Path(self.config.log_dir or tempfile.mkdtemp(prefix="pdserve-cluster-"))
        self._children = {s.name: _Child(s, self.log_dir / f"{s.name}.log") for s in self.specs}
        self._lock = threading.Lock()

    # --- addresses ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.processes["router"].address

    @property
    def processes(self) -> dict[str, ProcessSpec]:
        return {name: child.spec for name, child in self._children.items()}

    def addresses(self, role: str) -> list[str]:
        """Addresses of the children with this role ("prefill", "decode", "colocated", "router")."""
        return [s.address for s in self.specs if s.role == role]

    def commands(self) -> list[str]:
        """The shell command line of every child, in start order (what `pdserve up --dry-run` prints)."""
        return [shlex.join(s.argv) for s in self.specs]

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start every child in order, each waited for; raises ClusterStartError (all stopped) on failure."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.config.startup_timeout_s
        try:
            for phase in ("prefill", "decode", "colocated", "router"):
                names = [s.name for s in self.specs if s.role == phase]
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
        log = open(child.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            log.write(f"$ {shlex.join(child.spec.argv)}\n".encode())
            log.flush()
            child.proc = subprocess.Popen(child.spec.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        finally:
            log.close()
        logger.info("started %s pid=%d on %s", name, child.proc.pid, child.spec.address)

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
                status[name] = health_status(child.spec.address, timeout=1.0)
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
    p.add_argument("--model", default=None, metavar="PATH", help="checkpoint for every node (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    p.add_argument("--port", type=int, default=50051, help="the router's port (default 50051; 0: any free port)")
    p.add_argument("--provider", default="shm", choices=PROVIDERS,
                   help="libfabric provider for KV transfers (default shm: one machine)")
    p.add_argument("--threads-per-node", type=int, default=None, metavar="T", help="torch threads per node")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N", help="KV blocks per node")
    p.add_argument("--max-batch-tokens", type=int, default=None, metavar="N", help="query tokens per forward pass")
    p.add_argument("--engine-args", default="", metavar="'FLAGS'",
                   help="more engine flags for every node, as one shell-quoted string (e.g. '--page-size 32')")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="child logs (default: a new temp dir, printed)")
    p.add_argument("--startup-timeout", type=float, default=180.0, metavar="S",
                   help="seconds for every process to report SERVING")
    p.add_argument("--dry-run", action="store_true", help="print the commands that would run, start nothing")


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    engine = shlex.split(args.engine_args or "")
    if args.max_batch_tokens is not None:
        engine += ["--max-batch-tokens", str(args.max_batch_tokens)]
    return ClusterConfig(
        prefill=args.prefill, decode=args.decode, colocated=args.colocated,
        model=args.model, host=args.host, port=args.port, provider=args.provider,
        threads_per_node=args.threads_per_node, num_blocks=args.num_blocks, engine_args=tuple(engine),
        log_dir=args.log_dir,
        startup_timeout_s=args.startup_timeout,
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
        print(f"pdserve cluster serving on {cluster.url} ({config.description})", flush=True)
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
