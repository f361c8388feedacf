"""A hybrid model disaggregated (issue 16, E8): every attention group's KV travels.

The tiny Gemma 3 (tests/support/tiny_models.py: 4 layers, sliding / full / sliding / sliding, a
16-token window, 2 KV heads) on a real prefill node -> decode node pair over libfabric (shm), page
size 4, with --kv-checksum, at P TP1 -> D TP1 and under shard mismatch, P TP2 -> D TP1 (each
prefill rank holds one KV head: two runs a page, in both attention groups):
- greedy tokens and their logprobs (sampled and top 2, exact floats) equal a colocated TP 1
  engine's (tp_invariant like the cluster's nodes) for a prompt inside the window and two longer
  than it (their sliding layers recycle pages);
- every transfer's landed bytes equal the prefill side's (checksums verified, none failed);
- the sliding layers send only the pages of their window at the decode node's first step
  (kv_messenger.plan.window_first_page): the bytes written are exactly the full layer's pages of
  the whole prompt plus the sliding layers' window pages, fewer than every layer's pages;
- no page leaks, no stale write.
"""

from __future__ import annotations

import pytest
from support.cluster import assert_no_page_leak, running_cluster
from support.prometheus import fetch, parse, total
from support.tiny_models import TINY_GEMMA3, TINY_GEMMA3_WINDOW, make_tiny_checkpoint

from kv_messenger.context import ContextCodec
from kv_messenger.plan import num_prompt_pages, window_first_page
from pdserve import LLM, SamplingParams
from pdserve.model.arch import ModelArch
from pdserve.model.loader import load_config, resolve_model
from pdserve.tools.client import Client

PAGE = 4
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a king who had three daughters, and the youngest",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2,
]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
ENGINE = dict(num_blocks=64, page_size=PAGE, max_batch_tokens=24)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(TINY_GEMMA3, tmp_path_factory.mktemp("gemma3") / "tiny"))


def _steps(logprobs) -> list[tuple]:
    """(sampled id, its logprob, the top ids and logprobs) per position, from either API's type."""
    return [(p.sampled.token_id, p.sampled.logprob, tuple((t.token_id, t.logprob) for t in p.top))
            for p in logprobs]


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_tiny_gemma3_disaggregated_equals_colocated_and_sends_each_groups_pages(tiny, tmp_path_factory, prefill_tp):
    with LLM(model=tiny, num_threads=1, tp_invariant=prefill_tp > 1, **ENGINE) as llm:
        prompt_ids = [llm.engine.tokenize(p) for p in PROMPTS]
        expected = [(tuple(o.token_ids), _steps(o.logprobs)) for o in llm.generate(PROMPTS, GREEDY)]
    arch = ModelArch.from_hf_config(load_config(resolve_model(tiny)))
    sliding = [i for i, t in enumerate(arch.layer_types) if t == "sliding_attention"]
    assert sliding == [0, 2, 3] and max(len(ids) for ids in prompt_ids) > 2 * TINY_GEMMA3_WINDOW
    page_bytes = arch.num_kv_heads * PAGE * arch.head_dim * 4   # float32 K (or V) of one page (all ranks' runs)
    want_bytes, all_layers_bytes = 0, 0
    for ids in prompt_ids:
        n = len(ids) - 1                                         # the last prompt token decodes (D17)
        pages = num_prompt_pages(n, PAGE)
        window = pages - window_first_page(n, TINY_GEMMA3_WINDOW, PAGE)
        want_bytes += 2 * page_bytes * (pages * (arch.num_layers - len(sliding)) + window * len(sliding))
        all_layers_bytes += 2 * page_bytes * pages * arch.num_layers

    with running_cluster(tmp_path_factory, f"gemma3-p{prefill_tp}d1", prefill=1, decode=1, port=0, model=tiny,
                         prefill_tp=prefill_tp,
                         num_blocks=ENGINE["num_blocks"], threads_per_node=1, kv_checksum=True,
                         engine_args=("--page-size", str(PAGE), "--max-batch-tokens", "24")) as cluster:
        client = Client(cluster.url)
        for prompt, (tokens, steps) in zip(PROMPTS, expected, strict=True):
            out = client.complete(prompt, GREEDY)
            assert tuple(out.token_ids) == tokens, prompt
            assert _steps(out.logprobs) == steps, prompt
        samples = parse(fetch(cluster.metrics_urls["decode-0"])[0])
        assert total(samples, "pdserve:kv_checksums_verified_total") == len(PROMPTS)
        assert total(samples, "pdserve:kv_checksum_failures_total") == 0
        assert total(samples, "pdserve:kv_stale_writes_total") == 0
        # every KV byte the plan writes plus one context record a request, and fewer than all layers' pages
        sent = total(samples, "pdserve:kv_transfer_bytes_total", side="decode")
        assert sent == want_bytes + len(PROMPTS) * ContextCodec(arch.hidden_size).slot_nbytes
        assert want_bytes < all_layers_bytes
        assert_no_page_leak(cluster)
