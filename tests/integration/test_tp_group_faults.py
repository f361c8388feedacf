"""A tensor-parallel group's faults at the leader (pdserve/parallel/group.py), with real rank processes:

- a rank that is alive but not reading (SIGSTOPped) fails the pass that outgrows its control
  pipe within the group's message bound, naming the rank, its pid and the bound; the group is
  failed for good, and close() still ends the stopped rank (no stop message follows the
  half-written pass: end of file, then SIGKILL after STOP_WAIT_S).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
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
