"""`Cluster`: a local cluster's children started, waited for, signalled and stopped (K1, D1, D18).

Start: every node at once, each waited for until its grpc.health.v1 Check answers SERVING (a node:
NODE_READINESS_SERVICE; the router: the whole server ""), then the router. Each child writes stdout
and stderr to `<log_dir>/<name>.log`. A child that exits or misses the startup deadline fails the
start with its name and the tail of its log, and every other child is stopped. Stopping: SIGTERM to
every child (router first), then SIGKILL to any still running after `stop_timeout_s`.

Security (S9): with `tls`, the start makes a throwaway CA and one certificate per child (named
after it: prefill-0, decode-0, router) plus one for clients ("client"), in `<log_dir>/security/`
(pdserve.tools.certs; the CA key is deleted once they are signed), and every child serves mTLS
and calls the others with its own certificate; with `auth_token`, a random token is written to
`<log_dir>/security/token` (owner-only) and every child checks and sends it. `client_security`
is what a client of the cluster needs (Client(url, security=cluster.client_security)).

Blocking waits: each child's start, until startup_timeout_s in all (health polls of 1 s); a stop,
stop_timeout_s before SIGKILL; making the certificates, each openssl run at most
certs.OPENSSL_TIMEOUT_S.

Threads: none of its own; a `Cluster` is driven by the caller's thread (start it from a thread
that outlives it: a child's PR_SET_PDEATHSIG is tied to the thread that spawned it).
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.serving.channels import PLAINTEXT, ChannelSecurity, open_sync_channel, security_argv
from pdserve.tools.certs import make_pki
from pdserve.tools.cluster.child import child_env, spawn
from pdserve.tools.cluster.config import ClusterConfig
from pdserve.tools.cluster.plan import CLIENT_CERT, SECURITY_DIR, TOKEN_FILE, ProcessSpec, plan

logger = logging.getLogger("pdserve.tools.launcher")   # the name its lines had before the split

_LOG_TAIL_LINES = 30


class ClusterStartError(RuntimeError):
    """A child failed to start: its name, why, and the tail of its log are in the message."""


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
        """The certificates (tls) and the token (auth_token) every child's flags name (see Security above)."""
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
                               stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
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
