"""S7 page checksums on a real cluster (issue 15 item 5): 1 prefill + 1 decode node, shm, the
decode node started with --kv-checksum (through the launcher's ClusterConfig.kv_checksum).

- (1) greedy outputs through the router equal transformers' for prompts of several pages and
  chunks, and every transfer was verified (pdserve:kv_checksums_verified_total counts them,
  pdserve:kv_checksum_failures_total stays 0);
- (2) corruption: the decode node runs with the TEST-ONLY hook PDSERVE_TEST_ONLY_CORRUPT_KV
  (kv_messenger.receiver.TEST_CORRUPT_ENV), which flips one bit of the first landed page of chosen
  requests' attempts after the write count completed and before the verification. A request whose
  first attempt is corrupted is detected, counted, re-prefilled in fresh pages and answers the
  transformers tokens; one whose every attempt is corrupted fails explicitly, the error naming the
  first bad run (layer 0, page 0, K); the corrupted pages never joined the decode node's prefix
  cache (pdserve:kv_cache_cached_blocks unchanged by the failed request), and afterwards nothing is
  held, tagged or in flight on either node and no stale write was counted.

The hook only ever acts on request ids with the prefixes this module gives it. Every wait is
bounded (the client's timeout, CLEAN_WITHIN_S).
"""

from __future__ import annotations

import pytest
from support.cluster import running_cluster, transfer_leftovers
from support.prometheus import fetch, parse, total
from support.reference import hf_greedy
from support.wait import wait_until

from kv_messenger.receiver import TEST_CORRUPT_ENV
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client, ClientError

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# several 16-token pages and 32-token prefill chunks each; distinct heads (no prefix-cache hit)
PROMPTS = ["Checksum prompt one: the quick brown fox jumps over the lazy dog. " * 4,
           "Checksum prompt two:\ndef fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
           * 2,
           "Checksum prompt three: Paris, Berlin, Madrid, Rome, Lisbon, Vienna, Prague, " * 3]
ONCE, ALWAYS = "s7-corrupt-once-", "s7-corrupt-always-"
CLEAN_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # TEST ONLY: attempt 0 of ONCE* requests, attempts 0..8 of ALWAYS* requests get one bit flipped
    with pytest.MonkeyPatch.context() as env:   # restored when the cluster stops
        env.setenv(TEST_CORRUPT_ENV, f"{ONCE}:1,{ALWAYS}:9")
        with running_cluster(tmp_path_factory, "kv-checksum", prefill=1, decode=1, port=0, num_blocks=128,
                             threads_per_node=1, engine_args=("--max-batch-tokens", "32"), startup_timeout_s=150,
                             router_health_interval_s=0.5, kv_checksum=True) as c:
            yield c


@pytest.fixture(scope="module")
def expected(hf_default, default_source) -> dict[str, tuple[int, ...]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_source.path)
    return {p: tuple(hf_greedy(hf_default, tok, p, MAX_TOKENS)) for p in PROMPTS}


def decode_metric(cluster, name: str) -> float:
    samples = parse(fetch(cluster.metrics_urls["decode-0"])[0])
    assert any(n == name for n, _ in samples), f"the decode node exposes no {name}"
    return total(samples, name)


def assert_clean(cluster) -> None:
    addresses = [cluster.processes[n].address for n in ("prefill-0", "decode-0")]
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S,
               "every node free == total with nothing quarantined, held, tagged or in flight", interval=0.2)
    assert decode_metric(cluster, "pdserve:kv_stale_writes_total") == 0


def test_checksummed_transfers_give_the_transformers_tokens(cluster, expected):
    verified = decode_metric(cluster, "pdserve:kv_checksums_verified_total")
    failures = decode_metric(cluster, "pdserve:kv_checksum_failures_total")
    with Client(cluster.url, timeout=120) as client:
        for i, prompt in enumerate(PROMPTS):
            done = client.complete(prompt, GREEDY, request_id=f"s7-clean-{i}")
            assert done.token_ids == expected[prompt], prompt[:30]
    assert decode_metric(cluster, "pdserve:kv_checksums_verified_total") == verified + len(PROMPTS)
    assert decode_metric(cluster, "pdserve:kv_checksum_failures_total") == failures
    assert_clean(cluster)


def test_corrupted_landing_is_detected_never_cached_and_re_prefilled_or_failed(cluster, expected):
    verified = decode_metric(cluster, "pdserve:kv_checksums_verified_total")
    failures = decode_metric(cluster, "pdserve:kv_checksum_failures_total")
    with Client(cluster.url, timeout=120) as client:
        # attempt 0 corrupted: detected, re-prefilled into fresh pages, the right tokens
        done = client.complete(PROMPTS[0], GREEDY, request_id=f"{ONCE}0")
        assert done.token_ids == expected[PROMPTS[0]]
        assert decode_metric(cluster, "pdserve:kv_checksum_failures_total") == failures + 1
        assert decode_metric(cluster, "pdserve:kv_checksums_verified_total") == verified + 2

        # every attempt corrupted: once more on the same prefill node, then no node is left: an
        # explicit error naming the first bad run; the pages never reach the prefix cache
        cached = decode_metric(cluster, "pdserve:kv_cache_cached_blocks")
        with pytest.raises(ClientError, match=r"KV checksum mismatch: 1 run\(s\) differ, first run 0: "
                                              r"layer 0 page 0 \(id \d+\) K: sender crc32c 0x[0-9a-f]{8}, "
                                              r"landed 0x[0-9a-f]{8}"):
            client.complete(PROMPTS[1], GREEDY, request_id=f"{ALWAYS}0")
        assert decode_metric(cluster, "pdserve:kv_checksum_failures_total") == failures + 3
        assert decode_metric(cluster, "pdserve:kv_checksums_verified_total") == verified + 4
        assert decode_metric(cluster, "pdserve:kv_cache_cached_blocks") == cached
        assert_clean(cluster)

        # the same prompt, uncorrupted, is served right afterwards (nothing bad was cached); the
        # prefill node now has it in its prefix cache, so its cached pages ride with the first
        # chunk, and their checksums match too
        done = client.complete(PROMPTS[1], GREEDY, request_id="s7-after-0")
        assert done.token_ids == expected[PROMPTS[1]]
        assert done.usage is not None and done.usage.cached_prompt_tokens > 0, done.usage
        assert decode_metric(cluster, "pdserve:kv_checksum_failures_total") == failures + 3
        assert decode_metric(cluster, "pdserve:kv_checksums_verified_total") == verified + 5
    assert_clean(cluster)
