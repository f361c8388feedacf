"""`ClusterConfig`: what a local cluster starts, validated when it is built (pdserve.tools.launcher).

Tensor parallelism: `prefill_tp` / `decode_tp` (`--prefill-tp N`, `--decode-tp M`, `--tp N` for
both) give each node `-tp N` (or engine_args give every node the same size; both at once is a
ValueError). Speculative decoding (E20): `speculative_config` is parsed with SpeculativeConfig.parse
here, so a bad one is a ValueError before any process starts; engine_args go to every node, so
`--speculative-config` there is refused (pdserve.tools.cluster.plan gives it to decoding nodes only).

Threads: none; built by the caller's thread. No blocking waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.serving.logs import FORMATS
from router.policy import POLICIES

PROVIDERS = ("shm", "tcp;ofi_rxm", "tcp")
SPEC_FLAG = "--speculative-config"  # the engine flag (pdserve.serving.engine_args) a decoding node gets



@dataclass(frozen=True)
class ClusterConfig:
    """What to start. prefill/decode: disaggregated node counts; colocated: colocated decode nodes
    (exclusive with prefill/decode). port: the router's gRPC port (0: any free port). http_port: the
    router's OpenAI-compatible HTTP port (0: any free port, the default here so that clusters started
    from Python never collide; `pdserve up` defaults to 8000; None: no HTTP API). engine_args: extra
    engine flags given to every node (e.g. ("--max-batch-tokens", "32")); router_args: extra router
    flags (e.g. ("--max-inflight-requests", "64")). log_dir: None makes a temp
    dir. pin_cores: pin node i to its own threads_per_node cores (needs threads_per_node).
    node_metrics: give every node a free `--metrics-port` (each node serves its own /metrics there;
    `Cluster.metrics_urls` lists them with the router's). routing: the router's decode-node policy,
    "least-loaded" or "prefix" (prefix-aware; decode nodes of a disaggregated cluster then also
    prefer the prefill node that was sent a prompt's prefix). log_format: "text" or "json" lines
    for every process. tls: mTLS between every process, with certificates made for this cluster;
    auth_token: a shared token on every gRPC call (Security in pdserve.tools.cluster.running).
    prefill_tp / decode_tp: each prefill / decode (or colocated) node's tensor_parallel_size (`-tp
    N`; None: engine_args or 1); see Tensor parallelism here and in pdserve.tools.cluster.plan.
    kv_checksum: decode nodes verify the CRC32C of every landed KV run before scheduling
    (`--kv-checksum`, S7). speculative_config: speculative decoding on every decode and colocated
    node (a SpeculativeConfig, its dict or its JSON; parsed and validated here, kept as a
    SpeculativeConfig; see Speculative decoding here and in pdserve.tools.cluster.plan)."""

    prefill: int | None = None
    decode: int | None = None
    colocated: int = 0
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int | None = 0
    provider: str = "shm"
    threads_per_node: int | None = None
    num_blocks: int | None = None
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()    # extra flags of every decode node only (e.g. --rotate-key-after 2)
    log_dir: str | None = None
    router_health_interval_s: float = 1.0
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    pin_cores: bool = False
    node_metrics: bool = True
    routing: str = "least-loaded"
    log_format: str = "text"
    tls: bool = False
    auth_token: bool = False
    prefill_tp: int | None = None
    decode_tp: int | None = None
    kv_checksum: bool = False
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_args", tuple(self.engine_args))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        given = [a for a in self.engine_args if a == SPEC_FLAG or a.startswith(SPEC_FLAG + "=")]
        if given:
            raise ValueError(f"engine_args go to every node, prefill nodes included, and give {given[0]!r}: pass "
                             "speculative_config (pdserve up --speculative-config JSON) instead, which goes to the "
                             "decode and colocated nodes only")
        object.__setattr__(self, "router_args", tuple(self.router_args))
        if self.colocated and (self.prefill or self.decode):
            raise ValueError(f"colocated nodes replace prefill/decode nodes: got colocated={self.colocated} "
                             f"with prefill={self.prefill}, decode={self.decode}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {POLICIES}, got {self.routing!r}")
        if self.log_format not in FORMATS:
            raise ValueError(f"log_format must be one of {FORMATS}, got {self.log_format!r}")
        default = 0 if self.colocated else 1  # unset counts: 1P:1D, or none beside colocated nodes
        for name in ("prefill", "decode"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("prefill", "decode", "colocated"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not self.colocated:
            if self.decode < 1:
                raise ValueError(f"a cluster needs at least one decode node (or --colocated M), "
                                 f"got decode={self.decode}")
            if self.prefill < 1:
                raise ValueError(f"a disaggregated cluster needs at least one prefill node, got prefill={self.prefill} "
                                 "(use --colocated M for nodes that prefill themselves)")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {PROVIDERS}, got {self.provider!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in 0..65535 (or None: no HTTP API), got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"the router's gRPC and HTTP ports must differ, both are {self.port}")
        given_tp = engine_args_tp(self.engine_args)
        if given_tp is not None and (self.prefill_tp is not None or self.decode_tp is not None):
            raise ValueError(f"engine_args set the tensor-parallel size ({given_tp}) for every node: give either "
                             f"that or prefill_tp / decode_tp ({self.prefill_tp} / {self.decode_tp}), not both")
        for name in ("threads_per_node", "num_blocks", "prefill_tp", "decode_tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got startup {self.startup_timeout_s}, stop {self.stop_timeout_s}")
        if self.pin_cores and self.threads_per_node is None:
            raise ValueError("pin_cores needs threads_per_node (the cores each node gets)")

    @property
    def num_nodes(self) -> int:
        return self.colocated if self.colocated else self.prefill + self.decode

    @property
    def description(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated"
        return f"{self.prefill} prefill, {self.decode} decode, provider {self.provider}"


def engine_args_tp(engine_args: Sequence[str]) -> int | None:
    """The tensor-parallel size that engine_args give every node (-tp N, --tensor-parallel-size[=]N; the
    last one wins, as argparse takes it); None when they give none. Raises ValueError on a non-integer."""
    tp: str | None = None
    for i, arg in enumerate(engine_args):
        if arg in ("-tp", "--tensor-parallel-size") and i + 1 < len(engine_args):
            tp = engine_args[i + 1]
        elif arg.startswith("--tensor-parallel-size="):
            tp = arg.split("=", 1)[1]
    try:
        return None if tp is None else int(tp)
    except ValueError:
        raise ValueError(f"engine_args: tensor-parallel size must be an integer, got {tp!r}") from None
