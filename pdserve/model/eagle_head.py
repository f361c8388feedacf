"""An EAGLE/MTP-style draft head for a Llama-family target (issue 18, D12, D17, E20).

The head drafts from the target's final-norm hidden state (what the runner's ModelOutput.hidden
holds for each sampled row, and what the prefill node ships in the context record). One draft
step, for the token x_{t+1} the target sampled from position t:

    u   = fc([embed(x_{t+1}) ; h_t])          [2H] -> [H]   (embed: the target's table, shared, frozen)
    y   = DecoderLayer(u)                     one pre-norm Llama layer, causal self-attention over
                                              the head's own rows (its short history), RoPE at the
                                              position of x_{t+1}, SiLU-gated MLP
    h'  = norm(y)                             the head's estimate of the target's h_{t+1}
    q   = lm_head(h')                         (the target's lm_head, shared, frozen) -> draft x_{t+2}

The next step feeds [embed(x_{t+2}) ; h'] back in, so K drafts cost K head steps. h' is in the
same (post-final-norm) space as h_t, which is why the head ends in its own final norm.

Only fc, the layer and the norm are the head's weights (`state_dict`); the embedding and lm_head
are borrowed from the target and never saved, so a checkpoint is small (the default model's head:
~4.3 M parameters, 17 MB float32) and is only valid for the target it was trained on. Its
config.json names that target (`TargetIdentity`: architecture, hidden size, vocabulary, dtype and
a blake2b hash of the stored embedding / lm_head bytes); `EagleHead.load` refuses any other.

Attention is plain causal torch attention over the rows given, recomputed per draft step. The
head's history (its rows for the tokens before the one it drafts from) enters two ways that agree:
`draft` takes it as tokens and target hidden states and recomputes it; `draft_batch` takes it as
K/V (`past`), which the engine's proposer (pdserve.engine.spec_decode.proposers.eagle.EagleDrafts)
keeps in a paged pool of its own, each row written once from the target's hidden state
(`history_kv`): a row's K/V depend only on its inputs, so the cached rows are exactly what `draft`
recomputes.

The checkpoint format (config, target identity, shipped heads) is pdserve.model.eagle_config;
heads that ship with pdserve are package data under pdserve/assets/heads/ (`SHIPPED_HEADS`,
`shipped_head_for`). How a head plugs into the engine and takes over a prefill node's hidden
states: docs/speculative-handoff.md.

The model room (imports only kernels): nothing here knows the engine. Called by the engine thread
(drafting), `pdserve draft train` (training) and the bench. Nothing here blocks: no waits, no I/O
except `save` / `load` / `TargetIdentity.from_checkpoint` / `shipped_head_for`.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.eagle_config import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    EAGLE_FORMAT,
    WEIGHTS_FILE,
    EagleConfig,
    EagleTrainStats,
    TargetVocab,
    atomic_write,
    read_config,
    replace_train_stats,
)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf.to(x.dtype)) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _HeadLayer(nn.Module):
    """One pre-norm Llama decoder layer in plain torch (autograd for training)."""

    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        dt, H, D = c.torch_dtype, c.hidden_size, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, D
        self.input_layernorm = _RMSNorm(H, c.rms_norm_eps, dt)
        self.q_proj = nn.Linear(H, c.num_heads * D, bias=False, dtype=dt)
        self.k_proj = nn.Linear(H, c.num_kv_heads * D, bias=False, dtype=dt)
        self.v_proj = nn.Linear(H, c.num_kv_heads * D, bias=False, dtype=dt)
        self.o_proj = nn.Linear(c.num_heads * D, H, bias=False, dtype=dt)
        self.post_attention_layernorm = _RMSNorm(H, c.rms_norm_eps, dt)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False, dtype=dt)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False, dtype=dt)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False, dtype=dt)
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)),
                             persistent=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Hq, L, D], k and v [B, Hkv, L, D] of rows x [B, L, H] at positions [B, L], RoPE
        applied to q and k (what a row leaves in a KV cache is its k and v)."""
        B, L, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        a = self.input_layernorm(x)
        q = self.q_proj(a).view(B, L, Hq, D).transpose(1, 2)       # [B, Hq, L, D]
        k = self.k_proj(a).view(B, L, Hkv, D).transpose(1, 2)      # [B, Hkv, L, D]
        v = self.v_proj(a).view(B, L, Hkv, D).transpose(1, 2)
        freqs = positions.float()[..., None] * self.inv_freq        # [B, L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]            # [B, 1, L, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # x [B, L, H]; positions [B, L]; mask [B, L] bool (True = a real row) or None.
        # past: (k [B, Hkv, P, D], v [B, Hkv, P, D], valid [B, P] bool): earlier rows' K/V (a KV
        # cache's), attended by every row of x before x's own rows (causal among themselves)
        B, L, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x, positions)
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # [L, L]
        attn_mask = causal if mask is None else causal[None, None] & mask[:, None, None, :]  # keys that exist
        if past is not None:
            pk, pv, valid = past
            k = torch.cat((pk.to(k.dtype), k), dim=2)                  # [B, Hkv, P + L, D]
            v = torch.cat((pv.to(v.dtype), v), dim=2)
            own = attn_mask if attn_mask.dim() == 4 else attn_mask[None, None].expand(B, 1, L, L)
            attn_mask = torch.cat((valid[:, None, None, :].expand(B, 1, L, valid.shape[1]), own), dim=-1)
        if Hkv != Hq:
            k = k.repeat_interleave(Hq // Hkv, dim=1)                # [B, Hq, P + L, D]
            v = v.repeat_interleave(Hq // Hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, Hq, L, D]
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, L, Hq * D))
        m = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class EagleHead(nn.Module):
    """The draft head. embed / lm_head: the target's [V, H] tensors (frozen, borrowed, not saved)."""

    def __init__(self, config: EagleConfig, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        V, H = config.target.vocab_size, config.hidden_size
        for name, t in (("embedding", embed), ("lm_head", lm_head)):
            if tuple(t.shape) != (V, H):
                raise ValueError(f"target {name} is {tuple(t.shape)}, the head's config expects [{V}, {H}]")
        self.config = config
        dt = config.torch_dtype
        self.fc = nn.Linear(2 * H, H, bias=False, dtype=dt)
        self.layer = _HeadLayer(config)
        self.norm = _RMSNorm(H, config.rms_norm_eps, dt)
        # plain attributes, not parameters or buffers: never trained, never in state_dict
        self.target_embed = embed.detach().to(dt)       # [V, H]
        self.target_lm_head = lm_head.detach().to(dt) if lm_head.data_ptr() != embed.data_ptr() else self.target_embed
        # the draft vocabulary (set_draft_vocab): None drafts from all V tokens
        self.draft_vocab: torch.Tensor | None = None      # [N] int64 ascending token ids
        self._draft_lm_head: torch.Tensor | None = None   # [N, H] their lm_head rows
        self.reset_parameters()

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only tokens among `ids` (a frequency-ranked subset, `draft_vocab_from_counts`):
        each draft step's lm_head product shrinks from [V, H] to [N, H], most of a step's cost
        for a small head over a large vocabulary. Verification is unchanged, so output stays
        exact; a token outside the subset is just never drafted. None: the whole vocabulary."""
        if ids is None:
            self.draft_vocab = self._draft_lm_head = None
            return
        V = self.target_lm_head.shape[0]
        ids = ids.long()
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= V \
                or ids.unique().numel() != ids.numel():
            span = f" in [{int(ids.min())}, {int(ids.max())}]" if ids.numel() else ""
            raise ValueError(f"draft vocabulary must be distinct token ids in [0, {V}), got a tensor of shape "
                             f"{tuple(ids.shape)}{span}")
        self.draft_vocab = ids.sort().values
        self._draft_lm_head = self.target_lm_head[self.draft_vocab].contiguous()

    def pick(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy draft ids from head states h [..., H] -> [...]: the argmax over the draft vocabulary."""
        if self._draft_lm_head is None:
            return self.logits(h).argmax(-1)
        return self.draft_vocab[F.linear(h, self._draft_lm_head).argmax(-1)]  # type: ignore[index]

    def pick_from_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The same choice from full logits [..., V] (what training's evaluation has at hand)."""
        if self.draft_vocab is None:
            return logits.argmax(-1)
        return self.draft_vocab[logits[..., self.draft_vocab].argmax(-1)]

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Linear weights N(0, 0.02); fc starts as [0 ; I] (the step begins from h_t itself) plus noise."""
        H = self.config.hidden_size
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).mul_(0.02).to(p.dtype))
        self.fc.weight[:, H:] += torch.eye(H, dtype=self.fc.weight.dtype)

    def features(
        self,
        tokens: torch.Tensor,      # [B, L] the tokens x_{t+1}
        hidden: torch.Tensor,      # [B, L, H] h_t: the target's (or the head's previous) hidden state
        positions: torch.Tensor,   # [B, L] positions of x_{t+1}
        mask: torch.Tensor | None = None,  # [B, L] bool, True = real row (padding only at the end)
        past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # earlier rows' K/V (_HeadLayer)
    ) -> torch.Tensor:             # [B, L, H] h'_{t+1}, final-norm space
        return self.norm(self.layer(self._inputs(tokens, hidden), positions, mask, past))

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """u = fc([embed(x_{t+1}) ; h_t]): tokens [B, L], hidden [B, L, H] -> [B, L, H]."""
        dt = self.config.torch_dtype
        e = F.embedding(tokens, self.target_embed)                      # [B, L, H]
        return self.fc(torch.cat((e, hidden.to(dt)), dim=-1))           # [B, L, 2H] -> [B, L, H]

    @torch.no_grad()
    def history_kv(
        self,
        tokens: torch.Tensor,      # [N] x_j
        hidden: torch.Tensor,      # [N, H] the target's h_{j-1}
        positions: torch.Tensor,   # [N] j
    ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [N, Hkv, D] (k with RoPE at j)
        """The K/V the head's row j leaves for later rows to attend over, teacher-forced (from the
        target's hidden state, not the head's own): a row's K/V depend on its inputs alone, so a
        paged cache of them is what `draft` recomputes from context_tokens / context_hidden."""
        u = self._inputs(tokens.long()[None], hidden[None])              # [1, N, H]
        _, k, v = self.layer.qkv(u, positions.long()[None])              # [1, Hkv, N, D]
        return k[0].transpose(0, 1), v[0].transpose(0, 1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # h [..., H] -> [..., V] float32
        return F.linear(h, self.target_lm_head).float()

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.features(tokens, hidden, positions, mask)
        return self.logits(h), h  # [B, L, V] float32, [B, L, H]

    @torch.no_grad()
    def draft_batch(
        self,
        h_last: torch.Tensor,       # [B, H] the target's hidden state at each sequence's position p
        next_tokens: torch.Tensor,  # [B] the token each target sampled there (position p + 1)
        k: int,
        positions: torch.Tensor | None = None,  # [B] position of next_tokens; None: 0 (RoPE is relative)
        past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # history K/V (history_kv rows)
    ) -> torch.Tensor:              # [B, k] greedy drafts for positions p + 2 ..
        """Greedy K-token drafts. The head's history: `past` = (k, v [B, Hkv, P, D], valid [B, P])
        of earlier rows (teacher-forced, `history_kv`), else none; then its own draft rows."""
        if k < 1:
            raise ValueError(f"draft: k must be >= 1, got {k}")
        B = h_last.shape[0]
        pos0 = torch.zeros(B, dtype=torch.long) if positions is None else positions.long()
        toks = next_tokens.long().view(B, 1)                     # [B, j]
        feats = h_last.to(self.config.torch_dtype).view(B, 1, -1)  # [B, j, H]
        out = []
        for j in range(k):
            pos = pos0[:, None] + torch.arange(j + 1)[None]       # [B, j+1]
            h = self.features(toks, feats, pos, past=past)[:, -1]  # [B, H]
            d = self.pick(h)                                       # [B]
            out.append(d)
            toks = torch.cat((toks, d[:, None]), dim=1)
            feats = torch.cat((feats, h[:, None]), dim=1)
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def draft(
        self,
        h_last: torch.Tensor,   # [H] target hidden state at position p
        next_token: int,        # the token sampled at p + 1
        k: int,
        context_tokens: torch.Tensor | None = None,  # [P] x_{s+1} .. x_p: head history, teacher-forced
        context_hidden: torch.Tensor | None = None,  # [P, H] target h_s .. h_{p-1}
        position: int | None = None,                 # position of next_token; None: P
    ) -> tuple[int, ...]:
        """Greedy K drafts for one sequence (the reference the engine's proposer must match).
        With a context the head first attends over it, as it would over its prompt KV."""
        if k < 1:
            raise ValueError(f"draft: k must be >= 1, got {k}")
        if (context_tokens is None) != (context_hidden is None):
            raise ValueError("draft: context_tokens and context_hidden go together")
        if context_tokens is None:
            toks = torch.tensor([[int(next_token)]])
            feats = h_last.to(self.config.torch_dtype).view(1, 1, -1)
        else:
            if context_hidden.shape[0] != context_tokens.shape[0]:  # type: ignore[union-attr]
                raise ValueError(f"draft: {context_tokens.shape[0]} context tokens but "
                                 f"{context_hidden.shape[0]} hidden states")  # type: ignore[union-attr]
            toks = torch.cat((context_tokens.long(), torch.tensor([int(next_token)])))[None]
            feats = torch.cat((context_hidden, h_last[None]), dim=0).to(self.config.torch_dtype)[None]  # type: ignore[arg-type]
        P = toks.shape[1] - 1
        start = 0 if position is None else position - P  # position of the first history row
        drafts: list[int] = []
        for _ in range(k):
            pos = start + torch.arange(toks.shape[1])[None]        # [1, L]
            h = self.features(toks, feats, pos)[:, -1]             # [1, H]
            d = int(self.pick(h))
            drafts.append(d)
            toks = torch.cat((toks, torch.tensor([[d]])), dim=1)
            feats = torch.cat((feats, h[:, None]), dim=1)
        return tuple(drafts)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: str | os.PathLike[str], train_stats: EagleTrainStats | None = None) -> None:
        """Write model.safetensors then config.json into directory, each atomically (temp + rename)."""
        from safetensors.torch import save_file

        out = pathlib.Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config if train_stats is None else replace_train_stats(self.config, train_stats)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        atomic_write(out / WEIGHTS_FILE, lambda p: save_file(state, str(p), metadata={"format": EAGLE_FORMAT}))
        if self.draft_vocab is not None:
            ids = {"ids": self.draft_vocab.to(torch.int32).contiguous()}
            atomic_write(out / DRAFT_VOCAB_FILE, lambda p: save_file(ids, str(p), metadata={"format": EAGLE_FORMAT}))
        elif (out / DRAFT_VOCAB_FILE).exists():
            (out / DRAFT_VOCAB_FILE).unlink()
        text = json.dumps(cfg.to_json(), indent=2) + "\n"
        atomic_write(out / CONFIG_FILE, lambda p: p.write_text(text))

    @classmethod
    def load(cls, directory: str | os.PathLike[str], target: TargetVocab) -> EagleHead:
        """Load a head for `target`; ValueError when it was trained for another target."""
        from safetensors.torch import load_file

        d = pathlib.Path(directory)
        config = read_config(d)
        target.identity.check_same(config.target, f"draft head '{d}'")
        head = cls(config, target.embed, target.lm_head)
        state = load_file(str(d / WEIGHTS_FILE))
        missing = sorted(set(head.state_dict()) ^ set(state))
        if missing:
            raise ValueError(f"draft head '{d}': weights {missing} missing or unexpected")
        head.load_state_dict(state)
        if (d / DRAFT_VOCAB_FILE).is_file():
            vocab = load_file(str(d / DRAFT_VOCAB_FILE))
            if set(vocab) != {"ids"}:
                raise ValueError(f"draft head '{d}': {DRAFT_VOCAB_FILE} holds {sorted(vocab)}, expected ['ids']")
            try:
                head.set_draft_vocab(vocab["ids"])
            except ValueError as e:
                raise ValueError(f"draft head '{d}': {DRAFT_VOCAB_FILE}: {e}") from None
        return head


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of counts [V] (how often the target wrote each token),
    ascending; ties and unseen tokens by lower id (in a BPE vocabulary the earlier, commoner merges)."""
    V = counts.numel()
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= V:
        raise ValueError(f"draft vocabulary size must be an integer in [1, {V}], got {size!r}")
    key = counts.double() * V + (V - 1 - torch.arange(V, dtype=torch.float64))   # exact below 2**53
    return torch.argsort(key, descending=True)[:size].sort().values
