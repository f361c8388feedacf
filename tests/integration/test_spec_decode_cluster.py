"""Speculative decoding through a disaggregated cluster (E20, issue 17): `pdserve up --speculative-config`.

Two real clusters in turn (1 prefill + 1 decode + router over shm, the default model, a small
pool), whose decode node runs n-gram speculation (K=4, prompt_lookup_min 1), then a separate draft
model (the target's own checkpoint, K=3: the oracle; the draft's KV of each prompt is computed on
the decode node, from the prompt tokens, while the target's was transferred): greedy outputs of
concurrent requests (one decode batch) through the router's gRPC API equal a plain offline run
(pdserve.LLM, no speculation) token for token, on short prose and the repetition-heavy reference
prompts (code, a repeated sentence); the decode node's /metrics counts drafts and accepted tokens
(per position summing to the total; the oracle's drafts are all but float near-ties accepted),
the prefill node's counts none (it is never given the config), no KV write went stale, and every
node's pages come back. A bad config is refused by `pdserve up` and by
Cluster before any process starts, with the config's own message.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from support.cluster import assert_no_page_leak, running_cluster
from support.prometheus import fetch, parse, total
from support.reference import REFERENCE_PROMPTS

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.tools.client import AsyncClient
from pdserve.tools.launcher import Cluster, ClusterConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
NUM_BLOCKS = 64
ENGINE = ("--max-batch-tokens", "32")
PROMPTS = ["The capital of France is", REFERENCE_PROMPTS[6], REFERENCE_PROMPTS[7]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
DRAFTS = "pdserve:spec_decode_num_drafts_total"
DRAFT_TOKENS = "pdserve:spec_decode_num_draft_tokens_total"
ACCEPTED = "pdserve:spec_decode_num_accepted_tokens_total"
PER_POS = "pdserve:spec_decode_num_accepted_tokens_per_pos_total"


@pytest.fixture(scope="module")
def reference():
    """Plain greedy outputs (no speculation) from one offline engine, made before the cluster starts."""
    from pdserve import LLM

    llm = LLM(num_blocks=NUM_BLOCKS, num_threads=1, max_batch_tokens=32)
    assert llm.engine.speculator is None
    return [(o.text, tuple(o.token_ids), o.finish_reason) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def spec(request, default_source):
    """The decode node's speculative config: n-gram, or the oracle draft model (the target's own checkpoint)."""
    if request.param == "ngram":
        return SpeculativeConfig.parse(SPEC)
    # adaptive off: a draft as costly as the target is (rightly) turned down by the control
    return SpeculativeConfig.parse({"method": "draft_model", "model": str(default_source.path),
                                    "num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def cluster(spec, reference, tmp_path_factory):
    """The module's cluster for `spec`, started after the reference run (so they never share the cores)."""
    with running_cluster(tmp_path_factory, f"spec-p1d1-{spec.method}", prefill=1, decode=1, port=0,
                         http_port=None, num_blocks=NUM_BLOCKS, threads_per_node=1, engine_args=ENGINE,
                         startup_timeout_s=150, router_health_interval_s=0.5,
                         speculative_config=spec.to_json()) as c:
        yield c


def test_only_decoding_nodes_get_the_config(cluster, spec):
    flag = ("--speculative-config", spec.to_json())
    argv = {name: p.argv for name, p in cluster.processes.items()}
    decode = argv["decode-0"]
    assert any(decode[i:i + 2] == flag for i in range(len(decode))), decode
    assert "--speculative-config" not in argv["prefill-0"] and "--speculative-config" not in argv["router"]
    colocated = ClusterConfig(colocated=1, speculative_config=spec.to_json())
    node = Cluster(colocated).processes["colocated-0"].argv
    assert any(node[i:i + 2] == flag for i in range(len(node))), node


def test_greedy_outputs_through_the_router_equal_plain_decoding(cluster, spec, reference):
    async def all_at_once():  # one decode batch: several sequences' drafts verified in each pass
        async with AsyncClient(cluster.url, timeout=120) as client:
            return await asyncio.gather(*(client.complete(p, GREEDY) for p in PROMPTS))

    results = asyncio.run(asyncio.wait_for(all_at_once(), 150))
    for prompt, done, want in zip(PROMPTS, results, reference, strict=True):
        assert (done.text, done.token_ids, done.finish_reason) == want, prompt[:40]
        assert done.timings.decode_node == "decode-0"
    decode = parse(fetch(cluster.metrics_urls["decode-0"])[0])
    drafts, draft_tokens, accepted = (total(decode, n) for n in (DRAFTS, DRAFT_TOKENS, ACCEPTED))
    k = spec.num_speculative_tokens
    assert drafts > 0 and accepted > 0, (drafts, draft_tokens, accepted)
    assert accepted <= draft_tokens <= k * drafts, (drafts, draft_tokens, accepted)
    if spec.method == "draft_model":
        # the oracle: a draft whose KV of the prompt were wrong (not caught up on the transferred
        # prompt) would disagree with the target nearly everywhere
        assert accepted >= 0.9 * draft_tokens, (drafts, draft_tokens, accepted)
    # vLLM's meaning: position i counts drafts whose token i was accepted, so they sum to the total
    # and never grow with the position (a draft's token i+1 is accepted only after its token i)
    per_pos = [total(decode, PER_POS, position=str(i)) for i in range(k)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True), per_pos
    assert total(decode, "pdserve:kv_stale_writes_total") == 0
    prefill = parse(fetch(cluster.metrics_urls["prefill-0"])[0])
    assert any(name == DRAFTS for name, _ in prefill), "the prefill node exports no spec-decode counters"
    assert total(prefill, DRAFTS) == total(prefill, DRAFT_TOKENS) == total(prefill, ACCEPTED) == 0
    assert_no_page_leak(cluster)


def test_a_bad_config_fails_before_anything_starts(tmp_path, capsys):
    from pdserve.tools.cli import main

    log_dir = tmp_path / "logs"
    bad = json.dumps({"method": "medusa", "num_speculative_tokens": 4})
    assert main(["up", "--port", "0", "--http-port", "0", "--log-dir", str(log_dir),
                 "--speculative-config", bad]) == 2
    out = capsys.readouterr()
    assert "unknown method 'medusa'; known: ngram, draft_model, eagle" in out.err and "starting" not in out.out
    assert not log_dir.exists()  # no child was spawned (each writes its log there)
    for value, match in (({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
                         ("{not json", "speculative config is not valid JSON"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys")):
        with pytest.raises(ValueError, match=match):
            Cluster(port=0, speculative_config=value, log_dir=str(log_dir))
    # engine_args reach prefill nodes too: the config has one way in
    with pytest.raises(ValueError, match="pass speculative_config"):
        ClusterConfig(engine_args=("--speculative-config", json.dumps(SPEC)))
    assert not log_dir.exists()
