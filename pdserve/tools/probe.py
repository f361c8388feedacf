"""`python -m pdserve.tools.probe --port P [--service NAME] [TLS flags]`: one grpc.health.v1 Check of a
local server, as an exec probe (exit 0 when SERVING, 1 otherwise, with the reason on stdout).

The kubelet's native gRPC probe speaks plaintext only; pods whose servers run mTLS
(`pdserve deploy render --tls-secret NAME`) probe themselves with this instead, presenting the
pod's own certificate (it has clientAuth usage, pdserve.serving.channels). It imports only grpc
and the channel helpers, so a probe costs a fraction of a second.

Blocking waits: the Check, at most --timeout seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.serving.channels import add_security_args, open_sync_channel, security_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.tools.probe",
                                description="one grpc.health.v1 Check: exit 0 when SERVING, else 1")
    p.add_argument("--host", default="127.0.0.1", help="the server's address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--service", default="", help='the service asked for (default: "", the whole server)')
    p.add_argument("--timeout", type=float, default=2.0, metavar="S", help="deadline of the Check (default 2)")
    add_security_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        security = security_from_args(args)
    except ValueError as e:
        print(f"error: {e}")
        return 1
    address = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    with open_sync_channel(address, security) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"{address} {args.service!r}: {e.code().name}: {e.details()}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address} {args.service!r}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
