"""Engine-side disaggregation without the network: a prefill-only engine and a remote-prefill
engine in one process, with the KV pages copied by hand between their pools.

This pins the engine contract the KV messenger builds on (pdserve.engine.kv_connector), through
recording connectors: the decode engine allocates pages for
all prompt tokens but the last at admission and never schedules the request before `kv_ready`
(D3, D4); the prefill engine computes the prompt minus its last token, never samples, reports the last position's
hidden state and logits, and keeps its pages until `release_blocks` (D11, D12, D17). The decode
engine's first step runs the last prompt token over the copied KV, and greedy output equals a
single engine's.
"""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_connector import DecodeConnector, KvCacheSpec, KvWait, PrefillConnector, PrefillDone
from pdserve.engine.request import RequestStatus

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived " * 5, "Hi"]


class RecordingDecode(DecodeConnector):
    def __init__(self) -> None:
        self.specs: list[KvCacheSpec] = []
        self.waits: dict[str, KvWait] = {}

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        self.specs.append(spec)

    def on_kv_wait(self, wait: KvWait) -> None:
        self.waits[wait.request_id] = wait


class RecordingPrefill(PrefillConnector):
    def __init__(self) -> None:
        self.specs: list[KvCacheSpec] = []
        self.passes: list[tuple[tuple[str, ...], dict[str, tuple[int, ...]]]] = []
        self.layers: list[list[int]] = []
        self.done: dict[str, PrefillDone] = {}

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        self.specs.append(spec)

    def on_schedule(self, sched, block_ids) -> None:
        self.passes.append((tuple(c.request_id for c in sched.chunks), dict(block_ids)))
        self.layers.append([])

    def on_layer_done(self, layer: int) -> None:
        self.layers[-1].append(layer)

    def on_prefill_done(self, done: PrefillDone) -> None:
        self.done[done.request_id] = done


def test_prefill_engine_to_decode_engine_by_page_copy():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM(num_blocks=128).generate(PROMPTS, params)

    dconn, pconn = RecordingDecode(), RecordingPrefill()
    decode = LLM(num_blocks=128, kv_connector=dconn).engine
    prefill = LLM(num_blocks=64, max_batch_tokens=32, kv_connector=pconn).engine
    for conn, eng in ((dconn, decode), (pconn, prefill)):   # the pool, handed over once while building
        (spec,) = conn.specs
        assert spec.buffer.data_ptr() == eng.kv_cache.buffer.data_ptr() and spec.shape == eng.kv_cache.shape
        assert [g.name for g in spec.groups] == ["full"] and spec.groups[0].layers == tuple(range(eng.arch.num_layers))
        assert spec.hidden_size == eng.arch.hidden_size

    for i, p in enumerate(PROMPTS):
        decode.add_request(p, params, request_id=f"r{i}", remote_prefill=True)
    decode.step()  # admission only: nothing can run before the KV lands
    waits = {rid: list(w.block_ids) for rid, w in dconn.waits.items()}
    multi = [f"r{i}" for i, p in enumerate(PROMPTS) if len(decode.tokenize(p)) > 1]
    assert sorted(waits) == multi
    for rid in multi:
        r = decode._tracked[rid].request
        assert dconn.waits[rid].prompt_token_ids == tuple(r.prompt_token_ids)
        assert r.status is RequestStatus.WAITING_FOR_KV
        assert len(waits[rid]) == decode.cache_manager.num_blocks_for(r.num_prompt_tokens - 1)
    for _ in range(3):
        assert all(decode._tracked[rid].request.num_computed_tokens == 0 for rid in multi)
        decode.step()  # the one-token prompt runs; the waiting ones are never scheduled (D4)

    for rid in multi:
        ids = decode._tracked[rid].request.prompt_token_ids
        prefill.add_request(ids[:-1], SamplingParams(max_tokens=1), request_id=rid, prefill_only=True, hold_blocks=True)
    outs = []
    while prefill.has_unfinished_requests():
        outs += [o for o in prefill.step() if o.finished]
    assert {o.request_id for o in outs} == set(multi)
    assert all(o.finish_reason == "prefilled" and o.completion.token_ids == () for o in outs)
    assert prefill.num_held_requests == len(multi)
    # Every pass was announced with each request's pages, and every layer reported in order (D6, D7).
    assert pconn.passes and all(layers == list(range(prefill.arch.num_layers)) for layers in pconn.layers)
    for rids, block_ids in pconn.passes:
        assert set(block_ids) == set(rids)
        assert all(len(tables) == 1 for tables in block_ids.values())   # one table: the "full" group's
    for rid in multi:
        assert pconn.passes[-1][1].get(rid, (pconn.done[rid].block_ids,)) == (pconn.done[rid].block_ids,)
        assert dconn.waits[rid].tables == (dconn.waits[rid].block_ids,)

    for rid in multi:
        src = prefill.block_table(rid)
        dst = waits[rid]
        n_prompt = len(decode._tracked[rid].request.prompt_token_ids)
        assert len(src) == len(dst)
        # buffer: [layers, 2, pages, kv_heads, page_size, head_dim]
        decode.kv_cache.buffer[:, :, dst] = prefill.kv_cache.buffer[:, :, src]
        assert pconn.done[rid].block_ids == tuple(src)
        hidden, logits = pconn.done[rid].hidden, pconn.done[rid].logits
        assert hidden.shape == (decode.arch.hidden_size,) and logits.shape == (decode.arch.vocab_size,)
        assert prefill.release_blocks(rid) == len(src)
        decode.kv_ready(rid)
        assert n_prompt > 1
    prefill.check_integrity()
    assert prefill.pool.num_used_blocks == 0

    done = {}
    while decode.has_unfinished_requests():
        for o in decode.step():
            if o.finished:
                done[o.request_id] = o.completion
    for i, e in enumerate(expected):
        assert done[f"r{i}"].token_ids == e.token_ids
    decode.check_integrity()
    assert decode.pool.num_used_blocks == 0


