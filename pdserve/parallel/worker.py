"""A tensor-parallel worker rank (ranks 1..N-1 of an engine): `python -m pdserve.parallel.worker SPEC_JSON`.

Started by the leader (pdserve/parallel/group.py) with two inherited pipe ends: `ctrl_fd` (the
leader's messages: one StepMessage per forward pass, or stop) and `status_fd` (this rank writes
one byte once its shard is loaded and its pool mapped, just before joining the gloo group).
It pins itself to its cores first (WorkerSpec.cpus), maps its KV pool from the leader's
shared-memory file and, with GroupSpec.kv_populate, faults the whole pool in (MADV_POPULATE_WRITE)
from those cores, so the pages sit on the rank's own NUMA node (first touch; the leader never
touches them: D16), then loads its shard of the model, joins the group, then for each step
message runs the embedding and the decoder layers on its shard (the row-parallel folds are
collectives with the other ranks); the leader alone samples. A hybrid
model's pass (Gemma 3: sliding and full layers) carries one attention batch per window; each layer
runs on the batch of its window (`layer_plans`), as the leader's runner gives it.

It dies with the leader: the control pipe reads end-of-file when the leader's end closes (exit,
crash or SIGKILL), and a watchdog thread exits the process when its parent pid changes (a rank
blocked in a collective whose peer vanished also fails that collective: gloo's timeout).
Bounds: the wait for the leader's next message has no timer (an idle engine sends none; end of
file at the leader's death, and the watchdog, end it); once a message began, its body must come
within the group's `message_timeout_s` (pdserve/parallel/messages.py); the watchdog polls every
`WATCHDOG_S`; collectives are bounded by the spec's `timeout_s`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.kernels.attention import get_backend
from pdserve.kernels.attention.base import AttentionBackend, AttentionBatch, LayerPlans
from pdserve.model.arch import ModelArch
from pdserve.model.loader import iter_weights, load_config, resolve_model
from pdserve.model.registry import build_model
from pdserve.model.tp import plan_tensor_parallel
from pdserve.parallel.comm import GlooComm
from pdserve.parallel.messages import KIND_STOP, MESSAGE_TIMEOUT_S, StepMessage, payload_kind, read_message
from pdserve.parallel.shm import PoolFile, SharedPool

logger = logging.getLogger(__name__)

WATCHDOG_S = 0.5
EXIT_LEADER_GONE = 3


# a GroupSpec's dtype names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GroupSpec:
    """One tensor-parallel group's configuration: what the leader gives every worker rank (each
    rank's own place in it, its WorkerSpec, is added by the leader). Validated when built."""

    model_path: str             # the resolved checkpoint directory
    dtype: str                  # "float32" | "bfloat16" | "float16"
    kv_dtype: str
    max_model_len: int
    small_batch_max_tokens: int
    tp_invariant: bool
    attention_backend: str
    num_blocks: int
    page_size: int
    num_layers: int
    head_dim: int
    kv_element_size: int
    kv_populate: bool = False
    message_timeout_s: float = MESSAGE_TIMEOUT_S   # each control-pipe message's bound (messages.py)

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"tensor-parallel group: {name}={getattr(self, name)!r}, expected one of "
                                 f"{sorted(DTYPES)}")
        for name in ("max_model_len", "num_blocks", "page_size", "num_layers", "head_dim", "kv_element_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"tensor-parallel group: {name}={v!r}, expected a positive int")
        n = self.small_batch_max_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"tensor-parallel group: small_batch_max_tokens={n!r}, expected an int >= 0")
        if not self.message_timeout_s > 0:
            raise ValueError(f"tensor-parallel group: message_timeout_s={self.message_timeout_s!r}, expected > 0 s")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker rank needs, given on its command line as JSON: the group's GroupSpec and
    this rank's place in it."""

    group: GroupSpec
    rank: int
    tp_size: int
    port: int                   # the leader's rendezvous store
    timeout_s: float            # every collective's bound
    leader_pid: int
    pool_name: str              # the shared-memory file of this rank's pool (pdserve/parallel/shm.py)
    pool_nbytes: int
    cpus: tuple[int, ...]       # cores to pin to; () = not pinned
    num_threads: int
    ctrl_fd: int
    status_fd: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> WorkerSpec:
        d = json.loads(text)
        d["cpus"] = tuple(d["cpus"])
        d["group"] = GroupSpec(**d["group"])
        return WorkerSpec(**d)


