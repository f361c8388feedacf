"""A full context staging pool fails one prefill, never the engine step or the other requests (S8).

Two real engines over shm in one process (as test_kv_messenger): a prefill engine whose KvSender
has one context staging slot, held (as by a context whose write is still in flight), finishes a
transfer's prefill and a plain request in the same steps. The transfer's future fails with
StagingFullError (RESOURCE_EXHAUSTED) naming the capacity, the plain request ends with the same
tokens as a lone engine, the step never raises, the prefill engine frees every block; once the
slot is back, the next transfer lands and the decode engine's greedy output equals a lone
engine's.
"""

from __future__ import annotations

import grpc
import pytest
from support.kv_events import QueueEvents
from support.side_jobs import pump

from fabric import FabricConfig, TransferEngine
from kv_messenger import KvReceiver, KvSender
from kv_messenger.context import StagingFullError
from pdserve import LLM, SamplingParams
from pdserve.engine.request import TransferRole

PROMPT = "Once upon a time, in a land far away, there lived " * 3
PLAIN = "The capital of France is"


@pytest.mark.timeout(300)
def test_full_staging_pool_fails_only_that_prefill():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = LLM(num_blocks=128)
    want_plain, want_kv = alone.generate([PLAIN, PROMPT], params)

    fab_p, fab_d = TransferEngine(FabricConfig(provider="shm")), TransferEngine(FabricConfig(provider="shm"))
    events = QueueEvents()
    jobs = events.jobs
    sender = None
    try:
        receiver = KvReceiver(fab_d, events)
        decode = LLM(num_blocks=128, kv_connector=receiver).engine
        sender = KvSender(fab_p, staging_slots=1)
        prefill = LLM(num_blocks=64, max_batch_tokens=32, kv_connector=sender).engine
        fab_p.connect(fab_d.peer_descriptor)

        held = sender.staging_slots.take("a context still being written")   # the pool is now full
        for rid in ("full", "later"):
            decode.add_request(PROMPT, params, request_id=rid, role=TransferRole.REMOTE_PREFILL)
        decode.step()
        tickets = {rid: receiver.address(t, 1) for rid, t in events.tickets.items()}   # a TP 1 prefill side

        def start(rid: str):
            fut = sender.add(tickets[rid])
            fut.add_done_callback(lambda _f, rid=rid: jobs.put(("release", rid)))
            prefill.add_request(decode._tracked[rid].request.prompt_token_ids[:-1], SamplingParams(max_tokens=1),
                                request_id=rid, role=TransferRole.PREFILL)
            return fut

        full = start("full")
        prefill.add_request(PLAIN, params, request_id="plain")
        outs = {}
        while prefill.has_unfinished_requests():
            outs.update({o.request_id: o for o in prefill.step() if o.finished})   # never raises
        with pytest.raises(StagingFullError, match="all 1 context staging slots hold contexts") as err:
            full.result(timeout=30)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert outs["plain"].error is None and outs["plain"].completion.token_ids == want_plain.token_ids
        pump(prefill, sender, decode, receiver, jobs, set())
        assert prefill.pool.num_used_blocks == 0
        decode.abort_request("full")   # its KV never came (the decode node would retry it elsewhere)

        sender.staging_slots.give(held)   # the write in flight completed: the node serves again
        later = start("later")
        while prefill.has_unfinished_requests():
            prefill.step()
        assert pump(prefill, sender, decode, receiver, jobs, {"later"}) == {"later"}
        assert later.result(timeout=10).num_writes == tickets["later"].expected_writes
        done = {}
        while decode.has_unfinished_requests():
            done.update({o.request_id: o.completion for o in decode.step() if o.finished})
        assert done["later"].token_ids == want_kv.token_ids
        assert prefill.pool.num_used_blocks == 0 and sender.staging_slots.free == 1
    finally:
        if sender is not None:
            sender.close()
        fab_p.close()
        fab_d.close()
