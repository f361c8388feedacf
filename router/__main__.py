"""`python -m router --host H --port P [--http-port P] --decode HOST:PORT[,HOST:PORT...]`: run a router
until SIGTERM. Without --http-port it serves gRPC only."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pdserve.serving.channels import add_security_args, security_from_args
from pdserve.serving.logs import add_log_args, setup_logging
from router.config import RouterConfig
from router.http_api import HttpConfig
from router.limits import RequestLimits, default_message_bytes
from router.policy import add_routing_args, routing_from_args

logger = logging.getLogger("router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description="pdserve router: forwards GenerateService "
                                "calls (and OpenAI-style HTTP) to a healthy decode node chosen by the routing policy.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    p.add_argument("--http-port", type=int, default=None, metavar="P",
                   help="also serve the OpenAI-compatible HTTP API on this port (0: any free port, printed; "
                        "default: no HTTP API)")
    p.add_argument("--max-prompt-bytes", type=int, default=RequestLimits.max_prompt_bytes, metavar="N",
                   help="refuse prompts larger than N bytes before tokenizing them "
                        f"(default {RequestLimits.max_prompt_bytes})")
    p.add_argument("--max-message-bytes", type=int, default=None, metavar="N",
                   help="refuse a request larger than N bytes on the wire before parsing it: HTTP 413, gRPC "
                        "RESOURCE_EXHAUSTED (default: 6 x --max-prompt-bytes + 1 MiB, "
                        f"{default_message_bytes(RequestLimits.max_prompt_bytes)} with the default prompt limit)")
    p.add_argument("--decode", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                   help="decode (or colocated) nodes to forward to")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                   help="seconds between health and load polls of each node")
    p.add_argument("--health-timeout", type=float, default=1.0, metavar="S", help="deadline of one health Check")
    p.add_argument("--health-misses", type=int, default=2, metavar="N",
                   help="health Checks in a row that may time out before a node is taken out of rotation "
                        "(a refused connection, an error or NOT_SERVING takes it out at once)")
    p.add_argument("--load-timeout", type=float, default=5.0, metavar="S", help="deadline of one GetNodeInfo call")
    p.add_argument("--request-timeout-s", type=float, default=RouterConfig.request_timeout_s, metavar="S",
                   help="end-to-end deadline of a Generate call (HTTP or gRPC; a shorter gRPC client deadline "
                        f"wins; default {RouterConfig.request_timeout_s:g})")
    p.add_argument("--max-inflight-requests", type=int, default=RouterConfig.max_inflight_requests, metavar="N",
                   help="Generate calls served at once; more are refused with RESOURCE_EXHAUSTED / HTTP 429 "
                        f"(default {RouterConfig.max_inflight_requests})")
    p.add_argument("--max-inflight-per-client", type=int, default=RouterConfig.max_inflight_per_client,
                   metavar="N",
                   help="Generate calls one client may have in flight at once (HTTP and gRPC together); more are "
                        "refused with RESOURCE_EXHAUSTED / HTTP 429. A client is its API key (Authorization: "
                        "Bearer KEY; not the router's own --auth-token) when it sends one, else its peer address "
                        f"(default {RouterConfig.max_inflight_per_client})")
    p.add_argument("--stream-write-timeout-s", type=float, default=RouterConfig.write_timeout_s, metavar="S",
                   help="cut a streamed answer (SSE or gRPC) whose client takes no message for S seconds (it reads "
                        "nothing, its socket buffers are full): its slot is freed and the request cancelled on "
                        f"the decode node (default {RouterConfig.write_timeout_s:g})")
    p.add_argument("--max-migrations", type=int, default=RouterConfig.max_migrations, metavar="N",
                   help="times a request may move to another decode node after its node failed mid-stream "
                        f"(default {RouterConfig.max_migrations})")
    p.add_argument("--http-idle-timeout-s", type=float, default=HttpConfig.idle_timeout_s, metavar="S",
                   help="close an HTTP connection that sends no complete request for S seconds "
                        f"(default {HttpConfig.idle_timeout_s:g})")
    p.add_argument("--http-body-timeout-s", type=float, default=HttpConfig.body_timeout_s, metavar="S",
                   help="answer 408 to a request body not read within S seconds "
                        f"(default {HttpConfig.body_timeout_s:g})")
    add_routing_args(p)
    add_security_args(p)
    add_log_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args.log_level, args.log_format)
        config = RouterConfig(host=args.host, port=args.port, decode_nodes=args.decode,
                              health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
                              health_misses=args.health_misses,
                              load_timeout_s=args.load_timeout, routing=routing_from_args(args),
                              request_timeout_s=args.request_timeout_s,
                              max_inflight_requests=args.max_inflight_requests, max_migrations=args.max_migrations,
                              max_inflight_per_client=args.max_inflight_per_client,
                              write_timeout_s=args.stream_write_timeout_s,
                              security=security_from_args(args))
        http = HttpConfig(host=args.host, port=args.http_port, idle_timeout_s=args.http_idle_timeout_s,
                          body_timeout_s=args.http_body_timeout_s) if args.http_port is not None else None
        limits = RequestLimits(max_prompt_bytes=args.max_prompt_bytes, message_bytes=args.max_message_bytes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from router.server import run

    return run(config, http, limits)


if __name__ == "__main__":
    sys.exit(main())