def layer_plans(arch: ModelArch, backend: AttentionBackend, batches: tuple[AttentionBatch, ...]) -> object:
    """The backend plan the model takes for one pass: the one batch's plan, or (several batches: a
    hybrid model) a LayerPlans giving each layer the plan of the batch with its window (the
    leader's runner sends one batch per distinct window). ValueError naming the windows when the
    batches do not match the model's layers."""
    plans = [backend.plan(b) for b in batches]
    if len(plans) == 1:
        return plans[0]
    by_window = {b.window: i for i, b in enumerate(batches)}
    windows = arch.layer_windows
    if len(by_window) != len(batches) or set(by_window) != set(windows):
        raise ValueError(f"tensor-parallel worker: attention batches of windows {[b.window for b in batches]} "
                         f"do not match the model's layer windows {sorted(set(windows), key=str)}")
    return LayerPlans(tuple(plans[by_window[w]] for w in windows))


def _watchdog(leader_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_S)
        if os.getppid() != leader_pid:
            os._exit(EXIT_LEADER_GONE)


def map_pool(spec: WorkerSpec) -> SharedPool:
    """This rank's KV pool, pinned first: the process moves to its cores (if it has any), then maps
    the leader's file and, with kv_populate, faults every page in from there (first touch places
    them on the node of those cores). RuntimeError if the process does not run on exactly its
    cores when it populates."""
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
        if set(os.sched_getaffinity(0)) != set(spec.cpus):
            raise RuntimeError(f"tensor-parallel rank {spec.rank}: pinned to {sorted(os.sched_getaffinity(0))}, "
                               f"not its cores {list(spec.cpus)}, before populating its KV pool")
    return SharedPool(PoolFile(spec.pool_name, spec.pool_nbytes), create=False, populate=spec.group.kv_populate)


def run(spec: WorkerSpec) -> int:
    threading.Thread(target=_watchdog, args=(spec.leader_pid,), name="tp-watchdog", daemon=True).start()
    pool = map_pool(spec)   # pinned, then populated
    torch.set_num_threads(spec.num_threads)
    g = spec.group
    source = resolve_model(g.model_path)
    hf_config = load_config(source)
    arch = ModelArch.from_hf_config(hf_config)
    plan = plan_tensor_parallel(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, spec.tp_size)
    shard = plan.ranks[spec.rank]
    model = build_model(arch, hf_config, DTYPES[g.dtype], g.max_model_len,
                        small_batch_max_tokens=g.small_batch_max_tokens, shard=shard, tp_invariant=g.tp_invariant)
    model.load_weights(iter_weights(source))
    model.eval()
    kv_heads = len(shard.kv_heads)
    dims = (arch.num_layers, 2, g.num_blocks, kv_heads, g.page_size, arch.head_dim)
    buffer = pool.tensor(DTYPES[g.kv_dtype], dims)      # [layers, 2, pages, kv_heads, page_size, head_dim]
    k_pools = [buffer[i, 0] for i in range(arch.num_layers)]
    v_pools = [buffer[i, 1] for i in range(arch.num_layers)]
    backend = get_backend(g.attention_backend)
    os.write(spec.status_fd, b"R")
    comm = GlooComm(spec.rank, spec.tp_size, spec.port, spec.timeout_s)
    model.set_tp_comm(comm)
    try:
        while True:
            payload = read_message(spec.ctrl_fd, spec.rank, g.message_timeout_s)
            if payload is None:
                return EXIT_LEADER_GONE
            if payload_kind(payload) == KIND_STOP:
                return 0
            msg = StepMessage.decode(payload, kv_heads)
            only = {} if msg.num_layers is None else {"num_layers": msg.num_layers}   # a self-draft's pass
            model.forward_layers(msg.input_ids, msg.positions, k_pools, v_pools, backend,
                                 layer_plans(arch, backend, msg.batches), **only)
    finally:
        comm.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-rank %(process)d %(levelname)s %(message)s")
    if len(argv) != 2:
        print("usage: python -m pdserve.parallel.worker SPEC_JSON", file=sys.stderr)
        return 2
    return run(WorkerSpec.from_json(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
