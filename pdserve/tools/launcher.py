"""`pdserve up`: a whole cluster on one machine (K1, D1, D18), and the `Cluster` Python API.

    with Cluster(prefill=1, decode=2, engine_args=("--num-blocks", "256", "--threads", "1")) as cluster:
        client = Client(cluster.url)                       # gRPC
        openai.OpenAI(base_url=f"{cluster.http_url}/v1")   # OpenAI-compatible HTTP

    pdserve up [--prefill N] [--decode M | --colocated M] [--model PATH] [--port 50051] [--http-port 8000]
               [--threads-per-node T [--pin-cores]] ...

This module is the public path: the `pdserve up` flags and command, and every name of the local
cluster, one job a module in pdserve.tools.cluster (re-exported here; import them from here):

- `ClusterConfig` (pdserve.tools.cluster.config): what to start, validated when built, including
  tensor parallelism (`prefill_tp` / `decode_tp`) and speculative decoding (`speculative_config`);
- `plan`, `ProcessSpec`, `free_ports`, `core_slices` (pdserve.tools.cluster.plan): the children
  (prefill nodes, decode or colocated nodes, then the router) with every flag, port and core each
  one gets;
- `spawn`, `child_command`, `child_main` (pdserve.tools.cluster.child): a child that dies with the
  launcher and pins itself, without a preexec_fn; `python -m pdserve.tools.launcher --parent-pid P
  ...` is a child's entry (CHILD_ENTRY) and runs `child_main`;
- `Cluster`, `ClusterStartError`, `health_status` (pdserve.tools.cluster.running): start in order
  with health waits, log tails on failure, clean stop, certificates and token of a secured cluster.

Blocking waits: those of Cluster (its start until startup_timeout_s, its stop until
stop_timeout_s); `cmd_up` polls the children every 0.5 s until a signal.

Threads: none of its own. `Cluster` is driven by the caller's thread; `cmd_up` waits in the main
thread for SIGINT/SIGTERM (or a child's unexpected exit).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading

from pdserve.serving.logs import FORMATS
from pdserve.tools.cluster.child import (
    CHILD_ENTRY,
    PR_SET_PDEATHSIG,
    child_command,
    child_env,
    child_main,
    spawn,
)
from pdserve.tools.cluster.config import PROVIDERS, SPEC_FLAG, ClusterConfig, engine_args_tp
from pdserve.tools.cluster.plan import (
    CLIENT_CERT,
    SECURITY_DIR,
    TOKEN_FILE,
    ProcessSpec,
    cluster_runs_tp,
    core_slices,
    free_ports,
    plan,
)
from pdserve.tools.cluster.running import (
    NODE_READINESS_SERVICE,
    Cluster,
    ClusterStartError,
    health_status,
    log_tail,
    logger,
)
from router.policy import POLICIES

# Deprecated private aliases, kept for the tests and scripts that reach for them (use the public names).
_child_env = child_env
_engine_args_tp = engine_args_tp


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


__all__ = ["CHILD_ENTRY", "CLIENT_CERT", "NODE_READINESS_SERVICE", "PROVIDERS", "PR_SET_PDEATHSIG", "SECURITY_DIR",
           "SPEC_FLAG", "TOKEN_FILE", "Cluster", "ClusterConfig", "ClusterStartError", "ProcessSpec", "add_up_args",
           "child_command", "child_env", "child_main", "cluster_runs_tp", "cmd_up", "config_from_args",
           "core_slices", "free_ports", "health_status", "log_tail", "logger", "plan", "spawn"]


if __name__ == "__main__":  # a child's entry: see child_main
    child_main(sys.argv[1:])
