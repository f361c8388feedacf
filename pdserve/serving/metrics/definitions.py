"""The metrics each kind of pdserve process exports (R5), under the names vLLM users know, prefixed `pdserve:`.

Each group is a frozen dataclass of prometheus_client metrics, built once per registry by its
function (`request_metrics(registry)`, ...); the process's registry is `pdserve.serving.metrics.REGISTRY`.
A process registers only the groups it uses: the router `request_metrics` and `router_metrics`; a
decode node `request_metrics`, `node_metrics` and an EngineCollector; a prefill node `node_metrics`,
`prefill_metrics` and an EngineCollector.

Label conventions: `model_name` on everything a node serves (the router takes it from the decode
node's NodeInfo); `finished_reason` (stop, length, abort, error) on request_success_total; `side`
(decode: bytes received and the wait from Prefill dispatch to KV landed; prefill: bytes sent and the
time its writes were in flight) on the KV transfer metrics, so a cluster-wide sum does not count a
transfer twice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds. CPU serving spans milliseconds (a decode step of a small model) to minutes (a long
# prompt under load), hence the wide ranges.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                   120.0, 300.0, 600.0)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                       30.0, 60.0)

FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class RequestMetrics:
    """A streamed request as one server saw it: the router (the client's view) or a decode node."""

    ttft: Histogram      # pdserve:time_to_first_token_seconds{model_name}
    itl: Histogram       # pdserve:inter_token_latency_seconds{model_name}: gap between token-bearing messages
    e2e: Histogram       # pdserve:e2e_request_latency_seconds{model_name}
    success: Counter     # pdserve:request_success_total{model_name, finished_reason}


@dataclass(frozen=True)
class RouterMetrics:
    routed: Counter      # pdserve:router_requests_routed_total{node, reason}: the policy's choices
    rejected: Counter    # pdserve:router_request_errors_total{code}: calls that ended with a gRPC error
    migrations: Counter  # pdserve:router_request_migrations_total{node}: requests resumed off a failed node (S10)
    write_timeouts: Counter  # pdserve:router_stream_write_timeouts_total{api}: streams cut, the client read nothing
    client_refused: Counter  # pdserve:router_client_cap_refusals_total{api}: refused at the per-client cap


@dataclass(frozen=True)
class NodeMetrics:
    """What every node measures around its engine (the engine's own numbers: EngineCollector)."""

    queue_time: Histogram         # pdserve:request_queue_time_seconds{model_name}: received -> admitted
    kv_transfer_bytes: Counter    # pdserve:kv_transfer_bytes_total{model_name, side}
    kv_transfer_seconds: Histogram  # pdserve:kv_transfer_seconds{model_name, side}
    kv_stale_writes: Counter      # pdserve:kv_stale_writes_total: writes landed for no live transfer (S5)
    incompatible_peers: Gauge     # pdserve:incompatible_peers{peer}: 1 while a prefill node is skipped for skew
    kv_quarantine_oldest: Gauge   # pdserve:kv_quarantine_oldest_seconds{peer}: age of the oldest quarantine held
    kv_key_rotations: Counter     # pdserve:kv_key_rotations_total: KV memory-key rotations done (--rotate-key-after)
    kv_checksums_verified: Counter   # pdserve:kv_checksums_verified_total: transfers verified (S7, --kv-checksum)
    kv_checksum_failures: Counter    # pdserve:kv_checksum_failures_total: transfers whose landed bytes differed
    kv_context_rejected: Counter     # pdserve:kv_context_rejected_total: transfers whose context record was rejected
    kv_shard_placement: Gauge        # pdserve:kv_shard_placement_info{rank, numa_node, nic, domain, cpus}: 1 (D16)


@dataclass(frozen=True)
class PrefillMetrics:
    prefill_time: Histogram  # pdserve:request_prefill_time_seconds{model_name}: first chunk -> last layer
    requests: Counter        # pdserve:prefill_requests_total{model_name, outcome}


@functools.cache
def request_metrics(registry: CollectorRegistry) -> RequestMetrics:
    return RequestMetrics(
        ttft=Histogram("pdserve:time_to_first_token_seconds",
                       "Seconds from receiving a request to sending its first generated token.",
                       ["model_name"], buckets=TTFT_BUCKETS, registry=registry),
        itl=Histogram("pdserve:inter_token_latency_seconds",
                      "Seconds between two consecutive streamed messages carrying generated tokens.",
                      ["model_name"], buckets=ITL_BUCKETS, registry=registry),
        e2e=Histogram("pdserve:e2e_request_latency_seconds",
                      "Seconds from receiving a request to its last message.",
                      ["model_name"], buckets=REQUEST_BUCKETS, registry=registry),
        success=Counter("pdserve:request_success_total",
                        "Requests that finished, by finish reason (stop, length, abort, error).",
                        ["model_name", "finished_reason"], registry=registry),
    )


@functools.cache
def router_metrics(registry: CollectorRegistry) -> RouterMetrics:
    return RouterMetrics(
        routed=Counter("pdserve:router_requests_routed_total",
                       "Requests sent to each decode node, by why the routing policy chose it "
                       "(least_loaded, prefix, load_cap).", ["node", "reason"], registry=registry),
        rejected=Counter("pdserve:router_request_errors_total",
                         "Generate calls that ended with a gRPC error status before streaming, by status code.",
                         ["code"], registry=registry),
        migrations=Counter("pdserve:router_request_migrations_total",
                           "Requests resumed on another decode node after the node serving them failed mid-stream, "
                           "by the node that failed.", ["node"], registry=registry),
        write_timeouts=Counter("pdserve:router_stream_write_timeouts",
                               "Streams (api=http: SSE, api=grpc) cut because the client took no message for "
                               "router --stream-write-timeout-s; their slots were freed and their requests "
                               "cancelled on the decode node.", ["api"], registry=registry),
        client_refused=Counter("pdserve:router_client_cap_refusals",
                               "Generate calls refused (HTTP 429 / RESOURCE_EXHAUSTED) because their client "
                               "already had router --max-inflight-per-client in flight.", ["api"],
                               registry=registry),
    )


@functools.cache
def node_metrics(registry: CollectorRegistry) -> NodeMetrics:
    return NodeMetrics(
        queue_time=Histogram("pdserve:request_queue_time_seconds",
                             "Seconds from receiving a request to its admission (pages allocated, first "
                             "scheduled).", ["model_name"], buckets=REQUEST_BUCKETS, registry=registry),
        kv_transfer_bytes=Counter("pdserve:kv_transfer_bytes",
                                  "Bytes of prompt KV (and context) moved between nodes; side=decode counts "
                                  "bytes received, side=prefill bytes sent.", ["model_name", "side"],
                                  registry=registry),
        kv_transfer_seconds=Histogram("pdserve:kv_transfer_seconds",
                                      "Seconds of a request's KV transfer; side=decode: from the Prefill "
                                      "dispatch to the last write landed; side=prefill: from its first "
                                      "write posted to its last completed.", ["model_name", "side"],
                                      buckets=KV_TRANSFER_BUCKETS, registry=registry),
        kv_stale_writes=Counter("pdserve:kv_stale_writes",
                                "KV writes that landed on this decode node for a tag no transfer expects "
                                "(unknown, finished, or released after an abort): must stay 0 (S5).",
                                registry=registry),
        incompatible_peers=Gauge("pdserve:incompatible_peers",
                                 "1 while the prefill node at `peer` is skipped because its model or KV layout "
                                 "differs from this decode node's (NodeInfo.build), else 0.", ["peer"],
                                 registry=registry),
        kv_quarantine_oldest=Gauge("pdserve:kv_quarantine_oldest_seconds",
                                   "Age of the oldest abandoned transfer whose pages this decode node still "
                                   "quarantines for the prefill node at `peer` (absent when none): one that "
                                   "keeps growing is a prefill host that never answers (S5 keeps the pages).",
                                   ["peer"], registry=registry),
        kv_key_rotations=Counter("pdserve:kv_key_rotations",
                                 "Rotations of this decode node's KV memory key that finished (--rotate-key-after): "
                                 "the pool registered again, the old key closed and every fabric connection "
                                 "ended, so the quarantines held under it were released; each one failed over "
                                 "every transfer then in flight.", registry=registry),
        kv_checksums_verified=Counter("pdserve:kv_checksums_verified",
                                      "Transfers whose landed KV pages and context this decode node hashed and "
                                      "compared with the prefill node's checksums (S7, --kv-checksum), "
                                      "matching or not.", registry=registry),
        kv_checksum_failures=Counter("pdserve:kv_checksum_failures",
                                     "Transfers whose landed bytes differed from the prefill node's checksums "
                                     "(S7): the attempt was dropped, never used or cached.", registry=registry),
        kv_context_rejected=Counter("pdserve:kv_context_rejected",
                                    "Transfers whose context record (D19: version, layout, transfer identity, "
                                    "position, checksum) did not match what this decode node expects: the "
                                    "attempt was dropped, never used or cached, and re-prefilled.", registry=registry),
        kv_shard_placement=Gauge("pdserve:kv_shard_placement_info",
                                 "1 per tensor-parallel rank of this node's KV pool: the NUMA node its pages are "
                                 "on ('unknown' when not readable), the NIC and libfabric domain nearest to it "
                                 "('none': no NIC near) and the CPUs its transfer threads may use (D16).",
                                 ["rank", "numa_node", "nic", "domain", "cpus"], registry=registry),
    )


@functools.cache
def prefill_metrics(registry: CollectorRegistry) -> PrefillMetrics:
    return PrefillMetrics(
        prefill_time=Histogram("pdserve:request_prefill_time_seconds",
                               "Seconds from a prefill's first scheduled chunk to its last layer computed.",
                               ["model_name"], buckets=REQUEST_BUCKETS, registry=registry),
        requests=Counter("pdserve:prefill_requests_total",
                         "Prefill calls answered, by outcome (ok, invalid, aborted, unavailable, timeout, "
                         "error).", ["model_name", "outcome"], registry=registry),
    )
