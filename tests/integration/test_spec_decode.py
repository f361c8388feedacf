"""Speculative decoding (E20) on the default model: greedy output is transformers' token for token.

One engine serves every case; each test installs the speculator it needs (the engine builds one
from EngineConfig.speculative_config the same way, `make_speculator`). Prompts are the shared
reference set: short prose, code, numbers, French, and repetition-heavy long prompts (which the
n-gram proposer drafts well), alone and in a batch of 16 mixed lengths; max_batch_tokens=64 makes
verification chunks share passes with chunked prefills and cuts drafts to the budget left.

The oracle: a self-draft of every layer IS the target, so every draft is accepted and every
verification emits K + 1 tokens.
"""

from __future__ import annotations

import pytest
from support.reference import REFERENCE_PROMPTS

from pdserve import LLM, SamplingParams
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.loader import make_speculator

MAX_NEW = 24


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=600, page_size=16, max_batch_tokens=64, max_requests_per_batch=16, num_threads=2)


@pytest.fixture(scope="module")
def reference(hf_reference):
    assert all(len(r) == MAX_NEW for r in hf_reference)
    return hf_reference


def speculate(llm: LLM, **config: object):
    """Install a speculator on the module's engine (idle between tests) and return it, built as
    the engine builds its own."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    c = engine.config
    engine.speculator = make_speculator(SpeculativeConfig(**config), engine.runner, engine.tokenizer,
                                        engine.max_model_len, small_batch_max_tokens=c.small_batch_max_tokens,
                                        catch_up_tokens=c.scheduler.max_batch_tokens,
                                        target_path=str(engine.source.path))
    return engine.speculator


def greedy(n: int = MAX_NEW, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def check_idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("k", [1, 4, 8])
def test_ngram_batch_matches_transformers(llm, reference, k):
    """K = 4 in a batch of 16 mixed lengths (every prompt twice), K = 1 and 8 in a batch of 8."""
    spec = speculate(llm, method="ngram", num_speculative_tokens=k)
    twice = k == 4
    prompts = REFERENCE_PROMPTS + REFERENCE_PROMPTS[::-1] if twice else REFERENCE_PROMPTS
    expected = reference + reference[::-1] if twice else reference
    outs = llm.generate(prompts, greedy())
    for i, (o, ref) in enumerate(zip(outs, expected, strict=True)):
        assert list(o.token_ids) == ref, f"prompt {i} differs with n-gram K={k}"
    # speculation really ran, and accepted drafts on the repetition-heavy prompts
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0, vars(spec)
    assert len(spec.accepted_per_pos) == k
    check_idle(llm)


@pytest.mark.parametrize("i", [1, 5, 7])
def test_ngram_alone_matches_transformers(llm, reference, i):
    speculate(llm, method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    out = llm.generate(REFERENCE_PROMPTS[i], greedy())[0]
    assert list(out.token_ids) == reference[i]
    check_idle(llm)


def test_self_draft_of_every_layer_is_the_oracle(llm, reference):
    k = 4
    layers = llm.engine.arch.num_layers
    spec = speculate(llm, method="draft_model", self_draft_layers=layers, num_speculative_tokens=k, adaptive=False)
    steps = llm.engine.num_steps
    out = llm.generate(REFERENCE_PROMPTS[0], greedy(1 + 3 * (k + 1)))[0]
    assert list(out.token_ids) == reference[0][:1 + 3 * (k + 1)]
    # acceptance exactly 1.0; the prefill emits token 1, then three steps of K + 1 tokens each
    assert spec.num_draft_tokens == spec.num_accepted_tokens == 3 * k
    assert spec.accepted_per_pos == [3] * k
    assert llm.engine.num_steps - steps == 1 + 3
    check_idle(llm)


def test_shallow_self_draft_matches_transformers_in_a_batch(llm, reference):
    spec = speculate(llm, method="draft_model", self_draft_layers=6, num_speculative_tokens=3)
    outs = llm.generate(REFERENCE_PROMPTS[:4], greedy(12))
    for o, ref in zip(outs, reference[:4], strict=True):
        assert list(o.token_ids) == ref[:12]
    assert spec.num_draft_tokens > 0
    check_idle(llm)


DRAFTERS = {"self_draft": {"self_draft_layers": 2}, "draft_model": {}}   # draft_model: a tiny random draft


@pytest.fixture(scope="module")
def tiny_long_draft(tmp_path_factory):
    """A tiny random draft (the default tokenizer) that takes the module engine's 8192 positions."""
    from support.tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("spec_draft_8k") / "llama",
                                    max_position_embeddings=8192))


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_draft_models_in_a_batch_of_16_match_transformers(llm, reference, tiny_long_draft, drafter, k):
    """A self-draft (the target's first 2 layers) and a separate random draft model at K = 1, 4, 8
    in a batch of 16 mixed lengths (every prompt twice, chunked prefills sharing passes with
    verifications), every proposal verified in full (adaptive off: the control would cut a random
    draft's drafts to nothing): transformers' tokens."""
    config = dict(DRAFTERS[drafter]) or {"model": tiny_long_draft}
    spec = speculate(llm, method="draft_model", num_speculative_tokens=k, adaptive=False, **config)
    n = 12
    outs = llm.generate(REFERENCE_PROMPTS + REFERENCE_PROMPTS[::-1], greedy(n))
    for i, (o, ref) in enumerate(zip(outs, reference + reference[::-1], strict=True)):
        assert list(o.token_ids) == ref[:n], f"prompt {i} differs with {drafter} K={k}"
    assert spec.num_drafts > 0 and len(spec.accepted_per_pos) == k
    assert spec.num_draft_tokens > spec.num_drafts or k == 1   # K-token drafts were verified
    check_idle(llm)


