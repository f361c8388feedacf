"""Engine-side disaggregation without the network: a prefill-only engine and a remote-prefill
engine in one process, with the KV pages copied by hand between their pools.

This pins the engine contract the KV messenger builds on (pdserve.engine.kv_connector), through
recording connectors: the decode engine allocates pages for
all prompt tokens but the last at admission and never schedules the request before its KvLanded
event (D3, D4); the prefill engine computes the prompt minus its last token, never samples,
reports the last position's hidden state and logits, and keeps its pages until a KvReleased
(D11, D12, D17). The decode engine's first step runs the last prompt token over the copied KV,
and greedy output equals a single engine's. The way back is the connectors' events only
(KvLanded, KvFailed, KvQuarantined, KvReleased), applied by the engine when it takes them.
"""

from __future__ import annotations

import pytest
from support.kv_events import EngineEvents

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_connector import (
    DecodeConnector,
    KvCacheSpec,
    KvFailed,
    KvFailure,
    KvLanded,
    KvQuarantined,
    KvReleased,
    KvWait,
    PrefillConnector,
    PrefillDone,
)
from pdserve.engine.request import RequestStatus, TransferRole

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived " * 5, "Hi"]


class RecordingDecode(EngineEvents, DecodeConnector):
    def __init__(self) -> None:
        super().__init__()
        self.specs: list[KvCacheSpec] = []
        self.waits: dict[str, KvWait] = {}

    def register_kv_cache(self, spec: KvCacheSpec) -> None:
        self.specs.append(spec)

    def on_kv_wait(self, wait: KvWait) -> None:
        self.waits[wait.request_id] = wait


class RecordingPrefill(EngineEvents, PrefillConnector):
    def __init__(self) -> None:
        super().__init__()
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
        decode.add_request(p, params, request_id=f"r{i}", role=TransferRole.REMOTE_PREFILL)
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
        prefill.add_request(ids[:-1], SamplingParams(max_tokens=1), request_id=rid, role=TransferRole.PREFILL)
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
        assert prefill.holds_pages(rid)
        pconn.apply(prefill, KvReleased(request_id=rid))
        assert not prefill.holds_pages(rid)
        dconn.apply(decode, KvLanded(rid))
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


def test_failed_remote_prefill_falls_back_to_local_or_fails_cleanly():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(num_blocks=64).generate(["The capital of France is"], params)[0]
    conn = RecordingDecode()
    eng = LLM(num_blocks=64, kv_connector=conn).engine
    for rid in ("local", "fail", "gone"):
        eng.add_request("The capital of France is", params, request_id=rid, role=TransferRole.REMOTE_PREFILL)
    eng.step()
    per_request = len(eng.block_table("fail"))
    # no write can land (KvFailed): computed here in its pages, or ended with its pages freed
    (out,) = conn.apply(eng, KvFailed("local", KvFailure.PREFILL_LOCALLY, "prefill node unreachable"),
                        KvFailed("fail", KvFailure.END, "prefill node unreachable"))
    assert out.request_id == "fail" and out.finished and out.finish_reason == "error"
    assert out.error == "prefill node unreachable" and not eng.holds_pages("fail")
    # S5: a request that ends while its KV is still arriving keeps its pages held (a write may
    # still land), until the connector says what became of the transfer (freeing them at the
    # abort was the bug of issue 15)
    assert eng.abort_request("gone").finished and eng.holds_pages("gone")
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.completion for o in eng.step() if o.finished})
    assert done["local"].token_ids == expected.token_ids
    eng.check_integrity()
    assert eng.pool.num_used_blocks == per_request == eng.num_held_requests * per_request
    assert conn.apply(eng, KvLanded("gone")) == []   # it landed after all: nobody decodes, the pages go
    eng.check_integrity()
    assert eng.pool.num_used_blocks == 0 and eng.num_held_requests == 0


