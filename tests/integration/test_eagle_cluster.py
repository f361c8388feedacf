"""The speculative hidden-state handoff through a disaggregated cluster (issue 18, D12, D17).

One real cluster (1 prefill + 1 decode + router over shm, the default model, a small pool) whose
decode node drafts with the eagle head that ships for the default model (`{"method": "eagle"}`,
no model: eagle.SHIPPED_HEADS). The prefill node ships the hidden state of the position before the
last prompt token in the context record, and the 128 before it (the head's history, written into
the decode node's head pool); the decode node's first step feeds that last token AND verifies the
head's drafts from the shipped state (with the adaptive control on, as by default: a sequence's
first decode step verifies at least one draft token whatever the control's line says, control.py's
"first look"). Greedy outputs of the reference prompts (prose,
code, repetition) through the router equal transformers' token for token (and so colocated plain
decoding's: test_engine_reference); the decode node's first steps emit more than one token on
average (pdserve:first_step_tokens_total / pdserve:first_steps_total; exactly 1 without speculation:
test_cluster_metrics), drafts are verified and accepted, no KV write went stale, every page comes
back. The same with an untrained random head is test_context_record_cluster's (exactness must not
depend on the head) and, colocated, test_spec_decode.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support.cluster import assert_no_page_leak, running_cluster
from support.prometheus import fetch, parse, total
from support.reference import REFERENCE_PROMPTS

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient

K = 3
SPEC = {"method": "eagle", "num_speculative_tokens": K}   # the default config: the adaptive control on
NUM_BLOCKS = 96
MAX_NEW = 24   # conftest.REFERENCE_NEW_TOKENS: transformers' ids are computed once per session
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(hf_reference):
    return hf_reference   # computed before the cluster starts, so they never share the cores


@pytest.fixture(scope="module")
def cluster(reference, tmp_path_factory):
    with running_cluster(tmp_path_factory, "eagle-p1d1", prefill=1, decode=1, port=0, http_port=None,
                         num_blocks=NUM_BLOCKS, threads_per_node=1, engine_args=("--max-batch-tokens", "64"),
                         startup_timeout_s=150, router_health_interval_s=0.5,
                         speculative_config=json.dumps(SPEC)) as c:
        yield c


def test_greedy_outputs_equal_transformers_and_the_first_step_speculates(cluster, reference):
    async def all_at_once():
        async with AsyncClient(cluster.url, timeout=120) as client:
            return await asyncio.gather(*(client.complete(p, GREEDY) for p in REFERENCE_PROMPTS))

    results = asyncio.run(asyncio.wait_for(all_at_once(), 180))
    for prompt, done, want in zip(REFERENCE_PROMPTS, results, reference, strict=True):
        assert list(done.token_ids) == want, prompt[:40]
        assert done.timings.decode_node == "decode-0"
    decode = parse(fetch(cluster.metrics_urls["decode-0"])[0])
    first_steps = total(decode, "pdserve:first_steps_total")
    first_tokens = total(decode, "pdserve:first_step_tokens_total")
    assert first_steps == len(REFERENCE_PROMPTS), first_steps
    # the trained head's drafts from the shipped hidden state are accepted at the first step
    assert first_tokens / first_steps > 1.0, (first_tokens, first_steps)
    drafts = total(decode, "pdserve:spec_decode_num_drafts_total")
    draft_tokens = total(decode, "pdserve:spec_decode_num_draft_tokens_total")
    accepted = total(decode, "pdserve:spec_decode_num_accepted_tokens_total")
    assert drafts >= len(REFERENCE_PROMPTS) and 0 < accepted <= draft_tokens <= K * drafts, \
        (drafts, draft_tokens, accepted)
    # the head's history of each prompt's end came with the context record (pdserve up sets
    # --context-history-rows 128 on both nodes with an eagle config): at most 128 rows a request
    rows = total(decode, "pdserve:spec_decode_handoff_history_rows_total")
    assert len(REFERENCE_PROMPTS) <= rows <= 128 * len(REFERENCE_PROMPTS), rows
    assert total(decode, "pdserve:kv_stale_writes_total") == 0
    assert_no_page_leak(cluster)
