"""The leader's side of a tensor-parallel engine: starts the worker ranks, broadcasts each pass's
inputs, maps every rank's KV pool, and stops the ranks (E22, D15).

`TensorParallelGroup.start(...)` (rank 0 = the calling process, the leader that owns the
LLMEngine):

1. creates one shared-memory pool file per worker rank (pdserve/parallel/shm.py) and maps it,
   touching none of its pages (with GroupSpec.kv_populate the worker prefaults its own pool
   after pinning itself, so that its pages sit on that rank's NUMA node: first touch, D16);
2. opens the gloo rendezvous store on a free loopback port and starts ranks 1..N-1 as
   `python -m pdserve.parallel.worker` with a control pipe (its messages) and a status pipe;
   each worker is pinned to its own cores when the process may use at least N cores (rank r
   gets the r-th of N equal slices; the leader keeps slice 0's size as its thread count and is
   not pinned, so the threads of a server around it are unaffected), else nothing is pinned;
3. waits until every worker has loaded its shard and mapped its pool (one status byte each;
   a worker that exits first fails the start with its exit code), unlinks the pool files, and
   joins the gloo group itself.

A start that fails at any step leaves nothing: the ranks started so far are killed and reaped,
the pool files unlinked and unmapped, the pipes and the rendezvous store closed, and the
TensorParallelError names the step and the rank ("... failed starting rank 2's process: ...").

Then `send_step(msg)` writes each pass's StepMessage to every worker before the leader runs its
own shard; the row-parallel folds inside the pass are the collectives (pdserve/parallel/comm.py).

Failure: a dead worker makes the leader's next write to its pipe fail (EPIPE) or the pass's
next collective fail (its sockets close; at the latest after the collective timeout); a worker
that is alive but not reading (wedged, stopped) makes the write time out (the spec's
`message_timeout_s`) once the message outgrows the pipe's free space. The group is then failed
for good: `TensorParallelError` names the rank, its pid and exit code or the bound it missed.
Workers die with the leader (their control pipe reads end-of-file, and a watchdog checks the
parent pid); `close()` (also run at interpreter exit) stops them and waits at most STOP_WAIT_S,
then kills them.

Bounds: STARTUP_TIMEOUT_S for the workers' status bytes and the group's rendezvous;
COLLECTIVE_TIMEOUT_S for every collective (gloo's timeout, on init_process_group);
GroupSpec.message_timeout_s (pdserve/parallel/worker.py; MESSAGE_TIMEOUT_S, messages.py) for each control
message, the pass's and the stop message at close; STOP_WAIT_S per worker at close before SIGKILL.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.model.tp import TensorParallelPlan
from pdserve.parallel.comm import GlooComm, open_store
from pdserve.parallel.messages import ChannelTimeout, StepMessage, stop_payload, write_message
from pdserve.parallel.shm import PoolFile, SharedPool, new_pool_file, remove_stale_files, unlink
from pdserve.parallel.worker import DTYPES, GroupSpec, WorkerSpec

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
COLLECTIVE_TIMEOUT_S = 60.0
STOP_WAIT_S = 5.0


class TensorParallelError(RuntimeError):
    """A rank of the group died or a collective failed; the engine cannot run another pass."""


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    ctrl_w: int                 # the leader's write end of the control pipe
    pool: SharedPool
    timeout_s: float            # each control message's bound
    broken: bool = False        # a message was left half-written: nothing more may follow it


def rank_cpus(size: int) -> tuple[tuple[int, ...], ...]:
    """Cores per rank: N equal contiguous slices of this process's cores when there are >= N, else ()."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        return tuple(() for _ in range(size))
    per = len(cpus) // size
    return tuple(tuple(cpus[r * per : (r + 1) * per]) for r in range(size))