def test_quarantined_pages_are_reused_by_nobody_until_released():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The capital of France is"
    expected = LLM(num_blocks=64).generate([prompt], params)[0]
    conn = RecordingDecode()
    eng = LLM(num_blocks=64, kv_connector=conn).engine
    total = eng.pool.num_usable_blocks
    eng.add_request(prompt, params, request_id="r", role=TransferRole.REMOTE_PREFILL)
    eng.step()
    first = eng.block_table("r")
    assert first and conn.waits["r"].block_ids == tuple(first)
    # attempt 0 may still be written: its pages go to quarantine, the request is admitted again
    conn.apply(eng, KvQuarantined("r", "r#0", KvFailure.RETRY, "prefill node stalled"))
    assert eng.quarantined_blocks("r#0") == len(first) == eng.num_quarantined_blocks
    assert eng.block_table("r") == [] and eng.num_quarantines == 1
    eng.check_integrity()
    eng.step()   # admitted again: fresh pages, a new KvWait
    second = conn.waits["r"].block_ids
    assert second and not set(second) & set(first)
    conn.apply(eng, KvFailed("r", KvFailure.PREFILL_LOCALLY, "no prefill node left"))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.completion for o in eng.step() if o.finished})
        assert not set(eng.block_table("r")) & set(first)   # never the quarantined pages
    assert done["r"].token_ids == expected.token_ids
    eng.check_integrity()
    assert eng.pool.num_empty_blocks + eng.pool.num_cached_blocks + eng.num_quarantined_blocks == total
    conn.apply(eng, KvReleased(hold_id="r#0"))
    assert eng.quarantined_blocks("r#0") is None
    eng.check_integrity()
    assert eng.num_quarantined_blocks == 0 and eng.pool.num_used_blocks == 0


def test_a_quarantine_takes_an_ended_requests_held_pages_and_an_unknown_request_is_a_no_op():
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conn = RecordingDecode()
    eng = LLM(num_blocks=64, kv_connector=conn).engine
    eng.add_request("The capital of France is", params, request_id="r", role=TransferRole.REMOTE_PREFILL)
    eng.step()
    pages = eng.block_table("r")
    eng.abort_request("r")   # ended while its KV was arriving: held
    conn.apply(eng, KvQuarantined("r", "r#0", KvFailure.END, "client gone"))
    assert not eng.holds_pages("r") and eng.quarantined_blocks("r#0") == len(pages)
    with pytest.raises(ValueError, match="in use"):   # a hold id names one quarantine
        eng.add_request("The capital of Spain is", params, request_id="s", role=TransferRole.REMOTE_PREFILL)
        eng.step()
        conn.apply(eng, KvQuarantined("s", "r#0", KvFailure.END, "again"))
    assert eng.get_request("s").status is RequestStatus.WAITING_FOR_KV   # the refused event changed nothing
    # events for requests the engine no longer has change nothing
    assert conn.apply(eng, KvLanded("nobody"), KvFailed("nobody", KvFailure.END, "x"),
                      KvQuarantined("nobody", "nobody#0", KvFailure.END, "x"), KvReleased(request_id="nobody")) == []
    assert eng.quarantined_blocks("nobody#0") is None and eng.num_quarantines == 1
    conn.apply(eng, KvReleased(hold_id="r#0"), KvFailed("s", KvFailure.END, "done"))
    eng.check_integrity()
    assert eng.pool.num_used_blocks == 0 and not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="cannot prefill locally"):
        KvQuarantined("r", "r#1", KvFailure.PREFILL_LOCALLY, "x")
    with pytest.raises(ValueError, match="exactly one"):
        KvReleased()


def test_a_prefill_request_released_while_it_runs_is_not_held_when_it_ends():
    conn = RecordingPrefill()
    eng = LLM(num_blocks=64, kv_connector=conn).engine
    params = SamplingParams(max_tokens=1)
    eng.add_request("The capital of France is", params, request_id="early", role=TransferRole.PREFILL)
    eng.add_request("The capital of France is", params, request_id="late", role=TransferRole.PREFILL)
    conn.apply(eng, KvReleased(request_id="early"))   # its transfer ended before its prefill did
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.holds_pages("early") and eng.holds_pages("late")
    conn.apply(eng, KvReleased(request_id="late"))
    eng.check_integrity()
    assert eng.pool.num_used_blocks == 0
    # with no prefill connector nothing reads a PREFILL request's pages: never held
    plain = LLM(num_blocks=64).engine
    plain.add_request("Hi there", params, request_id="p", role=TransferRole.PREFILL)
    while plain.has_unfinished_requests():
        plain.step()
    assert not plain.holds_pages("p") and plain.pool.num_used_blocks == 0
