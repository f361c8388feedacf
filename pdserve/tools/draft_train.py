"""`pdserve draft train`: distil an EAGLE-style draft head (pdserve/model/eagle_head.py)
for a target model from the target's own outputs, offline, on CPU (issue 18).

1. Corpus (cached in OUT/corpus.safetensors, or --corpus FILE, reused when its recipe matches):
   the target writes continuations of the shipped prompt set (pdserve/tools/bench/data/prompts.jsonl,
   or --prompts FILE) with pdserve.LLM: per prompt, raw and chat-templated, one greedy sample and
   --samples - 1 at temperature --temperature (seeded). Then transformers runs the target once over
   each full text (prompt + continuation) and records `model.model(ids).last_hidden_state`: the
   output of the final RMSNorm at every position, the same quantity as the engine runner's
   ModelOutput.hidden (our model is checked against transformers; float32 agrees to ~1e-6). Every
   --heldout-every'th text is held out for evaluation.
2. Training: windows of --seq-len rows from --batch random texts. Row t gets [embed(x_{t+1}); h_t]
   and is trained towards the target at position t + 1: the loss is KL(p_target || q_head) over the
   full vocabulary, p_target = softmax(lm_head(h_{t+1})) (recomputed from the stored hidden state,
   so no logits are stored), plus --feature-weight x smooth-L1(h'_{t+1}, h_{t+1}). KL rather than
   cross-entropy on the target's argmax: it carries the whole distribution (what rejection sampling
   accepts against at temperature > 0) and more signal per row than one label, at the same cost
   (both need the head's full-vocabulary logits); --loss ce is there for comparison. With
   --unroll 2 (default) a second step feeds the head's own h' back with the token after, as the
   drafter does at inference, so the head learns to continue from its own estimate.
3. Checkpoints every --checkpoint-every steps and at the end: OUT/train_state.pt (head weights,
   AdamW state, step, loss history, batch-sampler and torch RNG states; written to a temp file and
   renamed) and the exported head (OUT/model.safetensors + OUT/config.json, each atomic).
   --resume continues from train_state.pt exactly: the same run stopped and resumed gives the
   same weights bit for bit (the recipe must match; only --steps / --checkpoint-every may change).
4. At the end: the head's teacher-forced top-1 agreement with the target on the held-out texts
   (first draft token; second token drafted from the head's own state): the acceptance proxy,
   printed and stored in config.json (train_stats).

Nothing here waits on anything but its own computation (no sockets, no locks).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pdserve.model.eagle_config import TargetVocab
    from pdserve.model.eagle_head import EagleHead

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = pathlib.Path(__file__).resolve().parent / "bench" / "data" / "prompts.jsonl"
CORPUS_FILE = "corpus.safetensors"
STATE_FILE = "train_state.pt"
LOSSES = ("kl", "ce")
CHAT_MODES = ("both", "raw", "chat")
# fields of DraftTrainConfig that may differ between a run and its --resume
# (the result is bit-exact when --num-threads is the same too)
_RESUMABLE_CHANGES = ("steps", "checkpoint_every", "resume", "progress", "num_threads", "draft_vocab")


@dataclass(frozen=True)
class DraftTrainConfig:
    out: str
    target: str | None = None          # checkpoint dir or .gguf; None: the default model
    steps: int = 1000
    seq_len: int = 128
    batch: int = 8
    lr: float = 5e-4
    warmup: int = 50                   # linear LR warmup steps
    weight_decay: float = 0.0
    unroll: int = 2                    # draft steps trained per row: 1 (teacher forcing) or 2
    loss: str = "kl"
    feature_weight: float = 0.1
    checkpoint_every: int = 100
    seed: int = 0
    prompts: str | None = None         # prompt file (.jsonl with "prompt", or text lines); None: bench set
    chat: str = "both"
    samples: int = 2                   # continuations per prompt and chat mode (first greedy)
    temperature: float = 0.7
    max_new_tokens: int = 192
    heldout_every: int = 10            # every n-th text is held out
    corpus: str | None = None          # corpus file; None: OUT/corpus.safetensors
    num_threads: int | None = None
    resume: bool = False
    progress: bool = True
    # drafts come from the N tokens the target wrote most often in the training texts
    # (EagleHead.set_draft_vocab); 0: the whole vocabulary. Chosen after training: changes nothing trained.
    draft_vocab: int = 8192

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "batch", "checkpoint_every", "samples", "max_new_tokens", "heldout_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"draft train: --{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.heldout_every < 2:
            raise ValueError(f"draft train: --heldout-every must be >= 2 (some text must train), "
                             f"got {self.heldout_every}")
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 0:
            raise ValueError(f"draft train: --draft-vocab must be an integer >= 0, got {self.draft_vocab!r}")
        if self.warmup < 0:
            raise ValueError(f"draft train: --warmup must be >= 0, got {self.warmup}")
        if not self.lr > 0:
            raise ValueError(f"draft train: --lr must be > 0, got {self.lr}")
        if self.unroll not in (1, 2):
            raise ValueError(f"draft train: --unroll must be 1 or 2, got {self.unroll}")
        if self.loss not in LOSSES:
            raise ValueError(f"draft train: --loss must be one of {LOSSES}, got {self.loss!r}")
        if self.chat not in CHAT_MODES:
            raise ValueError(f"draft train: --chat must be one of {CHAT_MODES}, got {self.chat!r}")
        if self.feature_weight < 0 or self.weight_decay < 0 or self.temperature <= 0:
            raise ValueError(f"draft train: --feature-weight {self.feature_weight} and --weight-decay "
                             f"{self.weight_decay} must be >= 0, --temperature {self.temperature} > 0")

    @property
    def corpus_path(self) -> pathlib.Path:
        return pathlib.Path(self.corpus) if self.corpus else pathlib.Path(self.out) / CORPUS_FILE


@dataclass(frozen=True)
class Corpus:
    """Texts the target wrote, with its final-norm hidden state at every position."""

    tokens: torch.Tensor    # [N] int64, all texts concatenated
    hidden: torch.Tensor    # [N, H] float32, h_i = target final-norm hidden state at token i
    offsets: torch.Tensor   # [S + 1] int64, text s is tokens[offsets[s]:offsets[s + 1]]
    heldout: torch.Tensor   # [S] bool
    recipe: str             # JSON of what built it (target hash, prompts, sampling)

    def texts(self, heldout: bool) -> list[int]:
        return [s for s in range(len(self.heldout)) if bool(self.heldout[s]) == heldout]

    def length(self, s: int) -> int:
        return int(self.offsets[s + 1] - self.offsets[s])


@dataclass(frozen=True)
class TrainResult:
    step: int
    losses: tuple[float, ...]       # per step, from step 1 (including steps before a resume)
    agreement: Agreement
    out: pathlib.Path


def read_prompts(path: pathlib.Path) -> list[str]:
    """.jsonl: the "prompt" field of each line; anything else: one prompt per non-empty line."""
    prompts: list[str] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f"{path}:{n}: expected a JSON object with a string 'prompt'")
            prompts.append(rec["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"prompt file '{path}' has no prompts")
    return prompts


def _recipe(cfg: DraftTrainConfig, target_hash: str, prompts: Sequence[str]) -> str:
    ph = hashlib.blake2b("\x00".join(prompts).encode(), digest_size=16).hexdigest()
    return json.dumps({"target_hash": target_hash, "prompts_hash": ph, "chat": cfg.chat, "samples": cfg.samples,
                       "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                       "heldout_every": cfg.heldout_every, "seed": cfg.seed}, sort_keys=True)


def build_corpus(cfg: DraftTrainConfig, target_path: pathlib.Path, target_hash: str) -> Corpus:
    import torch
    import transformers

    from pdserve import LLM, SamplingParams

    prompts = read_prompts(pathlib.Path(cfg.prompts) if cfg.prompts else DEFAULT_PROMPTS)
    llm = LLM(str(target_path), num_threads=cfg.num_threads)
    tok = llm.tokenizer
    inputs: list[list[int]] = []
    for p in prompts:
        if cfg.chat in ("both", "raw"):
            inputs.append(list(tok(p)["input_ids"]))
        if cfg.chat in ("both", "chat") and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            inputs.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    params, prompt_ids = [], []
    for i, ids in enumerate(inputs):
        for j in range(cfg.samples):
            params.append(SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens) if j == 0 else
                          SamplingParams(temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + i * 97 + j,
                                         max_tokens=cfg.max_new_tokens))
            prompt_ids.append(ids)
    print(f"draft train: the target writes {len(params)} continuations of {len(prompts)} prompts", file=sys.stderr)
    outs = llm.generate(prompt_ids, params)
    llm.close()
    del llm
    texts = [list(p) + list(o.token_ids) for p, o in zip(prompt_ids, outs, strict=True)]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_path), dtype=torch.float32,
                                                              local_files_only=True)
    model.eval()
    hidden = [target_hidden_states(model, t) for t in texts]
    del model
    lengths = torch.tensor([0] + [len(t) for t in texts])
    return Corpus(tokens=torch.tensor([x for t in texts for x in t], dtype=torch.long),
                  hidden=torch.cat(hidden).contiguous(), offsets=lengths.cumsum(0),
                  heldout=torch.tensor([(s % cfg.heldout_every) == cfg.heldout_every - 1 for s in range(len(texts))]),
                  recipe=_recipe(cfg, target_hash, prompts))


def target_hidden_states(model: Any, ids: Sequence[int]) -> torch.Tensor:  # [n, H] float32
    """A transformers causal LM's final-norm hidden state at every position of ids: its
    `model.model(...).last_hidden_state` is taken after the final norm, the engine's ModelOutput.hidden."""
    import torch

    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0].float()


