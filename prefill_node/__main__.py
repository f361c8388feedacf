"""`python -m prefill_node`: parse the command line and run a prefill node (see prefill_node/__init__.py)."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence

from pdserve.engine.faults import FaultPlan
from pdserve.serving.engine_args import add_engine_args, engine_config
from pdserve.serving.node_server import PREFILL_PORT, NodeServer, add_node_args, run_main, serve_options
from prefill_node.server import node_server
from prefill_node.service import PrefillNodeConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prefill_node",
        description="pdserve prefill node: computes prompts' KV cache for decode nodes (gRPC PrefillService) and "
                    "writes it, layer by layer, into their pages over libfabric. Serves PrefillService, "
                    "NodeService, grpc.health.v1 and reflection. Prints 'prefill node ID serving on HOST:PORT "
                    "(provider P)' on stdout once SERVING; SIGTERM/SIGINT stops it (exit 0).",
    )
    add_node_args(p, "prefill", PREFILL_PORT)
    add_engine_args(p)
    return p


def make(args: argparse.Namespace) -> NodeServer:
    node_id = args.node_id or (f"prefill-{args.port}" if args.port else f"prefill-{uuid.uuid4().hex[:12]}")
    config = PrefillNodeConfig(engine=engine_config(args), provider=args.provider, fabric_node=args.fabric_node,
                               node_id=node_id, faults=FaultPlan.from_env())   # TEST ONLY variables (faults.py)
    return node_server(config, serve_options(args))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser, make, argv)


if __name__ == "__main__":
    sys.exit(main())
