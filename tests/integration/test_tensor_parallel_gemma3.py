"""Gemma 3 (hybrid: sliding-window and full attention groups) under engine tensor parallelism (E22, E8; issue 16).

The tiny random Gemma 3 (tests/support/tiny_models.py, TINY_GEMMA3: 4 layers sliding / full /
sliding / sliding, a 16-token window, Gemma's norms, GeGLU, embedding scale, soft-capping) runs at
TP 1 with tp_invariant=True (the reference, as a TP 1 node of a TP cluster runs) and at TP 2 with
KV heads that split evenly (2 KV heads: one per rank), by uneven whole GQA groups (3 KV heads:
rank 0 holds 2, rank 1 holds 1; hidden 96) and replicated (1 KV head, as gemma-3-270m has, on both
ranks, its 4 query heads split 2 / 2), and at TP 4 in replica sets (2 KV heads, each on 2 ranks
holding one query head each: 4 processes on 2 cores).
Both engines are stepped in lockstep on the same requests (pages of 4 tokens, chunks of at most 48,
so the long prompt's first chunk takes torch's GEMM and the decode steps the C kernel; the long
prompt spans several windows, so its sliding pages are recycled while it runs):

- every step gives the same greedy tokens and the same top-3 logprobs, bit for bit;
- the two engines hold the same block tables in both attention groups at every step, the long
  request's sliding table ends with recycled entries (the padding block), and after every step
  every rank's KV pool, as the leader maps it (KvCacheSpec.shards), holds exactly TP 1's bytes of
  its KV heads ([layers, 2, pages, rank_kv_heads, P, D], the TP 1 layout), including the pages of
  both groups, which are non-zero for the layers of their kind on every rank;
- at the even split the tokens equal transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from support.reference import hf_greedy
from support.tiny_models import TINY_GEMMA3, TINY_GEMMA3_WINDOW, make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.cache.groups import PADDING_BLOCK
from pdserve.engine.kv_connector import KvCacheSpec, PrefillConnector, PrefillDone
from pdserve.model.arch import FULL_ATTENTION, SLIDING_ATTENTION

PAGE = 4
CHUNK = 48
NEW_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a dragon who " * 5,   # > 32 tokens, several windows
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=3, ignore_eos=True)


class SpecProbe(PrefillConnector):
    """Keeps the KvCacheSpec the engine registers (every rank's pool as the leader maps it); it
    never asks a request to stay, so the engine runs as without a connector."""

    def __init__(self) -> None:
        self.spec: KvCacheSpec | None = None

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        self.spec = spec

    def on_schedule(self, sched, block_ids) -> None:
        pass

    def on_layer_done(self, layer: int) -> None:
        pass

    def on_prefill_done(self, done: PrefillDone) -> None:
        pass


def _tables(engine, ids: list[str]) -> dict[tuple[str, str], tuple[int, ...]]:
    cm = engine.cache_manager
    return {(r, g): tuple(cm.block_table(r, g)) for r in ids if cm.has(r) for g in cm.group_names}


@pytest.mark.parametrize(("kv_heads", "heads", "hidden", "tp", "assignment"), [
    (2, 4, 64, 2, ((0,), (1,))),                 # even split
    (3, 6, 96, 2, ((0, 1), (2,))),               # uneven whole GQA groups (Gemma's config wants hidden = heads * 16)
    (1, 4, 64, 2, ((0,), (0,))),                 # one KV head replicated, its query heads split
    (2, 4, 64, 4, ((0,), (0,), (1,), (1,))),     # replica sets: one query head per rank, a 4-rank fold
], ids=["even", "uneven", "replicated", "tp4-replica-sets"])
def test_gemma3_under_tp_is_bit_identical_to_tp1_in_tokens_logprobs_and_kv(tmp_path, kv_heads, heads, hidden, tp,
                                                                           assignment):
    path = make_tiny_checkpoint(TINY_GEMMA3, tmp_path / "tiny", num_key_value_heads=kv_heads,
                                num_attention_heads=heads, hidden_size=hidden)
    opts = dict(model=str(path), num_blocks=96, page_size=PAGE, max_batch_tokens=CHUNK, max_model_len=128)
    probe = SpecProbe()
    with LLM(num_threads=1, tp_invariant=True, **opts) as llm1, \
            LLM(tensor_parallel_size=tp, kv_connector=probe, **opts) as llm2:
        e1, e2 = llm1.engine, llm2.engine
        assert e2.tp.plan.kv_head_assignment == assignment
        assert e2.cache_manager.group_names == ("full", "sliding")
        spec = probe.spec
        assert [s.kv_heads for s in spec.shards] == list(assignment)
        pools = [s.buffer for s in spec.shards]            # [layers, 2, pages, rank_kv_heads, P, D] each
        full = e1.kv_cache.buffer                           # [layers, 2, pages, kv_heads, P, D]
        assert [tuple(p.shape) for p in pools] == [(*full.shape[:3], len(a), *full.shape[4:]) for a in assignment]
        types = e1.arch.layer_types
        layers_of = {"full": [i for i, t in enumerate(types) if t == FULL_ATTENTION],
                     "sliding": [i for i, t in enumerate(types) if t == SLIDING_ATTENTION]}
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS, strict=True):
            e1.add_request(prompt, GREEDY, request_id=rid)
            e2.add_request(prompt, GREEDY, request_id=rid)
        tokens = {rid: [] for rid in ids}
        recycled = False
        written = {"full": set(), "sliding": set()}        # pages each group's tables pointed at
        while e1.has_unfinished_requests():
            assert e2.has_unfinished_requests()
            out1, out2 = e1.step(), e2.step()
            assert [(o.request_id, o.new_token_ids, o.new_logprobs) for o in out2] == \
                [(o.request_id, o.new_token_ids, o.new_logprobs) for o in out1]    # logprobs compare exactly
            for o in out1:
                tokens[o.request_id].extend(o.new_token_ids)
            tables = _tables(e1, ids)
            assert _tables(e2, ids) == tables
            recycled |= any(PADDING_BLOCK in t for (_, g), t in tables.items() if g == "sliding")
            for (_, g), t in tables.items():
                written[g].update(p for p in t if p != PADDING_BLOCK)
            for heads_r, pool in zip(assignment, pools, strict=True):
                assert torch.equal(pool, full[:, :, :, list(heads_r)])
        assert not e2.has_unfinished_requests()
    assert recycled, "the long prompt's sliding pages were never recycled"
    for group, pages in written.items():      # both groups' pages written on every rank, by their layers
        assert pages
        for pool in pools:
            assert all(bool(pool[i, :, sorted(pages)].abs().sum(dim=(0, 2, 3, 4)).gt(0).all())
                       for i in layers_of[group]), group
    assert len(llm1.tokenizer(PROMPTS[1])["input_ids"]) > 2 * TINY_GEMMA3_WINDOW
    if tp == 2 and kv_heads == 2:   # the even split: also transformers' greedy tokens
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for rid, prompt in zip(ids, PROMPTS, strict=True):
            assert tokens[rid] == hf_greedy(hf, llm1.tokenizer, prompt, NEW_TOKENS)