def save_corpus(c: Corpus, path: pathlib.Path) -> None:
    from safetensors.torch import save_file

    from pdserve.model.eagle_config import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"tokens": c.tokens, "hidden": c.hidden, "offsets": c.offsets, "heldout": c.heldout}
    atomic_write(path, lambda p: save_file(tensors, str(p), metadata={"recipe": c.recipe}))


def load_corpus(path: pathlib.Path) -> Corpus:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        recipe = (f.metadata() or {}).get("recipe", "")
        t = {k: f.get_tensor(k) for k in ("tokens", "hidden", "offsets", "heldout")}
    return Corpus(recipe=recipe, **t)


def corpus_for(cfg: DraftTrainConfig, target_path: pathlib.Path, target_hash: str) -> Corpus:
    """The cached corpus when its recipe matches, else a fresh one (refused under --resume)."""
    prompts = read_prompts(pathlib.Path(cfg.prompts) if cfg.prompts else DEFAULT_PROMPTS)
    want = _recipe(cfg, target_hash, prompts)
    path = cfg.corpus_path
    if path.is_file():
        c = load_corpus(path)
        if c.recipe == want:
            return c
        if cfg.resume:
            raise ValueError(f"--resume: corpus '{path}' was built by {c.recipe}, this run asks for {want}")
        log.warning("corpus %s has another recipe; rebuilding", path)
    c = build_corpus(cfg, target_path, target_hash)
    save_corpus(c, path)
    return c