def test_abandoned_remote_prefill_falls_back_to_local_or_fails_cleanly():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(num_blocks=64).generate(["The capital of France is"], params)[0]
    eng = LLM(num_blocks=64).engine
    eng.add_request("The capital of France is", params, request_id="local", remote_prefill=True)
    eng.add_request("The capital of France is", params, request_id="fail", remote_prefill=True)
    eng.step()
    assert eng.kv_abandoned("local", prefill_locally=True, error="prefill node unreachable") is None
    out = eng.kv_abandoned("fail", prefill_locally=False, error="prefill node unreachable")
    assert out.finished and out.finish_reason == "error" and out.error == "prefill node unreachable"
    # S5: a failed remote prefill keeps its pages (a write may still land) until its owner says
    # none can; freeing them here was the bug of issue 15.
    assert eng.is_held("fail")
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.completion for o in eng.step() if o.finished})
    assert done["local"].token_ids == expected.token_ids
    eng.check_integrity()
    held = len(eng.block_table("fail"))
    assert held > 0 and eng.pool.num_used_blocks == held
    assert eng.release_blocks("fail") == held
    eng.check_integrity()
    assert eng.pool.num_used_blocks == 0


def test_quarantined_pages_are_reused_by_nobody_until_released():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The capital of France is"
    expected = LLM(num_blocks=64).generate([prompt], params)[0]
    eng = LLM(num_blocks=64).engine
    total = eng.pool.num_usable_blocks
    eng.add_request(prompt, params, request_id="r", remote_prefill=True)
    eng.step()
    first = eng.block_table("r")
    assert first
    # attempt 0 may still be written: its pages go to quarantine, the request is admitted again
    assert eng.quarantine_blocks("r", "r#0") == len(first)
    assert eng.num_quarantined_blocks == len(first) and eng.block_table("r") == []
    assert eng.kv_retry("r", prefill_locally=True)
    eng.check_integrity()
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.completion for o in eng.step() if o.finished})
        assert not set(eng.block_table("r")) & set(first)   # never the quarantined pages
    assert done["r"].token_ids == expected.token_ids
    eng.check_integrity()
    assert eng.pool.num_empty_blocks + eng.pool.num_cached_blocks + eng.num_quarantined_blocks == total
    assert eng.release_quarantine("r#0") == len(first)
    eng.check_integrity()
    assert eng.num_quarantined_blocks == 0 and eng.pool.num_used_blocks == 0
