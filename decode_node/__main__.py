"""`python -m decode_node`: parse the command line and run one decode (or colocated) node."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from decode_node.prefill_pool import PREFILL_ROUTING
from decode_node.server import node_server
from decode_node.service import DecodeNodeConfig
from kv_messenger.decode.rotation import SUGGESTED_ROTATE_KEY_AFTER_S
from pdserve.engine.faults import FaultPlan
from pdserve.serving.engine_args import add_engine_args, engine_config
from pdserve.serving.node_server import DECODE_PORT, NodeServer, add_node_args, run_main, serve_options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m decode_node",
        description="pdserve decode node: serves the client API (for the router), receives prompt KV from prefill "
                    "nodes over libfabric, decodes. Serves GenerateService, NodeService, grpc.health.v1 and "
                    "reflection. Prints 'decode node ID serving on HOST:PORT (...)' on stdout once SERVING; "
                    "SIGTERM/SIGINT stops it (exit 0).")
    g = add_node_args(p, "decode", DECODE_PORT)
    mode = g.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prefill", help="comma-separated HOST:PORT of prefill nodes")
    mode.add_argument("--colocated", action="store_true",
                      help="prefill locally in mixed batches (no prefill nodes, no fabric; D18)")
    g.add_argument("--prefill-timeout", type=float, default=60.0, help="deadline of one Prefill call, seconds "
                                                                         "(default 60)")
    g.add_argument("--prefill-stall", type=float, default=3.0,
                   help="a Prefill call with no write landed and no GetNodeInfo answer from its prefill node for "
                        "this many seconds has stalled: its pages are quarantined and the request is retried "
                        "elsewhere at once (default 3)")
    g.add_argument("--local-prefill-fallback", action="store_true",
                   help="when no prefill node can serve a request, prefill it here instead of failing it")
    g.add_argument("--prefill-routing", default="least-loaded", choices=PREFILL_ROUTING,
                   help="which prefill node gets a prompt: least outstanding prompt tokens, or the one sent "
                        "its prefix before (its prefix cache can skip it) while under a load cap "
                        "(default: least-loaded)")
    g.add_argument("--max-waiting-requests", type=int, default=DecodeNodeConfig.max_waiting_requests, metavar="N",
                   help="requests held that have not produced their first token (queued or prefilling); one more "
                        "is refused with RESOURCE_EXHAUSTED and the router tries another node "
                        f"(default {DecodeNodeConfig.max_waiting_requests})")
    g.add_argument("--kv-checksum", action="store_true",
                   help="S7: ask prefill nodes for the CRC32C of every KV page shard and context record they "
                        "write, and verify what landed before the request is scheduled; a mismatch re-prefills "
                        "the request in fresh pages (or fails it) and is counted in "
                        "pdserve:kv_checksum_failures_total (default off)")
    g.add_argument("--release-unfenced-by-close", action="store_true",
                   help="tcp;ofi_rxm: release a quarantine whose transfer ended on the prefill node without a "
                        "fence (after a long partition) by closing this node's connection to it; off by default: "
                        "libfabric 1.17's rxm can crash closing a connection with a write half received "
                        "(docs/transfer-safety.md); --rotate-key-after releases such quarantines without that risk")
    g.add_argument("--rotate-key-after", type=_seconds_or_off, default=None,
                   metavar="SECONDS|off",
                   help="tcp;ofi_rxm: when a quarantine is this old and its prefill node has answered nothing for "
                        "--prefill-stall seconds (a dead or partitioned host) or its transfer ended there without a "
                        "fence (a fabric-only partition, heavy loss, a process restarted in its place), register the "
                        "KV pool under a new memory key, close the old one and every fabric connection, and release "
                        "every quarantine held under it; every transfer then in flight, from any prefill node, fails "
                        "over and is prefilled again (counted in pdserve:kv_key_rotations_total). Ignored on shm (its "
                        "target checks no key). Default off (such quarantines stay held until the cluster stops); "
                        f"a suggested value: {SUGGESTED_ROTATE_KEY_AFTER_S:g}")
    add_engine_args(p)
    return p


def _seconds_or_off(text: str) -> float | None:
    """--rotate-key-after: seconds (> 0) or 'off'."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'off', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or 'off', got {text!r}")
    return value


def make(args: argparse.Namespace) -> NodeServer:
    options = serve_options(args)   # its channels to prefill nodes are secured as its own port
    config = DecodeNodeConfig(channel_security=options.security,
        engine=engine_config(args), node_id=args.node_id or f"decode-{args.port}", colocated=args.colocated,
        prefill_addresses=tuple(a.strip() for a in (args.prefill or "").split(",") if a.strip()),
        provider=args.provider, fabric_node=args.fabric_node, prefill_timeout_s=args.prefill_timeout,
        stall_s=args.prefill_stall, local_prefill_fallback=args.local_prefill_fallback,
        prefill_routing=args.prefill_routing, max_waiting_requests=args.max_waiting_requests,
        kv_checksum=args.kv_checksum, release_unfenced_by_close=args.release_unfenced_by_close,
        rotate_key_after_s=args.rotate_key_after, faults=FaultPlan.from_env())   # TEST ONLY variables (faults.py)
    return node_server(config, options)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(build_parser, make, argv)


if __name__ == "__main__":
    sys.exit(main())
