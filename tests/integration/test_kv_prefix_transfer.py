"""A prefill node's prefix-cache hit still sends every prompt page to the decode node.

The prefill engine computes a repeated prompt from its first uncached token, so its first pass
starts mid-prompt; the KV messenger must post the cached pages too, or the decode side's
immediate-data count never completes. Two real engines, real libfabric (shm), one process.
"""

from __future__ import annotations

import queue
import time

import torch
from support.kv_events import QueueEvents

from fabric import FabricConfig, TransferEngine
from kv_messenger import KvReceiver, KvSender
from pdserve import LLM, SamplingParams
from pdserve.engine.kv_connector import KvLanded
from pdserve.engine.request import TransferRole

PROMPT = "Once upon a time, in a land far away, there lived a king who " * 5


def test_prefix_cached_prompt_sends_every_page():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(num_blocks=128).generate([PROMPT], params)[0]

    cfg = FabricConfig(provider="shm")
    fab_p, fab_d = TransferEngine(cfg), TransferEngine(cfg)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    try:
        events = QueueEvents(jobs)
        receiver = KvReceiver(fab_d, events)
        decode = LLM(num_blocks=128, kv_connector=receiver).engine
        sender = KvSender(fab_p)
        prefill = LLM(num_blocks=64, max_batch_tokens=32, kv_connector=sender).engine
        fab_p.connect(fab_d.peer_descriptor)

        cached_tokens = []
        for rid in ("cold", "warm"):
            decode.add_request(PROMPT, params, request_id=rid, role=TransferRole.REMOTE_PREFILL)
            decode.step()
            r = decode.get_request(rid)
            t = receiver.address(events.tickets[rid], 1)   # a TP 1 prefill side
            fut = sender.add(t)
            fut.add_done_callback(lambda _f, rid=rid: jobs.put(("release", rid)))
            pr = prefill.add_request(r.prompt_token_ids[:-1], SamplingParams(max_tokens=1), request_id=rid,
                                     role=TransferRole.PREFILL)
            while prefill.has_unfinished_requests():
                prefill.step()
            cached_tokens.append(pr.num_prefix_hit_tokens)
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
                    events.apply(decode, KvLanded(rid))
                else:
                    released = True
                    sender.post_release(rid)
                    prefill.apply_kv_events()
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
