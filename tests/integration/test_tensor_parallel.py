"""Tensor parallelism with real rank processes (E22, D7, D15; issue 16): `LLM(tensor_parallel_size=N)`.

- tp_invariant auto: on at TP 2 (fold blocks), off at TP 1 (the plain kernels); a TP 1 engine
  given tp_invariant=True (--tp-invariant, as a TP 1 node of a cluster with TP > 1 nodes runs) is
  the reference below.
- The default model at TP 2 (3 KV heads: rank 0 holds 2 groups = 6 query heads, rank 1 one group)
  gives the same greedy tokens and the same logprobs, bit for bit, as TP 1 and the same tokens as
  transformers, for prompts whose prefill takes torch's matmul (> 32 tokens) and decode steps on
  the C kernels; every rank's KV pool, as the leader maps it, holds exactly TP 1's bytes of its heads.
- A tiny model with 3 KV heads at TP 2 (uneven groups) and one with 2 KV heads at TP 4 (replica
  sets, 4 processes on 2 cores) agree with TP 1 bit for bit.
- With tp_invariant=False (one fold block per rank) TP 2 gives the same greedy tokens as TP 1 and
  logprobs within LOGPROB_TOLERANCE.
- An impossible split is refused before anything starts; the rank processes are gone after
  close() and after the leader is SIGKILLed; the shared-memory pool files are gone once the
  engine runs; a dead worker fails the next pass with an error naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from support.connectors import NoOpPrefillConnector
from support.paths import ROOT, child_env
from support.reference import hf_greedy
from support.tiny_models import make_tiny_checkpoint
from support.wait import wait_until

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_connector import KvCacheSpec, PrefillConnector, PrefillDone
from pdserve.parallel.shm import PREFIX, SHM_DIR

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the foot of a tall mountain, there lived an old baker who "
    "rose every morning before dawn to light his ovens, and the whole village woke to the smell of",  # > 32 tokens
]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True)


def _run(llm: LLM) -> list[tuple[tuple[int, ...], list]]:
    outs = llm.generate(PROMPTS, GREEDY)
    return [(tuple(o.token_ids), list(o.logprobs)) for o in outs]   # SampleLogprobs compare their floats exactly


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:   # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def _pool_files(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{pid}-")]


@pytest.fixture(scope="module")
def tp1():
    llm = LLM(num_blocks=64, max_model_len=512, max_batch_tokens=64, num_threads=2, tp_invariant=True)
    assert llm.engine.model.layers[0].mlp.down_proj.fold_block == 192   # 8 fold blocks of 1536
    yield llm, _run(llm)


def test_default_model_tp2_is_bit_identical_to_tp1_and_transformers(tp1, hf_default):
    llm1, out1 = tp1
    with LLM(num_blocks=64, max_model_len=512, max_batch_tokens=64, tensor_parallel_size=2) as llm2:
        assert llm2.engine.tp.plan.kv_head_assignment == ((0, 1), (2,))
        assert llm2.engine.model.layers[0].mlp.down_proj.fold_block == 192   # auto: on at TP 2
        assert _pool_files(os.getpid()) == []            # unlinked once every rank mapped its pool
        out2 = _run(llm2)
        assert out2 == out1                               # tokens and logprobs, bit for bit
        for (tokens, _), prompt in zip(out1, PROMPTS, strict=True):
            assert list(tokens) == hf_greedy(hf_default, llm1.tokenizer, prompt, MAX_NEW)
        # D15: the leader maps every rank's pool; together they hold TP 1's KV bytes, head by head
        spec_shards = llm2.engine.runner.tp.pool_tensors()
        full = llm1.engine.kv_cache.buffer                # [layers, 2, pages, 3, P, D]
        assert torch.equal(llm2.engine.kv_cache.buffer, full[:, :, :, 0:2])
        assert torch.equal(spec_shards[0], full[:, :, :, 2:3])
        assert spec_shards[0].abs().sum() > 0
        pids = llm2.engine.tp.worker_pids
    assert not any(_alive(p) for p in pids)


LOGPROB_TOLERANCE = 1e-3   # tp_invariant=False: each rank sums its share in one block (float32 rounding)


def test_without_tp_invariant_reductions_tp2_is_within_the_stated_tolerance(tp1):
    _, out1 = tp1
    with LLM(num_blocks=64, max_model_len=512, max_batch_tokens=64, tensor_parallel_size=2,
             tp_invariant=False) as llm2:
        assert llm2.engine.model.layers[0].mlp.down_proj.fold_block == 768   # one block: rank 0's whole share
        out2 = _run(llm2)
    for (t1, lps1), (t2, lps2) in zip(out1, out2, strict=True):
        assert t1 == t2
        for a, b in zip(lps1, lps2, strict=True):
            pairs = [(a.sampled, b.sampled), *zip(a.top, b.top, strict=True)]
            assert all(x.token_id == y.token_id for x, y in pairs)
            assert max(abs(x.logprob - y.logprob) for x, y in pairs) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize(("kv_heads", "heads", "tp", "assignment"), [
    (3, 6, 2, ((0, 1), (2,))),                 # uneven whole groups
    (2, 4, 4, ((0,), (0,), (1,), (1,))),       # replica sets: one query head per rank
])
def test_tiny_models_agree_with_tp1_bit_for_bit(tmp_path, kv_heads, heads, tp, assignment):
    path = make_tiny_checkpoint("qwen2", tmp_path / "tiny", num_key_value_heads=kv_heads,
                                num_attention_heads=heads, head_dim=16)   # qkv biases split with the heads
    opts = dict(model=str(path), num_blocks=48, max_model_len=256, max_batch_tokens=32)
    with LLM(num_threads=1, tp_invariant=True, **opts) as llm1:
        out1 = _run(llm1)
    with LLM(tensor_parallel_size=tp, **opts) as llm_tp:
        assert llm_tp.engine.tp.plan.kv_head_assignment == assignment
        assert _run(llm_tp) == out1


class LayerWatch(PrefillConnector):
    """At each on_layer_done(i) (D7, the leader only) looks, through the leader's mappings, at every
    rank's pages of the pass: layer i must be written on every rank and layer i + 1 on none yet."""

    def __init__(self) -> None:
        self.spec: KvCacheSpec | None = None
        self.pages: list[int] = []
        self.seen: list[tuple[int, bool, bool]] = []   # (layer, written everywhere, next layer untouched)

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        self.spec = spec

    def on_schedule(self, sched, block_ids) -> None:
        self.pages = sorted({p for (full,) in block_ids.values() for p in full})   # one group: "full"

    def on_layer_done(self, layer: int) -> None:
        pools = [s.buffer for s in self.spec.shards]      # [layers, 2, pages, heads_r, P, D] each
        written = all(bool(b[layer, :, self.pages].abs().sum() > 0) for b in pools)
        later = layer + 1 == len(pools[0]) or all(bool(b[layer + 1, :, self.pages].abs().sum() == 0) for b in pools)
        self.seen.append((layer, written, later))

    def on_prefill_done(self, done: PrefillDone) -> None:
        pass


