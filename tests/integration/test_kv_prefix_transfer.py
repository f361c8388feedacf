"""A prefill node's prefix-cache hit still sends every prompt page to the decode node.

The prefill engine computes a repeated prompt from its first uncached token, so its first pass
starts mid-prompt; the KV messenger must post the cached pages too, or the decode side's
immediate-data count never completes. Two real engines, real libfabric (shm), one process.
"""

from __future__ import annotations

import queue
import time

import torch

from fabric import FabricConfig, TransferEngine
from kv_messenger import ContextCodec, KvReceiver, KvSender, TransferTarget
from kv_messenger.wiring import layout_of, register_kv
from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import EngineHooks

PROMPT = "Once upon a time, in a land far away, there lived a king who " * 5


def test_prefix_cached_prompt_sends_every_page():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(num_blocks=128).generate([PROMPT], params)[0]

    cfg = FabricConfig(provider="shm")
    fab_p, fab_d = TransferEngine(cfg), TransferEngine(cfg)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    try:
        tickets: dict[str, list[int]] = {}
        decode = LLM(num_blocks=128, hooks=EngineHooks(
            on_kv_wait=lambda r, blocks: tickets.__setitem__(r.request_id, blocks))).engine
        codec = ContextCodec(decode.arch.hidden_size)
        receiver = KvReceiver(fab_d, register_kv(fab_d, decode.kv_cache), layout_of(decode.kv_cache), codec,
                              on_ready=lambda rid: jobs.put(("ready", rid)))
        hooks = EngineHooks()
        prefill = LLM(num_blocks=64, max_batch_tokens=32, hooks=hooks).engine
        sender = KvSender(fab_p, register_kv(fab_p, prefill.kv_cache), layout_of(prefill.kv_cache),
                          block_table=prefill.block_table, release=lambda rid: jobs.put(("release", rid)),
                          codec=codec)
        hooks.on_schedule, hooks.on_layer_done, hooks.on_prefill_done = (
            sender.on_schedule, sender.on_layer_done, sender.on_prefill_done)
        fab_p.connect(fab_d.peer_descriptor)

        cached_tokens = []
        for rid in ("cold", "warm"):
            decode.add_request(PROMPT, params, request_id=rid, remote_prefill=True)
            decode.step()
            r = decode.get_request(rid)
            t = receiver.prepare(rid, r.num_prompt_tokens, tickets[rid])
            fut = sender.add(TransferTarget(rid, t.kv, t.layout, t.dst_pages, t.context, t.context_offset,
                                            t.imm_tag, t.expected_writes, t.num_prefill_tokens))
            pr = prefill.add_request(r.prompt_token_ids[:-1], SamplingParams(max_tokens=1), request_id=rid,
                                     prefill_only=True, hold_blocks=True)
            while prefill.has_unfinished_requests():
                prefill.step()
            cached_tokens.append(pr.num_cached_tokens)
            ready = released = False
            deadline = time.monotonic() + 20
            while not (ready and released) and time.monotonic() < deadline:
                try:
                    kind, got = jobs.get(timeout=0.1)
                except queue.Empty:
                    continue
                assert got == rid
                if kind == "ready":
                    ready = True
                    assert torch.isfinite(receiver.context(rid).hidden).all()
                    receiver.finish(rid)
                    decode.kv_ready(rid)
                else:
                    released = True
                    prefill.release_blocks(rid)
            assert ready, f"{rid}: the decode side's write count never completed"
            assert released
            assert fut.result(timeout=10).num_writes == t.expected_writes
            out = None
            while decode.has_unfinished_requests():
                out = next((o.completion for o in decode.step() if o.finished), out)
            assert out.token_ids == expected.token_ids, rid
        page = prefill.kv_cache.shape.page_size
        # The second prefill really started mid-prompt (the case under test).
        assert cached_tokens[0] == 0 and cached_tokens[1] >= 2 * page, cached_tokens
        prefill.check_integrity()
        decode.check_integrity()
        sender.close()
    finally:
        fab_p.close()
        fab_d.close()
