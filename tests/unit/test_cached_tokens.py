"""RequestOutput.num_cached_tokens: prompt tokens an engine took from its prefix cache (E12).

Counted at the request's first admission, on every output of the request, and carried into the
wire's Usage.cached_prompt_tokens (pdserve.serving.convert). A prefill-only request (a prefill node's)
reports its hit the same way; a remote-prefill request (a decode node's) reports 0: its KV was
computed elsewhere, and the decode node reports the prefill node's count instead (tested through
the HTTP API in test_http_api.py).
"""

from __future__ import annotations

import pytest
from support.kv_events import EngineEvents
from support.tiny_models import make_tiny_checkpoint

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_connector import DecodeConnector, KvFailed, KvFailure
from pdserve.engine.request import TransferRole
from pdserve.serving.convert import output_to_pb

PAGE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class Events(EngineEvents, DecodeConnector):
    """The decode connector of `engine`: its remote-prefill requests' events come from the test."""

    def register_kv_cache(self, spec) -> None:
        pass

    def on_kv_wait(self, wait) -> None:
        pass


@pytest.fixture(scope="module")
def conn():
    return Events()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, conn):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama") / "tiny")
    return LLM(str(path), num_blocks=64, page_size=PAGE, num_threads=1, max_batch_tokens=64,
               kv_connector=conn).engine


def run(engine, ids, rid, **flags):
    engine.add_request(ids, PARAMS, request_id=rid, **flags)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_a_repeated_prompt_reports_its_cached_tokens(engine):
    ids = list(range(1000, 1018))  # 18 tokens: 4 full pages
    first = run(engine, ids, "first")
    assert [o.num_cached_tokens for o in first] == [0, 0, 0]
    second = run(engine, ids, "second")
    # every full page of the prompt but the one holding the last token is reused
    assert [o.num_cached_tokens for o in second] == [16, 16, 16]
    assert second[-1].completion.token_ids == first[-1].completion.token_ids
    usage = output_to_pb(second[-1]).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (18, 3, 16)
    assert output_to_pb(first[-1]).usage.cached_prompt_tokens == 0
    engine.check_integrity()


def test_prefill_only_reports_its_hit_and_remote_prefill_reports_none(engine, conn):
    ids = list(range(2000, 2013))  # 13 tokens
    run(engine, ids, "warm")
    (prefilled,) = run(engine, ids[:-1], "prefill-only", role=TransferRole.PREFILL)
    assert prefilled.finish_reason == "prefilled" and prefilled.num_cached_tokens == 8

    engine.add_request(ids, PARAMS, request_id="remote", role=TransferRole.REMOTE_PREFILL)
    engine.step()  # admitted, waiting for KV: no prefix lookup on this side
    conn.apply(engine, KvFailed("remote", KvFailure.PREFILL_LOCALLY, "test: prefill here"))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "remote" and outs[-1].finished
    assert all(o.num_cached_tokens == 0 for o in outs)
    engine.check_integrity()
