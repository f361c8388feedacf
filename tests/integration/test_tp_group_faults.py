"""A tensor-parallel group's faults at the leader (pdserve/parallel/group.py), with real rank processes:

- a rank that is alive but not reading (SIGSTOPped) fails the pass that outgrows its control
  pipe within the group's message bound, naming the rank, its pid and the bound; the group is
  failed for good, and close() still ends the stopped rank (no stop message follows the
  half-written pass: end of file, then SIGKILL after STOP_WAIT_S).
- a start that fails part-way leaves nothing of the group: run in a child leader (its own fd
  limit), TP 4 starts under a descriptor limit raised by one per attempt (from where the
  rendezvous store opens) until the start gets past rank 1 (its process started) and fails at
  rank 2; after every failed attempt the leader
  has no child process, no pool file in /dev/shm, no pool mapping and exactly the descriptors
  it had before (the pipes and the rendezvous store's socket are closed), and the error names
  the step and the rank. A start (TP 2) whose rank exits before it is ready (a model path it
  cannot read) leaves nothing either and names the rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from support.paths import ROOT, child_env
from support.tiny_models import make_tiny_checkpoint

from pdserve.kernels.attention.base import AttentionBatch
from pdserve.model.loader import load_config, resolve_model
from pdserve.model.tp import plan_tensor_parallel
from pdserve.parallel.group import STOP_WAIT_S, GroupSpec, TensorParallelError, TensorParallelGroup
from pdserve.parallel.messages import StepMessage
from pdserve.parallel.shm import PREFIX, SHM_DIR

BOUND_S = 0.5
PAGE = 16


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:   # a zombie has exited
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _spec(path: str, **over) -> tuple:
    cfg = load_config(resolve_model(path))
    plan = plan_tensor_parallel(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, 2)
    fields = dict(model_path=path, dtype="float32", kv_dtype="float32", max_model_len=128,
                  small_batch_max_tokens=16, tp_invariant=True, attention_backend="torch", num_blocks=8,
                  page_size=PAGE, num_layers=cfg.num_hidden_layers, head_dim=cfg.head_dim, kv_element_size=4,
                  message_timeout_s=BOUND_S)
    fields.update(over)
    return plan, GroupSpec(**fields)


def _big_step(tokens: int) -> StepMessage:
    """A pass of `tokens` prefill tokens of one sequence (its wire form: ~40 bytes a token)."""
    pages = -(-tokens // PAGE)
    pos = torch.arange(tokens, dtype=torch.int64)                                  # [T]
    batch = AttentionBatch(query_start=torch.tensor([0, tokens], dtype=torch.int32),
                           context_lens=torch.tensor([tokens], dtype=torch.int32),
                           block_tables=torch.arange(pages, dtype=torch.int32)[None, :],   # [1, pages]
                           slot_pages=pos // PAGE, slot_offsets=pos % PAGE, kv_rows=pos,
                           num_decode=0, q_lens=(tokens,), ctx_lens=(tokens,), page_size=PAGE, window=None)
    return StepMessage(torch.zeros(tokens, dtype=torch.int64), pos, (batch,))


def test_a_stopped_rank_fails_the_pass_within_the_message_bound_and_close_ends_it(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    plan, spec = _spec(str(path))
    group = TensorParallelGroup.start(plan, spec)
    (pid,) = group.worker_pids
    try:
        os.kill(pid, signal.SIGSTOP)
        msg = _big_step(8192)
        assert len(msg.encode()) > 4 * 65536        # more than a default pipe holds
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"cannot send a pass to rank 1 \(pid {pid}\): rank 1's "
                                                      rf"control pipe: only \d+ of a \d+-byte message was taken "
                                                      rf"within {BOUND_S:g} s"):
            group.send_step(msg)
        assert time.monotonic() - t0 < BOUND_S + 10   # the bound, not a hang (generous for 2 loaded cores)
        with pytest.raises(TensorParallelError, match="tensor-parallel engine failed"):   # failed for good
            group.send_step(_big_step(4))
    finally:
        t0 = time.monotonic()
        group.close()
        closed_in = time.monotonic() - t0
    assert not _alive(pid)
    assert closed_in < 2 * STOP_WAIT_S + 10
    assert [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")] == []


# The child leader: prints one JSON line per start attempt (its error and what it left behind).
_LEADER = textwrap.dedent("""
    import json, os, resource, sys
    from pdserve.model.loader import load_config, resolve_model
    from pdserve.model.tp import plan_tensor_parallel
    from pdserve.parallel.comm import open_store
    from pdserve.parallel.group import GroupSpec, TensorParallelError, TensorParallelGroup
    from pdserve.parallel.shm import PREFIX, SHM_DIR

    path, mode = sys.argv[1], sys.argv[2]
    cfg = load_config(resolve_model(path))
    tp = 4 if mode == "fd-limit" else 2
    plan = plan_tensor_parallel(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, tp)
    spec = GroupSpec(model_path=path if mode == "fd-limit" else path + "-missing", dtype="float32",
                     kv_dtype="float32", max_model_len=128, small_batch_max_tokens=16, tp_invariant=True,
                     attention_backend="torch", num_blocks=8, page_size=16, num_layers=cfg.num_hidden_layers,
                     head_dim=cfg.head_dim, kv_element_size=4)
    open_store(tp, 5.0)   # dropped at once: the store's process-wide descriptors (libuv) open before counting
    held = open_store(tp, 5.0)
    store_fds = len(os.listdir("/proc/self/fd"))   # the attempts start where the store itself opens (under
    del held                                       # less, its client retries for a minute)

    def leftovers():
        me = os.getpid()
        kids = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().split(")")[-1].split()[1]) == me:
                        kids.append(int(d))
            except (FileNotFoundError, ProcessLookupError):   # it exited while we looked
                continue
        with open("/proc/self/maps") as f:
            maps = [line.split()[-2] for line in f if PREFIX in line]
        return {"fds": sorted(os.listdir("/proc/self/fd")), "children": kids, "maps": maps,
                "shm": [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{me}-")]}

    base = leftovers()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in base["fds"])
    store_fds -= len(base["fds"])
    for extra in range(store_fds, store_fds + 100) if mode == "fd-limit" else [None]:
        if extra is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + extra, hard))
        try:
            TensorParallelGroup.start(plan, spec).close()
            error = None
        except TensorParallelError as exc:
            error = str(exc)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        left = leftovers()
        print(json.dumps({"extra": extra, "error": error, "clean": left == base, "left": left, "base": base}),
              flush=True)
        if error is None or "rank 2" in error:
            break
""")


def _attempts(path, mode: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", _LEADER, str(path), mode], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_a_start_failing_part_way_leaves_no_process_pool_file_mapping_or_descriptor(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")    # 2 KV heads: TP 4 runs replica sets
    attempts = _attempts(path, "fd-limit")
    assert attempts, "no start attempt ran"
    for a in attempts:
        assert a["error"] is not None, f"TP 4 started under a limit of {a['extra']} more descriptors"
        assert a["clean"], f"the failed start (+{a['extra']}: {a['error']}) left {a['left']} (before: {a['base']})"
        assert a["error"].startswith("tensor-parallel start failed "), a["error"]
    last = attempts[-1]["error"]    # rank 1's process had started: the part-way case
    assert "rank 2" in last and ("starting rank 2's process" in last or "creating rank 2's KV pool" in last), last
    assert "Too many open files" in last, last


def test_ranks_that_exit_before_they_are_ready_leave_nothing_and_are_named(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    (a,) = _attempts(path, "missing-model")
    assert a["clean"], f"the failed start left {a['left']} (before: {a['base']})"
    assert a["error"] is not None
    assert "before it was ready" in a["error"] and "tensor-parallel rank" in a["error"], a["error"]