class TensorParallelGroup:
    """Ranks 1..N-1 of this engine and the leader's member of their gloo group (module docstring)."""

    def __init__(self, plan: TensorParallelPlan, spec: GroupSpec, comm: GlooComm, workers: list[_Worker],
                 cpus: tuple[tuple[int, ...], ...]) -> None:
        self.plan, self.spec, self.comm = plan, spec, comm
        self._workers = workers
        self.cpus = cpus
        self._error: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, list(workers))
        atexit.register(self.close)

    @property
    def size(self) -> int:
        return self.plan.tp_size

    @property
    def worker_pids(self) -> tuple[int, ...]:
        return tuple(w.proc.pid for w in self._workers)

    def pool_tensors(self) -> tuple[torch.Tensor, ...]:
        """The leader's mappings of ranks 1..N-1's KV pools ([layers, 2, pages, kv_heads_r, P, D] each)."""
        s, dtype = self.spec, DTYPES[self.spec.kv_dtype]
        return tuple(w.pool.tensor(dtype, (s.num_layers, 2, s.num_blocks, len(self.plan.ranks[w.rank].kv_heads),
                                           s.page_size, s.head_dim)) for w in self._workers)

    @staticmethod
    def start(plan: TensorParallelPlan, spec: GroupSpec) -> TensorParallelGroup:
        """Start ranks 1..N-1 and join their group (module docstring). A start that fails part-way
        leaves nothing behind: the ranks started so far are killed and reaped, the pool files
        unlinked and unmapped, the pipes closed and the rendezvous store (its port) closed; the
        TensorParallelError names the step and the rank that failed."""
        size = plan.tp_size
        remove_stale_files()
        cpus = rank_cpus(size)
        threads = [max(1, len(c)) if c else max(1, (os.cpu_count() or 1) // size) for c in cpus]
        workers: list[_Worker] = []
        status: dict[int, int] = {}   # status read fd -> rank
        files: list[PoolFile] = []
        pools: list[SharedPool] = []
        loose: list[int] = []         # pipe ends of a rank not started yet
        store: dist.TCPStore | None = None
        step = "opening the rendezvous store"
        try:
            store = open_store(size, COLLECTIVE_TIMEOUT_S)
            for r in range(1, size):
                kv_heads = len(plan.ranks[r].kv_heads)
                nbytes = spec.num_layers * 2 * spec.num_blocks * kv_heads * spec.page_size * spec.head_dim \
                    * spec.kv_element_size
                f = new_pool_file(r, nbytes)
                step = f"creating rank {r}'s KV pool {f.path} ({nbytes} bytes)"
                files.append(f)
                # never populated here: the worker faults its own pool in once pinned (worker.run),
                # so that first touch puts the pages on its NUMA node, not on ours
                pool = SharedPool(f, create=True)
                pools.append(pool)
                step = f"starting rank {r}'s process"
                ctrl_r, ctrl_w = os.pipe()
                loose += [ctrl_r, ctrl_w]
                stat_r, stat_w = os.pipe()
                loose += [stat_r, stat_w]
                ws = WorkerSpec(group=spec, rank=r, tp_size=size, port=store.port, timeout_s=COLLECTIVE_TIMEOUT_S,
                                leader_pid=os.getpid(), pool_name=f.name, pool_nbytes=nbytes, cpus=cpus[r],
                                num_threads=threads[r], ctrl_fd=ctrl_r, status_fd=stat_w)
                proc = subprocess.Popen([sys.executable, "-m", "pdserve.parallel.worker", ws.to_json()],
                                        pass_fds=(ctrl_r, stat_w), close_fds=True, env=_worker_env())
                workers.append(_Worker(r, proc, ctrl_w, pool, spec.message_timeout_s))
                status[stat_r] = r
                loose.clear()   # ctrl_w and stat_r are the worker's and status's now
                os.close(ctrl_r)
                os.close(stat_w)
            step = "waiting for the ranks to load their shards"
            _await_ready(workers, status)
            for f in files:
                unlink(f)
            files.clear()
            step = "joining the gloo group as rank 0"
            comm = GlooComm(0, size, store.port, COLLECTIVE_TIMEOUT_S, store=store)
        except BaseException as exc:
            _kill_workers(workers)
            for fd in loose:
                os.close(fd)
            for f in files:
                unlink(f)
            for pool in pools:
                pool.close()
            # The store's last references (ours and the finished frames' of the traceback, e.g. a
            # failed GlooComm's): dropping them closes its listening socket and its port.
            store = None
            traceback.clear_frames(exc.__traceback__)
            if isinstance(exc, TensorParallelError):
                raise
            if isinstance(exc, Exception):
                raise TensorParallelError(f"tensor-parallel start failed {step}: {type(exc).__name__}: "
                                          f"{exc}") from exc
            raise
        finally:
            for fd in status:
                os.close(fd)
        if cpus[0]:
            torch.set_num_threads(threads[0])
        logger.info("tensor parallel: %d ranks (worker pids %s), KV heads per rank %s, cores %s", size,
                    [w.proc.pid for w in workers], list(plan.kv_head_assignment), list(cpus))
        return TensorParallelGroup(plan, spec, comm, workers, cpus)

    def send_step(self, msg: StepMessage) -> None:
        """Every worker gets this pass's inputs; TensorParallelError when the group has failed."""
        self.check()
        payload = msg.encode()
        for w in self._workers:
            try:
                write_message(w.ctrl_w, payload, w.rank, w.timeout_s)
            except ChannelTimeout as exc:
                w.broken = True
                self.fail(f"cannot send a pass to rank {w.rank} (pid {w.proc.pid}): {exc}")
            except OSError as exc:
                w.broken = True
                self.fail(f"cannot send a pass to rank {w.rank}: {exc}")

    def check(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel group is closed")
        if self._error is not None:
            raise TensorParallelError(self._error)

    def fail(self, what: str) -> None:
        """Mark the group failed (for good) and raise TensorParallelError naming the dead ranks."""
        time.sleep(0.05)  # a worker that just died: let its exit status land
        dead = [f"rank {w.rank} (pid {w.proc.pid}) exited with code {w.proc.poll()}"
                for w in self._workers if w.proc.poll() is not None]
        self._error = f"tensor-parallel engine failed: {what}" + (f"; {', '.join(dead)}" if dead else "")
        raise TensorParallelError(self._error)

    def close(self) -> None:
        """Stop the workers (bounded: STOP_WAIT_S each, then SIGKILL) and leave the gloo group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._finalizer.detach()
        _stop_workers(self._workers)
        self.comm.close()


def _worker_env() -> dict[str, str]:
    """This environment with the leader's own pdserve first on PYTHONPATH (the workers must run
    the same code as the leader, whatever an editable install points at)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _await_ready(workers: list[_Worker], status: dict[int, int]) -> None:
    """Until every worker wrote its status byte (STARTUP_TIMEOUT_S); a worker's EOF fails the start."""
    pending = dict(status)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    procs = {w.rank: w.proc for w in workers}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(pending.values())} did not start within "
                                      f"{STARTUP_TIMEOUT_S:.0f} s")
        ready, _, _ = select.select(list(pending), [], [], min(left, 1.0))
        for fd in ready:
            rank = pending.pop(fd)
            if os.read(fd, 1) != b"R":
                proc = procs[rank]
                try:
                    rc = proc.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    rc = None
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {rc} "
                                          f"before it was ready (its error is on stderr above)")


def _kill_workers(workers: list[_Worker]) -> None:
    """A failed start's workers: nothing of theirs needs a clean stop (no pass ran), so SIGKILL and reap."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
        os.close(w.ctrl_w)
        w.ctrl_w = -1
    for w in workers:
        w.proc.wait(STOP_WAIT_S)


def _stop_workers(workers: list[_Worker]) -> None:
    """Stop message (bounded) and end of file to every worker, then wait; SIGKILL after STOP_WAIT_S."""
    for w in workers:
        if w.ctrl_w < 0:
            continue
        if not w.broken:   # after a half-written message the close alone (end of file) stops it
            try:
                write_message(w.ctrl_w, stop_payload(), w.rank, w.timeout_s)
            except ChannelTimeout as exc:
                logger.warning("stopping tensor-parallel rank %d (pid %d): %s; killing it", w.rank, w.proc.pid, exc)
            except OSError:
                logger.debug("rank %d's control pipe is closed already", w.rank)
        os.close(w.ctrl_w)
        w.ctrl_w = -1
    for w in workers:
        try:
            w.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait(STOP_WAIT_S)
