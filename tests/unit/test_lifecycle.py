"""E1: a request's lifecycle, PENDING -> PREFILLING -> DECODING -> FINISHED, step by step through a
real engine (tiny model), and visible in the engine's gauges (waiting / running) that /metrics exports."""

from __future__ import annotations

from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.request import RequestStatus


def test_request_moves_through_every_state_and_the_gauges_follow(tmp_path):
    engine = LLM(model=str(make_tiny_checkpoint("llama", tmp_path / "tiny")), num_blocks=64, max_batch_tokens=16,
                 num_threads=1).engine
    r = engine.add_request(list(range(5, 45)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert r.status is RequestStatus.PENDING
    m = engine.metrics()
    assert (m.num_waiting, m.num_running) == (1, 0)

    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append(r.status)
        m = engine.metrics()
        if r.status is not RequestStatus.FINISHED:
            assert (m.num_waiting, m.num_running) == (0, 1)
    # 40 prompt tokens at 16 per pass: chunks of 16, 16 and 8 (the last one samples the first token),
    # then two decodes; the third token ends the request
    assert seen == [RequestStatus.PREFILLING, RequestStatus.PREFILLING, RequestStatus.DECODING,
                    RequestStatus.DECODING, RequestStatus.FINISHED]
    assert r.output_token_ids and len(r.output_token_ids) == 3
    m = engine.metrics()
    assert (m.num_waiting, m.num_running) == (0, 0)