def _windows(c: Corpus, texts: Sequence[int], W: int, batch: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """batch random windows of W tokens (shorter texts whole, padded): tokens [B, W], hidden
    [B, W, H], positions [B, W], valid [B, W]."""
    import torch

    H = c.hidden.shape[1]
    tok = torch.zeros(batch, W, dtype=torch.long)
    hid = torch.zeros(batch, W, H)
    pos = torch.zeros(batch, W, dtype=torch.long)
    valid = torch.zeros(batch, W, dtype=torch.bool)
    picks = torch.randint(len(texts), (batch,), generator=gen)
    for b in range(batch):
        s = texts[int(picks[b])]
        n = c.length(s)
        w = min(W, n)
        start = int(torch.randint(n - w + 1, (1,), generator=gen))
        base = int(c.offsets[s]) + start
        tok[b, :w] = c.tokens[base : base + w]
        hid[b, :w] = c.hidden[base : base + w]
        pos[b] = start + torch.arange(W)
        valid[b, :w] = True
    return tok, hid, pos, valid


def _step_loss(head: EagleHead, cfg: DraftTrainConfig, tok: torch.Tensor, hid: torch.Tensor,
               pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    L = cfg.seq_len
    with torch.no_grad():
        target_logp = F.log_softmax(head.logits(hid[:, 1:]), dim=-1)     # [B, W-1, V], rows for h_1 ..
    feats = hid[:, :L]                                                    # [B, L, H] h_t
    total = torch.zeros(())
    for j in range(cfg.unroll):
        rows = slice(1 + j, 1 + j + L)                                    # x_{t+1+j}, target h_{t+1+j}
        m = valid[:, rows].float()                                        # [B, L]
        logits, out = head(tok[:, rows], feats, pos[:, rows])             # [B, L, V], [B, L, H]
        logq = F.log_softmax(logits, dim=-1)
        tl = target_logp[:, j : j + L]                                    # [B, L, V]
        if cfg.loss == "kl":
            per_row = (tl.exp() * (tl - logq)).sum(-1)                    # [B, L]
        else:
            per_row = F.nll_loss(logq.flatten(0, 1), tl.argmax(-1).flatten(), reduction="none").view_as(m)
        reg = F.smooth_l1_loss(out, hid[:, rows], reduction="none").mean(-1)  # [B, L]
        total = total + ((per_row + cfg.feature_weight * reg) * m).sum() / m.sum().clamp(min=1)
        feats = out                                                       # the next step drafts from h'
    return total / cfg.unroll


@dataclass(frozen=True)
class Agreement:
    """Teacher-forced top-1 agreement of the head with the target on held-out text."""

    step1: float               # first draft token, the head attending over up to --seq-len rows of history
    step2: float | None        # second token, drafted from the head's own hidden state
    no_history: float          # first token with no head history at all (a head run without its own KV)
    rows: int


def evaluate(head: EagleHead, c: Corpus, seq_len: int) -> Agreement:
    import torch

    hits = [0, 0, 0]
    rows = [0, 0, 0]
    with torch.no_grad():
        for s in c.texts(heldout=True):
            a, n = int(c.offsets[s]), c.length(s)
            tok, hid = c.tokens[a : a + n][None], c.hidden[a : a + n][None]   # [1, n], [1, n, H]
            for start in range(0, n - 1, seq_len):
                end = min(n, start + seq_len + 1)
                feats = hid[:, start : end - 1]
                for j in range(2):
                    if end - 1 - j <= start:
                        break
                    r = slice(start + 1 + j, end)
                    feats = feats[:, : r.stop - r.start]
                    pos = torch.arange(r.start, r.stop)[None]
                    logits, out = head(tok[:, r], feats, pos)
                    target = head.logits(hid[:, r]).argmax(-1)
                    hits[j] += int((head.pick_from_logits(logits) == target).sum())
                    rows[j] += target.numel()
                    feats = out
            # every row alone: [n-1, 1] rows of one token each
            logits, _ = head(tok[0, 1:, None], hid[0, :-1, None], torch.arange(1, n)[:, None])
            target = head.logits(hid[0, 1:]).argmax(-1)                       # [n-1]
            hits[2] += int((head.pick_from_logits(logits[:, 0]) == target).sum())
            rows[2] += target.numel()
    if rows[0] == 0:
        raise ValueError("draft train: no held-out text to evaluate (lower --heldout-every or add prompts)")
    return Agreement(hits[0] / rows[0], hits[1] / rows[1] if rows[1] else None, hits[2] / rows[2], rows[0])


def _atomic_torch_save(obj: Any, path: pathlib.Path) -> None:
    import torch

    from pdserve.model.eagle_config import atomic_write

    atomic_write(path, lambda p: torch.save(obj, p))


def _recipe_of(cfg: DraftTrainConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _RESUMABLE_CHANGES}


def _resume_state(cfg: DraftTrainConfig, state_path: pathlib.Path, vocab: TargetVocab) -> dict[str, Any]:
    """The checkpoint --resume continues from, checked against this run's recipe and target."""
    import torch

    from pdserve.model.eagle_config import EagleConfig

    if not state_path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint '{state_path}'")
    state = torch.load(state_path, weights_only=False)
    if state["recipe"] != _recipe_of(cfg):
        diff = sorted(k for k in _recipe_of(cfg) if state["recipe"].get(k) != _recipe_of(cfg)[k])
        raise ValueError(f"--resume: checkpoint '{state_path}' was made with other settings: "
                         + ", ".join(f"{k}={state['recipe'].get(k)!r} (now {_recipe_of(cfg)[k]!r})" for k in diff))
    vocab.identity.check_same(EagleConfig.from_json(state["head_config"]).target, f"checkpoint '{state_path}'")
    return state


def train(cfg: DraftTrainConfig) -> TrainResult:
    import torch

    from pdserve.model.eagle_config import EagleConfig, EagleTrainStats, load_target_vocab
    from pdserve.model.eagle_head import EagleHead
    from pdserve.model.loader import resolve_model

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    source = resolve_model(cfg.target)
    vocab: TargetVocab = load_target_vocab(source.path)
    out = pathlib.Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    state = _resume_state(cfg, state_path, vocab) if cfg.resume else None
    corpus = corpus_for(cfg, source.path, vocab.identity.weights_hash)
    train_texts = [s for s in corpus.texts(heldout=False) if corpus.length(s) >= 2 + cfg.unroll]
    if not train_texts:
        raise ValueError(f"draft train: no training text of at least {2 + cfg.unroll} tokens in '{cfg.corpus_path}'")

    hf_config = json.loads((source.path / "config.json").read_text())
    head = EagleHead(EagleConfig.for_target(hf_config, vocab.identity), vocab.embed, vocab.lm_head)
    head.reset_parameters(torch.Generator().manual_seed(cfg.seed))
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses: list[float] = []
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optim"])
        gen.set_state(state["sampler_rng"])
        torch.set_rng_state(state["torch_rng"])
        losses = list(state["losses"])
        step = int(state["step"])
        if step > cfg.steps:
            raise ValueError(f"--resume: checkpoint is at step {step}, beyond --steps {cfg.steps}")

    def checkpoint() -> None:
        _atomic_torch_save({"step": step, "head": head.state_dict(), "optim": opt.state_dict(),
                            "sampler_rng": gen.get_state(), "torch_rng": torch.get_rng_state(),
                            "losses": losses, "recipe": _recipe_of(cfg), "head_config": head.config.to_json()},
                           state_path)
        head.save(out, EagleTrainStats(steps=step, loss=losses[-1] if losses else float("nan"),
                                       train_tokens=sum(corpus.length(s) for s in train_texts)))

    bar = _progress(cfg, step)
    W = cfg.seq_len + cfg.unroll
    head.train()
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup) if cfg.warmup else cfg.lr
        loss = _step_loss(head, cfg, *_windows(corpus, train_texts, W, cfg.batch, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        bar.update(step, losses[-1])
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint()
    bar.close()
    head.eval()
    if cfg.draft_vocab:
        from pdserve.model.eagle_head import draft_vocab_from_counts

        V = head.target_lm_head.shape[0]
        written = torch.cat([corpus.tokens[int(corpus.offsets[s]):int(corpus.offsets[s + 1])] for s in train_texts])
        head.set_draft_vocab(draft_vocab_from_counts(torch.bincount(written, minlength=V), min(cfg.draft_vocab, V)))
    ag = evaluate(head, corpus, cfg.seq_len)
    head.save(out, EagleTrainStats(steps=step, loss=losses[-1] if losses else float("nan"),
                                   top1_agreement=ag.step1, top1_agreement_step2=ag.step2,
                                   top1_agreement_no_history=ag.no_history, heldout_tokens=ag.rows,
                                   train_tokens=sum(corpus.length(s) for s in train_texts)))
    return TrainResult(step, tuple(losses), ag, out)


class _Progress:
    """tqdm when installed and wanted, else one plain line every 10 steps (stderr)."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.enabled, self.total, self.bar = enabled, total, None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, desc="draft train", unit="step")

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
        elif self.enabled and (step % 10 == 0 or step == self.total):
            print(f"draft train: step {step}/{self.total} loss {loss:.4f}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(cfg: DraftTrainConfig, initial: int) -> _Progress:
    return _Progress(cfg.steps, initial, cfg.progress)


def add_draft_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("draft", help="draft heads for speculative decoding")
    dsub = d.add_subparsers(dest="draft_command", required=True)
    t = dsub.add_parser("train", help="distil an EAGLE-style draft head for a target from its own outputs (CPU)")
    defaults = DraftTrainConfig(out="")
    t.add_argument("--target", default=None, help="target checkpoint dir or .gguf (default: the default model)")
    t.add_argument("--out", required=True, help="output directory (head, training state, corpus)")
    for name, kind, help_ in (
        ("steps", int, "optimizer steps in all (a --resume continues up to this)"),
        ("seq_len", int, "rows per training window"),
        ("batch", int, "windows per step"),
        ("lr", float, "AdamW learning rate"),
        ("warmup", int, "linear warmup steps"),
        ("weight_decay", float, "AdamW weight decay"),
        ("unroll", int, "draft steps trained per row: 1 or 2 (the second from the head's own state)"),
        ("feature_weight", float, "weight of the smooth-L1 loss on the predicted hidden state"),
        ("checkpoint_every", int, "steps between checkpoints"),
        ("seed", int, "seed of initialisation, batches and sampled continuations"),
        ("samples", int, "continuations per prompt and chat mode (the first greedy)"),
        ("temperature", float, "temperature of the sampled continuations"),
        ("max_new_tokens", int, "tokens per continuation at most"),
        ("heldout_every", int, "every n-th text is held out for the agreement measurement"),
        ("num_threads", int, "torch threads"),
        ("draft_vocab", int, "draft only the N tokens the target wrote most often (0: the whole vocabulary; "
                             "set after training, so a --resume at the last step only re-chooses it)"),
    ):
        t.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name),
                       help=f"{help_} (default {getattr(defaults, name)})")
    t.add_argument("--loss", choices=LOSSES, default=defaults.loss,
                   help="kl: KL to the target's distribution (default); ce: cross-entropy on its argmax")
    t.add_argument("--chat", choices=CHAT_MODES, default=defaults.chat, help="prompts raw, chat-templated or both")
    t.add_argument("--prompts", default=None,
                   help=f"prompt file (.jsonl 'prompt' fields or lines; default {DEFAULT_PROMPTS.name})")
    t.add_argument("--corpus", default=None, help="corpus file (default OUT/corpus.safetensors)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_draft_train)


def cmd_draft_train(args: argparse.Namespace) -> int:
    cfg = DraftTrainConfig(
        out=args.out, target=args.target, steps=args.steps, seq_len=args.seq_len, batch=args.batch, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, unroll=args.unroll, loss=args.loss,
        feature_weight=args.feature_weight, checkpoint_every=args.checkpoint_every, seed=args.seed,
        prompts=args.prompts, chat=args.chat, samples=args.samples, temperature=args.temperature,
        max_new_tokens=args.max_new_tokens, heldout_every=args.heldout_every, corpus=args.corpus,
        num_threads=args.num_threads, resume=args.resume, progress=not args.no_progress,
        draft_vocab=args.draft_vocab)
    r = train(cfg)
    ag = r.agreement
    print(json.dumps({"out": str(r.out), "step": r.step, "loss": r.losses[-1] if r.losses else None,
                      **{f"top1_agreement{k}": None if v is None else round(v, 4)
                         for k, v in (("", ag.step1), ("_step2", ag.step2), ("_no_history", ag.no_history))},
                      "heldout_tokens": ag.rows}))
    step2 = "n/a" if ag.step2 is None else f"{ag.step2:.3f}"
    print(f"draft head in {r.out}: held-out top-1 agreement {ag.step1:.3f} (second token {step2}, "
          f"without head history {ag.no_history:.3f}) over {ag.rows} rows", file=sys.stderr)
    return 0