def test_prefix_cache_hits_with_speculation(llm, reference):
    speculate(llm, method="ngram", num_speculative_tokens=4)
    hits = llm.engine.metrics().prefix_cache_hits
    outs = llm.generate(REFERENCE_PROMPTS[5:], greedy())
    assert llm.engine.metrics().prefix_cache_hits > hits   # earlier tests left these prompts' blocks cached
    for o, ref in zip(outs, reference[5:], strict=True):
        assert list(o.token_ids) == ref
    check_idle(llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_max_tokens_without_room_for_lookahead(llm, reference, max_tokens):
    spec = speculate(llm, method="ngram", num_speculative_tokens=8, prompt_lookup_min=1)
    out = llm.generate(REFERENCE_PROMPTS[7], greedy(max_tokens))[0]
    assert list(out.token_ids) == reference[7][:max_tokens]
    assert out.finish_reason == "length"
    # drafts never run past max_tokens: at most max_tokens - 2 drafts per verification
    assert spec.num_draft_tokens <= max(0, max_tokens - 2) * max_tokens
    check_idle(llm)


def test_stop_string_inside_accepted_drafts(llm):
    prompt = REFERENCE_PROMPTS[7]
    llm.engine.speculator = None
    plain = llm.generate(prompt, greedy(30))[0]
    stop = plain.text[10:18]
    llm.engine.speculator = None
    want = llm.generate(prompt, greedy(30, stop=[stop]))[0]
    speculate(llm, method="ngram", num_speculative_tokens=8, prompt_lookup_min=1)
    got = llm.generate(prompt, greedy(30, stop=[stop]))[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert got.finish_reason == "stop" and len(got.token_ids) < 30
    check_idle(llm)


def test_seeded_sampling_and_logprobs_equal_plain_decoding(llm):
    """Verification samples each position with the draws plain decoding makes there, so a seeded
    request gives the same tokens with and without speculation, with the same logprobs."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True, logprobs=2)
    prompts = [REFERENCE_PROMPTS[6], REFERENCE_PROMPTS[7]]
    llm.engine.speculator = None
    plain = llm.generate(prompts, params)
    spec = speculate(llm, method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    got = llm.generate(prompts, params)
    assert spec.num_drafts > 0
    for a, b in zip(got, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.sampled.token_id for lp in a.logprobs] == list(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.sampled.logprob - y.sampled.logprob) < 1e-3
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
    check_idle(llm)


TIGHT_PICKED = (0, 1, 2, 3, 4, 7)


@pytest.fixture(scope="module")
def tight_pool_workload(llm, reference):
    """Prompts that do not fit a 20-block pool together, and plain decoding's 40 tokens for each
    (in the module's pool, which holds them all; their first MAX_NEW are transformers')."""
    prompts = [REFERENCE_PROMPTS[i] for i in TIGHT_PICKED]
    llm.engine.speculator = None
    expected = [list(o.token_ids) for o in llm.generate(prompts, greedy(40))]
    assert [e[:MAX_NEW] for e in expected] == [reference[i] for i in TIGHT_PICKED]
    return prompts, expected


def run_in_tight_pool(workload, speculative_config: dict) -> LLM:
    """`workload`'s prompts through a speculating engine whose pool (20 blocks) is too small for the
    batch: asserts requests were soft-reset or offloaded and the outputs equal `workload`'s expected
    plain decoding; returns the engine for the caller's own checks."""
    prompts, expected = workload
    small = LLM(num_blocks=20, page_size=16, max_batch_tokens=64, max_requests_per_batch=8, num_threads=2,
                speculative_config=speculative_config)
    outs = small.generate(prompts, greedy(40))
    assert small.engine.num_soft_resets + small.engine.num_offloads > 0
    assert [list(o.token_ids) for o in outs] == expected
    return small


def test_preemption_with_speculation_matches_plain_decoding(llm, tight_pool_workload):
    """A pool too small for the batch: requests are soft-reset or offloaded and recomputed while
    others speculate; outputs equal plain decoding in a pool that holds them all (whose first
    MAX_NEW tokens are transformers'; at 40 tokens one of these prompts meets a float32 near-tie
    where the engine and transformers part, with or without speculation) and the pool balances."""
    small = run_in_tight_pool(tight_pool_workload,
                              {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert small.engine.speculator.num_accepted_tokens > 0
    check_idle(small)


def test_every_proposer_under_tensor_parallelism_matches_transformers(reference, tiny_draft):
    """Verification chunks are ordinary passes to the ranks, and so are a self-draft's passes
    (every rank runs its shard of the first k layers, StepMessage.num_layers); a separate draft
    model runs on the leader alone, unsharded. One TP 2 engine speculates exactly with each."""
    picked = (0, 6, 7)
    configs = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
               {"method": "draft_model", "self_draft_layers": 8, "num_speculative_tokens": 3},
               {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2})
    with LLM(num_blocks=64, page_size=16, max_batch_tokens=64, num_threads=1, tensor_parallel_size=2,
             speculative_config=configs[0]) as tp:
        for config in configs:
            spec = tp.engine.speculator if config is configs[0] else speculate(tp, **config)
            outs = tp.generate([REFERENCE_PROMPTS[i] for i in picked], greedy())
            assert [list(o.token_ids) for o in outs] == [reference[i] for i in picked], config
            assert spec.num_draft_tokens > 0, config
            if config["method"] == "ngram":
                assert spec.num_accepted_tokens > 0
            check_idle(tp)


def test_bad_configs_fail_at_start_naming_the_value(llm):
    with pytest.raises(ValueError, match="self_draft_layers=99 but the model has 30 layers"):
        make_speculator(SpeculativeConfig(method="draft_model", self_draft_layers=99, num_speculative_tokens=2),
                        llm.engine.runner)


def test_draft_checkpoint_equal_to_the_target_is_the_oracle(llm, reference, default_source):
    """A separate draft model (its own KV pool, indexed by the target's block ids) that is the
    target's own checkpoint: every draft is accepted, in a batch with chunked prefills."""
    spec = speculate(llm, method="draft_model", model=str(default_source.path), num_speculative_tokens=3)
    picked = (0, 4, 5, 6)   # short and long prompts: the long ones are prefilled in chunks
    outs = llm.generate([REFERENCE_PROMPTS[i] for i in picked], greedy())
    assert [list(o.token_ids) for o in outs] == [reference[i] for i in picked]
    assert spec.num_drafts > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    check_idle(llm)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    from support.tiny_models import make_tiny_checkpoint

    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("spec_draft") / "llama"))


def test_random_draft_model_through_preemption_matches_plain_decoding(tight_pool_workload, tiny_draft):
    """Exactness does not depend on the draft's quality: a random tiny draft (same tokenizer) in a
    pool too small for the batch, whose requests are soft-reset and come back (the draft's pages
    move with the target's; its progress restarts; an offload moves the draft's pages with the
    target's, tests/unit/test_offload.py) gives plain decoding's tokens."""
    small = run_in_tight_pool(tight_pool_workload,
                              {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2})
    assert small.engine.speculator.num_draft_tokens > 0
    check_idle(small)


def test_draft_with_another_vocabulary_is_refused(llm, tmp_path):
    from support.tiny_models import make_tiny_checkpoint

    other = make_tiny_checkpoint("llama", tmp_path / "small_vocab", vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        make_speculator(SpeculativeConfig(method="draft_model", model=str(other), num_speculative_tokens=2),
                        llm.engine.runner, llm.tokenizer, llm.engine.max_model_len)


def test_sampled_drafts_are_verified_by_rejection_sampling(llm, default_source):
    """Under temperature > 0 a draft model samples its drafts from its own (filtered)
    distribution and the target accepts each with probability min(1, p/q): a draft that is the
    target itself (q == p) has every draft accepted, and a seeded request gives the same tokens
    and logprobs on every run (the distribution itself: tests/unit/test_spec_rejection.py)."""
    spec = speculate(llm, method="draft_model", model=str(default_source.path), num_speculative_tokens=3,
                     adaptive=False)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True,
                            logprobs=1)
    prompts = REFERENCE_PROMPTS[:2]
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert [[lp.sampled.token_id for lp in o.logprobs] for o in first] == [list(o.token_ids) for o in first]
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    check_idle(llm)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, default_source):
    """An untrained (seeded random) eagle head for the default model: exactness must not depend
    on the head's quality."""
    from support.eagle_head import write_random_head

    return write_random_head(tmp_path_factory.mktemp("eagle") / "head", default_source.path)


