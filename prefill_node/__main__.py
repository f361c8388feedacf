"""`python -m prefill_node`: run a prefill node (see prefill_node/__init__.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from pdserve.tools.cli import add_engine_args, engine_options
from pdserve.engine.config import EngineConfig
from pdserve.serving.logs import add_log_args, setup_logging
from prefill_node.service import NodeConfig
from prefill_node.server import ServeOptions, serve

logger = logging.getLogger("prefill_node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefill_node",
        description="pdserve prefill node: computes prompts' KV cache for decode nodes (gRPC PrefillService) and "
                    "writes it, layer by layer, into their pages over libfabric. Serves PrefillService, "
                    "NodeService, grpc.health.v1 and reflection. Prints 'prefill node ID serving on HOST:PORT "
                    "(provider P)' on stdout once SERVING; SIGTERM/SIGINT stops it (exit 0).",
    )
    g = p.add_argument_group("node")
    g.add_argument("--host", default="127.0.0.1", help="gRPC listen address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=50061,
                   help="gRPC listen port; 0 lets the OS pick (the serving line names it) (default: 50061)")
    g.add_argument("--node-id", default=None, help="this node's id in NodeInfo and logs (default: a random one)")
    g.add_argument("--provider", default="shm",
                   help='libfabric provider: "shm" (same host), "tcp;ofi_rxm", "verbs;ofi_rxm", "efa"; must '
                        'match the decode nodes\' (default: shm)')
    g.add_argument("--fabric-node", default=None, metavar="ADDRESS",
                   help="local address the fabric endpoint binds, e.g. 127.0.0.1 (ignored by shm; default: "
                        "the provider's choice)")
    g.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics (default 0: no metrics server)")
    add_log_args(g)
    add_engine_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_level, args.log_format)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port <= 65535:
            logger.error("%s %d is not a port number", flag, port)
            return 2
    try:
        engine = EngineConfig.from_options(model=args.model, **engine_options(args))
    except (ValueError, TypeError) as e:
        logger.error("bad engine options: %s", e)
        return 2
    node = NodeConfig(engine=engine, provider=args.provider, fabric_node=args.fabric_node)
    if args.node_id:
        node = NodeConfig(engine=engine, provider=args.provider, fabric_node=args.fabric_node, node_id=args.node_id)
    return asyncio.run(serve(ServeOptions(host=args.host, port=args.port, node=node, metrics_port=args.metrics_port)))


if __name__ == "__main__":
    sys.exit(main())
