"""A 1 prefill + 1 decode cluster (router included) with a client, as the cluster benchmarks start it,
and a request timed from the client's side. Called from the benchmark's main thread; the cluster
waits at most --startup-timeout-s for its nodes, the client each call at most 300 s."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client
from pdserve.tools.launcher import Cluster

CLIENT_TIMEOUT_S = 300


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", default="shm", help="libfabric provider between the nodes")
    parser.add_argument("--threads-per-node", type=int, default=1)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per node")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)


@contextlib.contextmanager
def one_by_one(args: argparse.Namespace, **cluster_options: Any) -> Iterator[tuple[Cluster, Client]]:
    """A 1P+1D cluster from the add_cluster_args options (plus `cluster_options`), and a client to it."""
    engine_args: Sequence[str] = ("--max-batch-tokens", str(args.max_batch_tokens))
    if args.model is not None:
        cluster_options.setdefault("model", args.model)
    with Cluster(prefill=1, decode=1, port=0, provider=args.provider, threads_per_node=args.threads_per_node,
                 num_blocks=args.num_blocks, engine_args=engine_args, startup_timeout_s=args.startup_timeout_s,
                 **cluster_options) as cluster, Client(cluster.url, timeout=CLIENT_TIMEOUT_S) as client:
        yield cluster, client


@dataclass(frozen=True)
class Streamed:
    client_ttft_s: float    # send until the first chunk with tokens arrived
    last: Any               # the stream's last chunk (its .timings are the server's)


def stream_timed(client: Client, ids: list[int], params: SamplingParams) -> Streamed:
    """One streamed request, its first token timed at the client."""
    t0 = time.monotonic()
    first = last = None
    for chunk in client.generate(ids, params):
        if first is None and chunk.token_ids:
            first = time.monotonic()
        last = chunk
    if first is None or last is None:
        raise RuntimeError(f"the stream of a {len(ids)}-token prompt ended without a token")
    return Streamed(first - t0, last)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0 <= q <= 1) of `values`."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]