def test_layer_counter_fires_on_the_leader_after_every_rank_wrote_the_layer(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny", num_hidden_layers=3)
    watch = LayerWatch()
    with LLM(model=str(path), num_blocks=16, max_model_len=128, tensor_parallel_size=2, kv_connector=watch) as llm:
        spec = watch.spec
        assert spec.tp_size == 2 and [s.rank for s in spec.shards] == [0, 1]
        assert [s.kv_heads for s in spec.shards] == [(0,), (1,)]
        assert spec.shards[0].buffer.data_ptr() == spec.buffer.data_ptr()
        llm.generate(["a fresh prompt of a few tokens"], SamplingParams(temperature=0, max_tokens=1))
    assert watch.seen == [(0, True, True), (1, True, True), (2, True, True)]


def test_impossible_split_is_refused_at_start(tmp_path):
    path = make_tiny_checkpoint("qwen2", tmp_path / "tiny", num_key_value_heads=3, num_attention_heads=6,
                                head_dim=16)
    with pytest.raises(ValueError, match="3 KV heads over tensor_parallel_size 4"):
        LLM(model=str(path), num_blocks=16, tensor_parallel_size=4)
    assert _pool_files(os.getpid()) == []


def _assert_fails_for_good(llm: LLM, match: str, max_tokens: int) -> None:
    """A generate call fails with a RuntimeError matching `match`, and the next one finds the engine failed."""
    with pytest.raises(RuntimeError, match=match):
        llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=max_tokens))
    with pytest.raises(RuntimeError, match="tensor-parallel engine failed"):   # failed for good
        llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=2))


def test_a_dead_worker_fails_the_engine_naming_it(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    llm = LLM(model=str(path), num_blocks=16, max_model_len=128, tensor_parallel_size=2)
    try:
        (pid,) = llm.engine.tp.worker_pids
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 10, "the killed worker to exit")
        _assert_fails_for_good(llm, r"rank 1 \(pid \d+\)", max_tokens=4)
    finally:
        llm.close()


class FailingLayerHook(NoOpPrefillConnector):
    """Raises a KeyError (not a RuntimeError / ValueError) from the leader's layer hook mid-pass."""

    def on_layer_done(self, layer: int) -> None:
        if layer == 1:
            raise KeyError(f"layer {layer}")


def test_any_failure_of_the_leaders_pass_fails_the_group_for_good(tmp_path):
    # The workers are inside the pass's collectives when the leader fails mid-pass: whatever the
    # exception type, the group is failed, never driven on out of step.
    path = make_tiny_checkpoint("llama", tmp_path / "tiny", num_hidden_layers=3)
    llm = LLM(model=str(path), num_blocks=16, max_model_len=128, tensor_parallel_size=2,
              kv_connector=FailingLayerHook())
    try:
        _assert_fails_for_good(llm, "a pass failed on the leader: KeyError", max_tokens=2)
    finally:
        llm.close()


def test_workers_die_with_a_sigkilled_leader(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    script = textwrap.dedent(f"""
        import json, sys, time
        from pdserve import LLM, SamplingParams
        llm = LLM(model={str(path)!r}, num_blocks=16, max_model_len=128, tensor_parallel_size=2)
        llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=2))
        print(json.dumps(list(llm.engine.tp.worker_pids)), flush=True)
        time.sleep(600)
    """)
    leader = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        pids = json.loads(leader.stdout.readline())
        assert pids and all(_alive(p) for p in pids)
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        wait_until(lambda: not any(_alive(p) for p in pids), 15, f"workers {pids} to exit after the leader's SIGKILL")
        assert _pool_files(leader.pid) == []
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(10)