def test_eagle_head_drafts_from_the_hidden_state_and_output_is_exact(llm, reference, random_head):
    spec = speculate(llm, method="eagle", model=random_head, num_speculative_tokens=3, adaptive=False)
    picked = (1, 3, 6, 7)
    outs = llm.generate([REFERENCE_PROMPTS[i] for i in picked], greedy())
    assert [list(o.token_ids) for o in outs] == [reference[i] for i in picked]
    # every decode step after the first sample had a hidden state to draft from
    assert spec.num_drafts >= len(picked) * (MAX_NEW - 2) // 2
    check_idle(llm)


def record_hidden(prop) -> dict:
    """Wrap an eagle proposer's after_pass to keep every pass's target hidden states: (request id,
    position) -> [hidden] (a later pass over the same position overwrites a rejected draft's)."""
    seen: dict = {}
    after = prop.after_pass

    def record(chunks, hidden):
        q = 0
        for c in chunks:
            for j in range(c.num_tokens):
                seen[(c.request_id, c.start + j)] = hidden[q + j].float().clone()
            q += c.num_tokens
        after(chunks, hidden)

    prop.after_pass = record
    return seen


def test_eagle_drafts_attend_over_the_heads_paged_history(llm, reference):
    """The head keeps its own rows in a paged pool (one per computed position, written from the
    target's hidden states after each pass, chunked prefills and rejected drafts included); every
    proposal the engine makes equals the reference drafter's, which recomputes that history from
    the target's hidden states recorded here (the shipped head; prompts of every kind, batched)."""
    import torch

    from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS

    spec = speculate(llm, method="eagle", num_speculative_tokens=3, adaptive=False)
    prop = spec.proposer
    seen = record_hidden(prop)                         # (request, position) -> the target's hidden there
    compared = [0, 0]                                  # proposals, equal to the reference
    propose = prop.propose_batch

    def check(requests, ks):
        got = propose(requests, ks)
        for r, k, d in zip(requests, ks, got, strict=True):
            if not d:
                continue
            nc = r.num_computed_tokens
            hist = prop._history[r.request_id]
            # the history starts after the prompt's first token, or after a prefix-cache hit
            assert hist.start == (r.num_reused_tokens or 0) + 1 and hist.end >= nc, (hist, nc)
            s = max(hist.start, nc - EAGLE_HISTORY_ROWS)
            toks = torch.tensor(r.token_slice(s, nc + 1))
            ctx_h = [seen[(r.request_id, j - 1)] for j in range(s, nc)]
            ref = prop.head.draft(seen[(r.request_id, nc - 1)], int(toks[-1]), k,
                                  context_tokens=toks[:-1] if ctx_h else None,
                                  context_hidden=torch.stack(ctx_h) if ctx_h else None, position=nc)
            compared[0] += 1
            compared[1] += ref == d
        return got

    prop.propose_batch = check
    picked = (0, 2, 4, 5, 6, 7)
    outs = llm.generate([REFERENCE_PROMPTS[i] for i in picked], greedy())
    assert [list(o.token_ids) for o in outs] == [reference[i] for i in picked]
    assert compared[0] >= len(picked) * 4, compared
    # equal up to float rounding of the two orders of the same sums (a near-tie can flip an argmax)
    assert compared[1] >= 0.99 * compared[0], compared
    check_idle(llm)


