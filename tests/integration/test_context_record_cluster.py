"""The versioned context record on a real cluster (issue 18, D19): 1 prefill + 1 decode node over
shm, the default model, whose prefill node damages chosen records with the TEST-ONLY hook
PDSERVE_TEST_ONLY_BAD_CONTEXT (kv_messenger.sender.TEST_BAD_CONTEXT_ENV): attempt 0 of one prefix
gets a flipped body byte, of another a wrong version, of a third another request's identity
(resealed with a valid checksum, so only the identity check can tell).

The decode node drafts with an untrained (seeded random) eagle head from the shipped hidden state
(issue 18: exactness must not depend on the head's quality) and checks every transfer's record
(with or without speculation): each damaged request is detected as what it is (the log names the field),
counted in pdserve:kv_context_rejected_total, re-prefilled into fresh pages and answers exactly
transformers' greedy tokens (the session's shared reference, conftest.hf_reference: no extra
model run in a full suite); a clean request is not counted; no KV write goes stale, and
afterwards nothing is held, tagged or in flight on either node.

The hook only ever acts on request ids with the prefixes this module gives it. Every wait is
bounded (the client's timeout, CLEAN_WITHIN_S).
"""

from __future__ import annotations

import json

import pytest
from support.cluster import assert_no_page_leak, running_cluster, transfer_leftovers
from support.eagle_head import write_random_head
from support.prometheus import fetch, parse, total
from support.reference import REFERENCE_PROMPTS
from support.wait import wait_until

from kv_messenger.context import RECORD_VERSION
from kv_messenger.sender import TEST_BAD_CONTEXT_ENV
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client

NUM_BLOCKS = 64
ENGINE = ("--max-batch-tokens", "32")
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# prefix -> index in REFERENCE_PROMPTS (distinct heads: no prefix-cache hit between them)
PROMPTS = {"ctx-clean-": 0, "ctx-flip-": 4, "ctx-version-": 1, "ctx-identity-": 3}
DAMAGED = {"ctx-flip-": ("flip", "checksum"), "ctx-version-": ("version", "version"),
           "ctx-identity-": ("identity", "identity")}   # prefix -> (damage, the field the decode side names)
REJECTED = "pdserve:kv_context_rejected_total"
CLEAN_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def reference(hf_reference) -> dict[str, tuple[int, ...]]:
    """transformers' greedy ids (the session's shared reference, made before the cluster starts)."""
    return {prefix: tuple(hf_reference[i][:MAX_TOKENS]) for prefix, i in PROMPTS.items()}


@pytest.fixture(scope="module")
def cluster(reference, tmp_path_factory, default_source):
    head = write_random_head(tmp_path_factory.mktemp("eagle") / "random-head", default_source.path)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3, "adaptive": False}
    # TEST ONLY: attempt 0 of each damaged prefix gets its record damaged on the prefill node
    with pytest.MonkeyPatch.context() as env:   # restored when the cluster stops
        env.setenv(TEST_BAD_CONTEXT_ENV, ",".join(f"{p}:{kind}:1" for p, (kind, _) in DAMAGED.items()))
        with running_cluster(tmp_path_factory, "context-record", prefill=1, decode=1, port=0, http_port=None,
                             num_blocks=NUM_BLOCKS, threads_per_node=1, engine_args=ENGINE, startup_timeout_s=150,
                             router_health_interval_s=0.5, speculative_config=json.dumps(spec)) as c:
            yield c


def decode_metric(cluster, name: str) -> float:
    samples = parse(fetch(cluster.metrics_urls["decode-0"])[0])
    assert any(n == name for n, _ in samples), f"the decode node exposes no {name}"
    return total(samples, name)


def test_a_damaged_record_is_rejected_counted_and_the_request_re_prefilled_exactly(cluster, reference):
    assert decode_metric(cluster, REJECTED) == 0
    with Client(cluster.url, timeout=120) as client:
        done = client.complete(REFERENCE_PROMPTS[PROMPTS["ctx-clean-"]], GREEDY, request_id="ctx-clean-0")
        assert tuple(done.token_ids) == reference["ctx-clean-"]
        assert decode_metric(cluster, REJECTED) == 0   # a good record is checked and passes
        for n, prefix in enumerate(DAMAGED, start=1):
            done = client.complete(REFERENCE_PROMPTS[PROMPTS[prefix]], GREEDY, request_id=f"{prefix}0")
            assert tuple(done.token_ids) == reference[prefix], prefix
            assert done.timings.decode_node == "decode-0"
            assert decode_metric(cluster, REJECTED) == n, prefix
    decode_log = (cluster.log_dir / "decode-0.log").read_text(errors="replace")
    prefill_log = (cluster.log_dir / "prefill-0.log").read_text(errors="replace")
    how = {"flip": "flipped bit 6 of body byte 3", "version": f"wrote version {RECORD_VERSION - 1}",
           "identity": "wrote request ctx-identity-0~other's identity (checksum resealed)"}
    for prefix, (kind, field) in DAMAGED.items():
        # attempt 0 damaged as asked and rejected naming the field; attempt 1 (undamaged) served
        rejected = [line for line in decode_log.splitlines() if f"request {prefix}0 (tag " in line]
        assert len(rejected) == 1 and f"context record rejected ({field}): context record {field}: got" in \
            rejected[0], (prefix, rejected)
        assert f"TEST ONLY ({TEST_BAD_CONTEXT_ENV}): request {prefix}0 attempt 0: context record damaged: " \
            f"{how[kind]}" in prefill_log, prefix
        assert f"request {prefix}0 attempt 1: context record damaged" not in prefill_log
    assert "ctx-clean-0" not in "".join(line for line in decode_log.splitlines() if "rejected" in line)
    assert decode_metric(cluster, "pdserve:kv_stale_writes_total") == 0
    # the random head drafted from the checked hidden state at every request's first step
    assert decode_metric(cluster, "pdserve:spec_decode_num_drafts_total") >= len(PROMPTS)
    assert decode_metric(cluster, "pdserve:kv_checksum_failures_total") == 0   # S7 is off: nothing else failed
    addresses = [cluster.processes[n].address for n in ("prefill-0", "decode-0")]
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S,
               "every node free == total with nothing quarantined, held, tagged or in flight", interval=0.2)
    assert_no_page_leak(cluster)
