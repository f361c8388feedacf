"""The EAGLE-style draft head (pdserve/model/eagle_head.py, its format pdserve/model/eagle_config.py)
on tiny random targets: shapes, what is trained and saved, the save/load roundtrip, refusal of
another target, the target identity hash, and the greedy reference drafters (deterministic,
batched == single, == the training forward)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.tiny_models import make_tiny_checkpoint

from pdserve.model.eagle_config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    EagleConfig,
    EagleTrainStats,
    TargetIdentity,
    TargetVocab,
    load_target_vocab,
    param_count_for,
    read_config,
)
from pdserve.model.eagle_head import EagleHead

H, V = 64, 49152  # the tiny models' hidden size and vocabulary


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_targets")
    return {
        "llama": make_tiny_checkpoint("llama", root / "llama"),              # tied embeddings
        "llama_seed1": make_tiny_checkpoint("llama", root / "llama1", seed=1),
        "qwen3": make_tiny_checkpoint("qwen3", root / "qwen3"),              # untied lm_head
    }


@pytest.fixture(scope="module")
def vocab(targets) -> TargetVocab:
    return load_target_vocab(targets["llama"])


def new_head(target_dir, vocab: TargetVocab, seed: int = 0) -> EagleHead:
    cfg = EagleConfig.for_target(json.loads((target_dir / "config.json").read_text()), vocab.identity)
    head = EagleHead(cfg, vocab.embed, vocab.lm_head)
    head.reset_parameters(torch.Generator().manual_seed(seed))
    return head.eval()


def test_identity_of_tiny_targets(targets, vocab):
    ident = vocab.identity
    assert (ident.architecture, ident.hidden_size, ident.vocab_size, ident.dtype) == ("llama", H, V, "float32")
    assert load_target_vocab(targets["llama"]).identity == ident            # stable across reads
    assert load_target_vocab(targets["llama_seed1"]).identity.weights_hash != ident.weights_hash
    q = load_target_vocab(targets["qwen3"])
    assert q.identity.architecture == "qwen3"
    assert q.lm_head.data_ptr() != q.embed.data_ptr() and not torch.equal(q.lm_head, q.embed)
    # the lm_head enters the hash: tied vs the same table given as an untied head differ
    e = vocab.embed
    assert TargetIdentity.from_tensors("llama", e, None) == ident
    assert TargetIdentity.from_tensors("llama", e, e.clone()).weights_hash != ident.weights_hash
    bumped = e.clone()
    bumped[123, 7] += 1e-6
    assert TargetIdentity.from_tensors("llama", bumped, None).weights_hash != ident.weights_hash
    assert TargetIdentity.from_tensors("llama", e.bfloat16(), None).weights_hash != ident.weights_hash


def test_shapes_and_trained_parameters(targets, vocab):
    head = new_head(targets["llama"], vocab)
    B, L = 3, 7
    tokens = torch.randint(V, (B, L), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(B, L, H, generator=torch.Generator().manual_seed(2))
    logits, out = head(tokens, hidden, torch.arange(L).expand(B, L))
    assert logits.shape == (B, L, V) and logits.dtype == torch.float32
    assert out.shape == (B, L, H)
    # the embedding and lm_head are borrowed: not parameters, not in state_dict
    names = set(head.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names), names
    assert head.num_parameters() == param_count_for(head.config) == sum(v.numel() for v in head.state_dict().values())
    # causal: a row does not see later rows
    hidden2 = hidden.clone()
    hidden2[:, -1] += 1.0
    _, out2 = head(tokens, hidden2, torch.arange(L).expand(B, L))
    torch.testing.assert_close(out2[:, :-1], out[:, :-1], rtol=0, atol=0)
    assert not torch.equal(out2[:, -1], out[:, -1])


def test_save_load_roundtrip(targets, vocab, tmp_path):
    head = new_head(targets["llama"], vocab, seed=3)
    stats = EagleTrainStats(steps=5, loss=1.25, top1_agreement=0.5, top1_agreement_step2=0.25,
                            heldout_tokens=10, train_tokens=100)
    head.save(tmp_path, stats)
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert cfg["target"] == dataclasses.asdict(vocab.identity)
    assert read_config(tmp_path) == dataclasses.replace(head.config, train_stats=stats)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / WEIGHTS_FILE))) == set(head.state_dict())
    loaded = EagleHead.load(tmp_path, vocab).eval()
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    h = torch.randn(H, generator=torch.Generator().manual_seed(4))
    assert loaded.draft(h, 17, 5) == head.draft(h, 17, 5)
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temp files


def test_load_refuses_another_target(targets, vocab, tmp_path):
    new_head(targets["llama"], vocab).save(tmp_path)
    other = load_target_vocab(targets["llama_seed1"])
    with pytest.raises(ValueError, match="weights_hash") as e:
        EagleHead.load(tmp_path, other)
    assert vocab.identity.weights_hash in str(e.value) and other.identity.weights_hash in str(e.value)
    for field, value in (("architecture", "mistral"), ("hidden_size", 128), ("vocab_size", 32000),
                         ("dtype", "bfloat16")):
        wrong = TargetVocab(dataclasses.replace(vocab.identity, **{field: value}), vocab.embed, vocab.lm_head)
        with pytest.raises(ValueError, match=field):
            EagleHead.load(tmp_path, wrong)
    q = load_target_vocab(targets["qwen3"])
    with pytest.raises(ValueError, match="qwen3"):
        EagleHead.load(tmp_path, q)


def test_config_validation(vocab):
    good = EagleConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       rms_norm_eps=1e-6, rope_theta=10000.0, dtype="float32", target=vocab.identity)
    assert EagleConfig.from_json(json.loads(json.dumps(good.to_json()))) == good
    for bad, msg in (({"num_kv_heads": 3}, "num_kv_heads 3"), ({"hidden_size": 32}, "hidden_size 32"),
                     ({"dtype": "int8"}, "int8"), ({"head_dim": 15}, "head_dim"), ({"rope_theta": 0.5}, "rope_theta")):
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(good, **bad)
    with pytest.raises(ValueError, match="unknown keys"):
        EagleConfig.from_json({**good.to_json(), "extra": 1})
    with pytest.raises(ValueError, match="version"):
        EagleConfig.from_json({**good.to_json(), "format_version": 99})
    hf = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    c = EagleConfig.for_target(hf, vocab.identity)
    assert (c.rope_theta, c.head_dim, c.num_kv_heads, c.rms_norm_eps) == (100000.0, 16, 2, 1e-5)
    assert EagleConfig.for_target({**hf, "rope_parameters": None, "rope_theta": 5e5}, vocab.identity).rope_theta == 5e5
    with pytest.raises(ValueError, match=r"\[49152, 64\]"):
        EagleHead(good, vocab.embed[:100], vocab.lm_head)


def test_draft_is_deterministic_and_matches_the_forward(targets, vocab):
    head = new_head(targets["llama"], vocab, seed=5)
    # a trained head would follow the target; a random one with a scaled-up fc still drafts varied tokens
    with torch.no_grad():
        head.fc.weight.mul_(20.0)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(4, H, generator=g)
    nxt = torch.randint(V, (4,), generator=g)
    k = 4
    single = [head.draft(h[b], int(nxt[b]), k, position=10 + b) for b in range(4)]
    assert single == [head.draft(h[b], int(nxt[b]), k, position=10 + b) for b in range(4)]
    assert all(len(d) == k for d in single)
    assert len({d for d in single}) > 1  # the drafts depend on the inputs
    batch = head.draft_batch(h, nxt, k, positions=torch.arange(10, 14))
    assert [tuple(r) for r in batch.tolist()] == single
    # the drafter is the training forward run autoregressively on its own outputs
    d = single[0]
    toks = torch.tensor([[int(nxt[0]), *d[:-1]]])
    feats = [h[0]]
    for j in range(k - 1):
        _, out = head(toks[:, : j + 1], torch.stack(feats)[None], torch.arange(10, 11 + j)[None])
        feats.append(out[0, -1])
    logits, _ = head(toks, torch.stack(feats)[None], torch.arange(10, 10 + k)[None])
    assert tuple(logits[0].argmax(-1).tolist()) == d
    # with a teacher-forced context the first draft is the forward's last row
    ctx_t = torch.randint(V, (6,), generator=g)
    ctx_h = torch.randn(6, H, generator=g)
    d_ctx = head.draft(h[0], int(nxt[0]), 2, context_tokens=ctx_t, context_hidden=ctx_h)
    logits, _ = head(torch.cat((ctx_t, nxt[:1]))[None], torch.cat((ctx_h, h[:1]))[None], torch.arange(7)[None])
    assert d_ctx[0] == int(logits[0, -1].argmax())
    with pytest.raises(ValueError, match="k must be"):
        head.draft(h[0], 1, 0)


def test_drafts_over_cached_history_equal_the_reference_that_recomputes_it(targets, vocab):
    """The engine's proposer drafts over history K/V it cached row by row (history_kv, padded and
    masked per sequence); the reference recomputes the same history from tokens and hidden states."""
    head = new_head(targets["llama"], vocab, seed=7)
    with torch.no_grad():
        head.fc.weight.mul_(20.0)
    g = torch.Generator().manual_seed(8)
    lens, k = [5, 0, 9, 2], 3                        # history rows per sequence (one has none)
    B, L = len(lens), max(lens)
    h = torch.randn(B, H, generator=g)
    nxt = torch.randint(V, (B,), generator=g)
    pos = torch.tensor([30, 4, 11, 7])               # position of nxt; history rows at pos - n .. pos - 1
    ctx_t = [torch.randint(V, (n,), generator=g) for n in lens]
    ctx_h = [torch.randn(n, H, generator=g) for n in lens]
    Hkv, D = head.config.num_kv_heads, head.config.head_dim
    pk, pv = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)   # garbage where invalid: must be masked
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, n in enumerate(lens):
        if n:
            kb, vb = head.history_kv(ctx_t[b], ctx_h[b], pos[b] - n + torch.arange(n))   # [n, Hkv, D]
            pk[b, :, :n], pv[b, :, :n] = kb.transpose(0, 1), vb.transpose(0, 1)
            valid[b, :n] = True
    paged = head.draft_batch(h, nxt, k, pos, (pk, pv, valid)).tolist()
    ref = [list(head.draft(h[b], int(nxt[b]), k, context_tokens=ctx_t[b] if lens[b] else None,
                           context_hidden=ctx_h[b] if lens[b] else None, position=int(pos[b])))
           for b in range(B)]
    assert paged == ref
    # the history matters: without it the drafts of the sequences that have one differ somewhere
    bare = head.draft_batch(h, nxt, k, pos).tolist()
    assert bare[1] == paged[1] and bare != paged


def test_a_shipped_head_is_found_by_its_target_and_another_target_is_told_to_train_one(vocab):
    from pdserve.model.eagle_config import SHIPPED_HEADS, shipped_head_for

    shipped = [d for d in SHIPPED_HEADS.iterdir() if (d / CONFIG_FILE).is_file()]
    assert shipped, f"no head ships under {SHIPPED_HEADS}"
    for d in shipped:   # each is found by the target it names, and is complete
        assert shipped_head_for(read_config(d).target) == d and (d / WEIGHTS_FILE).is_file()
    with pytest.raises(ValueError, match="no draft head ships for target .*pdserve draft train"):
        shipped_head_for(vocab.identity)   # a tiny random target: none ships for it


def test_a_draft_vocabulary_restricts_drafts_survives_save_load_and_is_checked(targets, vocab, tmp_path):
    from pdserve.model.eagle_config import DRAFT_VOCAB_FILE
    from pdserve.model.eagle_head import draft_vocab_from_counts

    counts = torch.zeros(V, dtype=torch.long)
    counts[[7, 3, 500]] = torch.tensor([5, 9, 5])
    # by count, then the lower id first; unseen tokens follow by id; the result ascending
    assert draft_vocab_from_counts(counts, 3).tolist() == [3, 7, 500]
    assert draft_vocab_from_counts(counts, 5).tolist() == [0, 1, 3, 7, 500]
    with pytest.raises(ValueError, match="size must be"):
        draft_vocab_from_counts(counts, 0)

    head = new_head(targets["llama"], vocab, seed=5)
    with torch.no_grad():
        head.fc.weight.mul_(20.0)
    g = torch.Generator().manual_seed(6)
    h, nxt = torch.randn(4, H, generator=g), torch.randint(V, (4,), generator=g)
    full = head.draft_batch(h, nxt, 3)
    ids = torch.randperm(V, generator=g)[:256]
    ids[0] = int(full[0, 0])   # a token the full head drafts first stays draftable
    head.set_draft_vocab(ids)
    sub = head.draft_batch(h, nxt, 3)
    assert set(sub.flatten().tolist()) <= set(ids.tolist()) and int(sub[0, 0]) == int(full[0, 0])
    assert [tuple(r) for r in sub.tolist()] == [head.draft(h[b], int(nxt[b]), 3) for b in range(4)]
    logits = head.logits(h)   # the choice from full logits is the same choice
    assert head.pick_from_logits(logits).tolist() == head.pick(h).tolist()
    head.save(tmp_path)
    assert (tmp_path / DRAFT_VOCAB_FILE).is_file()
    back = EagleHead.load(tmp_path, vocab).eval()
    assert back.draft_vocab.tolist() == sorted(ids.tolist())
    assert torch.equal(back.draft_batch(h, nxt, 3), sub)
    head.set_draft_vocab(None)   # back to the whole vocabulary; saving drops the file
    assert torch.equal(head.draft_batch(h, nxt, 3), full)
    head.save(tmp_path)
    assert not (tmp_path / DRAFT_VOCAB_FILE).exists()
    for bad in (torch.tensor([1, 1]), torch.tensor([V]), torch.tensor([-1]), torch.zeros(0, dtype=torch.long)):
        with pytest.raises(ValueError, match="distinct token ids"):
            head.set_draft_vocab(bad)