def test_a_decode_nodes_head_history_from_the_handed_over_states_is_the_colocated_one(llm, reference):
    """On a decode node the head's history of the prompt is written from the hidden states the
    prefill node hands over in the context record (EagleDrafts.seed_history; the last 128). From
    the same states, a second head pool seeded that way at each request's first draft proposes
    what the engine's head, which wrote its rows during its own prefill, proposes (prompts within
    the 128-row window, no prefix hit)."""
    import torch

    from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS
    from pdserve.engine.spec_decode.proposers.eagle import EagleDrafts

    spec = speculate(llm, method="eagle", num_speculative_tokens=3, adaptive=False)
    prop = spec.proposer
    handed = EagleDrafts(prop.head, llm.engine.runner)   # what a decode node's head starts from
    seen = record_hidden(prop)
    compared = [0, 0]
    propose = prop.propose_batch

    def check(requests, ks):
        got = propose(requests, ks)
        for r, k, d in zip(requests, ks, got, strict=True):
            nc, rid = r.num_computed_tokens, r.request_id
            if not d or len(r.output_token_ids) != 1 or r.num_reused_tokens or nc - 1 > EAGLE_HISTORY_ROWS:
                continue
            # the record's position is nc - 1 (a decode node's prefill stops before the last prompt
            # token; here the state one position later, the same arithmetic): rows before it
            rows = torch.stack([seen[(rid, j)] for j in range(0, nc - 1)])        # [nc - 1, H]
            handed.seed_history(r, rows[-EAGLE_HISTORY_ROWS:], nc - 1)
            handed.note(r, seen[(rid, nc - 1)], nc - 1)
            compared[0] += 1
            compared[1] += handed.propose_batch([r], [k])[0] == d
        return got

    prop.propose_batch = check
    # prompts no earlier test ran (no prefix hit), of every kind
    fresh = [f"Note {i}: {REFERENCE_PROMPTS[i]}" for i in (0, 1, 2, 3, 4, 5)]
    llm.generate(fresh, greedy())
    assert compared[0] >= 4, compared
    assert compared[1] >= compared[0] - 1, compared
    check_idle(llm)


def test_draft_with_the_targets_vocabulary_size_but_another_tokenizer_is_refused(llm, tmp_path):
    """A draft whose vocabulary has the target's size (49152) but maps two tokens to each other's
    ids is refused by its tokenizer, not let through by its size."""
    import json

    from support.tiny_models import make_tiny_checkpoint

    other = make_tiny_checkpoint("llama", tmp_path / "swapped_tokens", max_position_embeddings=8192)
    path = other / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    assert len(vocab) == 49152 and (vocab["FREE"], vocab["ectable"]) == (49146, 49151)
    vocab["FREE"], vocab["ectable"] = 49151, 49146
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match=r"has a different tokenizer than the target \(49152 vs 49152 tokens; "
                                         r"e\.g\. \[\('FREE', 49146\), \('FREE', 49151\), \('ectable', 49146\)\]\)"):
        make_speculator(SpeculativeConfig(method="draft_model", model=str(other), num_speculative_tokens=2),
                        llm.engine.runner, llm.tokenizer, llm.engine.max_model_len)
