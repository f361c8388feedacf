"""`python -m decode_node`: run one decode (or colocated) node."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc
from pdserve_api.servers import AioExceptionToStatusInterceptor, add_standard_services_aio
from pdserve_api.v1 import generate_pb2, generate_pb2_grpc, node_pb2, node_pb2_grpc

from decode_node.prefill_pool import PREFILL_ROUTING
from decode_node.server import DecodeNode, GenerateServicer, NodeServicer
from pdserve.tools.cli import add_engine_args, engine_options
from pdserve.engine.config import EngineConfig
from pdserve.serving.logs import add_log_args, setup_logging
from pdserve.serving.metrics import REGISTRY
from pdserve.serving.metrics.engine_collector import EngineCollector
from pdserve.serving.metrics.server import MetricsServer

logger = logging.getLogger("decode_node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode_node",
                                description="A pdserve decode node: serves the client API (for the router), "
                                            "receives prompt KV from prefill nodes over libfabric, decodes.")
    p.add_argument("--host", default="127.0.0.1", help="address to serve gRPC on")
    p.add_argument("--port", type=int, required=True, help="gRPC port")
    p.add_argument("--node-id", default=None, help="name in logs and metrics (default decode-PORT)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prefill", help="comma-separated HOST:PORT of prefill nodes")
    mode.add_argument("--colocated", action="store_true",
                      help="prefill locally in mixed batches (no prefill nodes, no fabric; D18)")
    p.add_argument("--provider", default=None,
                   help='libfabric provider ("shm" on one host, "tcp;ofi_rxm" across hosts; default: $FI_PROVIDER, else tcp;ofi_rxm)')
    p.add_argument("--fabric-node", default=None, help="local address for the fabric endpoint (tcp), e.g. 127.0.0.1")
    p.add_argument("--prefill-timeout", type=float, default=60.0, help="deadline of one Prefill call, seconds")
    p.add_argument("--local-prefill-fallback", action="store_true",
                   help="when no prefill node can serve a request, prefill it here instead of failing it")
    p.add_argument("--prefill-routing", default="least-loaded", choices=PREFILL_ROUTING,
                   help="which prefill node gets a prompt: least outstanding prompt tokens, or the one sent "
                        "its prefix before (its prefix cache can skip it) while under a load cap "
                        "(default: least-loaded)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="P",
                   help="serve Prometheus metrics at http://HOST:P/metrics (default 0: no metrics server)")
    add_log_args(p)
    add_engine_args(p)
    return p


async def serve(args: argparse.Namespace) -> None:
    node_id = args.node_id or f"decode-{args.port}"
    config = EngineConfig.from_options(model=args.model, **engine_options(args))
    prefill = [a.strip() for a in (args.prefill or "").split(",") if a.strip()]
    node = DecodeNode(config, node_id, args.colocated, prefill, args.provider, args.fabric_node,
                      args.prefill_timeout, args.local_prefill_fallback, args.prefill_routing)
    server = grpc.aio.server(interceptors=[AioExceptionToStatusInterceptor()])
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(node), server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(node), server)
    names = [generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name,
             node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name]
    health = await add_standard_services_aio(server, names, serving=False)
    bound = server.add_insecure_port(f"{args.host}:{args.port}")
    if bound == 0:
        raise SystemExit(f"decode node: cannot bind {args.host}:{args.port}")
    REGISTRY.register(EngineCollector(lambda: node.engine.last_metrics, node.model_name))
    metrics = MetricsServer(args.host, args.metrics_port) if args.metrics_port else None
    if metrics is not None:
        await metrics.start()  # OSError naming the address when the port is taken
    await node.start()  # the loop and the prefill pool exist before the first request can arrive
    await server.start()
    for name in ("", *names):
        await health.set(name, 1)  # SERVING
    mode = "colocated" if args.colocated else f"prefill nodes {', '.join(prefill)}, provider {node.fabric.provider}"
    line = f"decode node {node_id} serving on {args.host}:{args.port} ({mode})"
    logger.info("%s", line)
    print(line, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watchdog() -> None:
        # An engine thread that died cannot serve: say so to health checks (the router stops routing here).
        while node.engine.is_running:
            await asyncio.sleep(1.0)
        logger.critical("decode node %s: engine thread is dead; reporting NOT_SERVING", node_id)
        for name in ("", *names):
            await health.set(name, 2)

    watch = asyncio.create_task(watchdog())
    await stop.wait()
    watch.cancel()
    logger.info("decode node %s shutting down", node_id)
    for name in ("", *names):
        await health.set(name, 2)  # NOT_SERVING
    await server.stop(grace=2.0)
    if metrics is not None:
        await metrics.stop()
    await node.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_level, args.log_format)
        if not 0 <= args.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
        asyncio.run(serve(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a port that cannot be bound
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
