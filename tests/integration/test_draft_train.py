"""`pdserve draft train` (pdserve/tools/draft_train.py) on a tiny random target: the corpus's hidden
states are the engine's ModelOutput.hidden, the CLI writes a head checkpoint naming the target,
--resume continues from the saved step and gives the same weights as an uninterrupted run, a resume
with other settings is refused, and the loss decreases on repetitive text (fixed seeds)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.tiny_models import make_tiny_checkpoint

from pdserve.model.eagle_config import load_target_vocab, read_config
from pdserve.model.eagle_head import EagleHead
from pdserve.tools.cli import main as cli_main
from pdserve.tools.draft_train import STATE_FILE, DraftTrainConfig, corpus_for, target_hidden_states, train

PROMPTS = [
    "one two three four one two three four one two three four",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
    "abc abc abc abc abc abc abc abc",
    "red green blue red green blue red green blue",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_train")
    target = make_tiny_checkpoint("llama", root / "target")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    base = DraftTrainConfig(out=str(root / "unused"), target=str(target), steps=4, seq_len=16, batch=2, lr=3e-3,
                            warmup=0, prompts=str(prompts), samples=2, max_new_tokens=24, heldout_every=4,
                            checkpoint_every=2, corpus=str(root / "corpus.safetensors"), num_threads=1,
                            progress=False)
    vocab = load_target_vocab(target)
    torch.set_num_threads(1)
    corpus = corpus_for(base, target, vocab.identity.weights_hash)  # built once, shared by the tests
    return root, target, base, corpus


def test_corpus_hidden_is_the_engines_hidden(setup):
    """The corpus records transformers' last_hidden_state; the engine's runner hands the proposer
    ModelOutput.hidden: they must be the same final-norm state (float32, to rounding)."""
    from transformers import AutoModelForCausalLM

    from pdserve import LLM, SamplingParams

    root, target, base, corpus = setup
    assert len(corpus.offsets) - 1 == len(PROMPTS) * 2 * 2       # raw + chat, greedy + sampled
    assert corpus.heldout.sum() == len(corpus.heldout) // 4
    llm = LLM(str(target), num_threads=1)
    rows: list[torch.Tensor] = []
    execute = llm.engine.runner.execute

    def spy(sched, *a, **kw):
        out = execute(sched, *a, **kw)
        for r in out.chunk_rows.values():
            rows.append(out.hidden[r].clone())                    # the request's last known position
        return out

    llm.engine.runner.execute = spy
    prompt = llm.tokenizer(PROMPTS[0])["input_ids"]
    gen = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0].token_ids
    llm.close()
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32, local_files_only=True).eval()
    ref = target_hidden_states(model, list(prompt) + list(gen))    # [n, H]
    P = len(prompt)
    assert len(rows) == 5
    torch.testing.assert_close(torch.stack(rows), ref[P - 1 : P + 4], rtol=1e-4, atol=1e-4)
    # and the corpus's first text (prompt 0, raw, greedy) is exactly this text with these states
    n = corpus.length(0)
    assert corpus.tokens[:n].tolist()[: P + 5] == list(prompt) + list(gen)
    torch.testing.assert_close(corpus.hidden[: P + 4], ref[: P + 4], rtol=0, atol=0)


def test_cli_checkpoint_and_resume(setup):
    root, target, base, _ = setup
    out = root / "cli"
    args = ["draft", "train", "--target", str(target), "--out", str(out), "--seq-len", "16", "--batch", "2",
            "--lr", "3e-3", "--warmup", "0", "--prompts", base.prompts, "--samples", "2", "--max-new-tokens", "24",
            "--heldout-every", "4", "--checkpoint-every", "2", "--corpus", base.corpus, "--num-threads", "1",
            "--no-progress"]
    assert cli_main([*args, "--steps", "4"]) == 0
    cfg = read_config(out)
    assert cfg.target == load_target_vocab(target).identity
    assert cfg.train_stats is not None and cfg.train_stats.steps == 4
    assert 0.0 <= cfg.train_stats.top1_agreement <= 1.0 and cfg.train_stats.heldout_tokens > 0
    first = torch.load(out / STATE_FILE, weights_only=False)
    assert first["step"] == 4 and len(first["losses"]) == 4
    assert cli_main([*args, "--steps", "6", "--resume"]) == 0
    second = torch.load(out / STATE_FILE, weights_only=False)
    assert second["step"] == 6 and second["losses"][:4] == first["losses"]
    assert read_config(out).train_stats.steps == 6
    EagleHead.load(out, load_target_vocab(target))  # the exported head loads against its target


def test_resume_is_exact_and_checks_settings(setup):
    root, _, base, _ = setup
    whole = train(dataclasses.replace(base, out=str(root / "whole"), steps=6, checkpoint_every=3))
    cut = dataclasses.replace(base, out=str(root / "cut"), steps=3, checkpoint_every=3)
    train(cut)
    resumed = train(dataclasses.replace(cut, steps=6, resume=True))
    assert resumed.losses == whole.losses
    a = torch.load(root / "whole" / STATE_FILE, weights_only=False)["head"]
    b = torch.load(root / "cut" / STATE_FILE, weights_only=False)["head"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"lr=0\.003 \(now 0\.001\)"):
        train(dataclasses.replace(cut, steps=8, resume=True, lr=1e-3))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(dataclasses.replace(base, out=str(root / "never"), resume=True))


def test_loss_decreases(setup):
    root, _, base, _ = setup
    r = train(dataclasses.replace(base, out=str(root / "long"), steps=30, checkpoint_every=30))
    first, last = sum(r.losses[:5]) / 5, sum(r.losses[-5:]) / 5
    assert last < 0.8 * first, (first, last, r.losses)
    stats = read_config(root / "long").train_stats
    assert stats.top1_agreement == r.agreement.step1 and stats.top1_agreement_no_history == r.agreement.no_history
    assert 0 <= r.agreement.step2 <= 1 and r.agreement.rows > 0 and json.dumps(stats.loss)
