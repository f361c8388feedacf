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
K/V (`past`), which the engine's proposer (speculator.EagleDrafts) keeps in a paged pool of its own,
each row written once from the target's hidden state (`history_kv`): a row's K/V depend only on its
inputs, so the cached rows are exactly what `draft` recomputes.
Nothing here blocks: no waits, no I/O except `save` / `load` / `TargetIdentity.from_checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

EAGLE_FORMAT = "pdserve-eagle-head"
EAGLE_FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"   # optional: the token ids drafts are chosen from
EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HASH_CHUNK = 1 << 24  # bytes hashed per update: bounds the temporary copy of a big table


def _pos_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"eagle config: {name} must be a positive integer, got {value!r}")


def _tensor_digest(h: hashlib.blake2b, t: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and raw bytes (as stored) into h."""
    t = t.detach().contiguous().cpu()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.reshape(-1).view(torch.uint8)  # the raw bytes, whatever the dtype
    for start in range(0, flat.numel(), _HASH_CHUNK):
        h.update(flat[start : start + _HASH_CHUNK].numpy().tobytes())


@dataclass(frozen=True)
class TargetIdentity:
    """The target model a head belongs to. weights_hash: blake2b (16-byte digest, hex) of the
    embedding table and the lm_head as stored in the checkpoint ("tied" when the lm_head is the
    embedding), so converting the target to another runtime dtype does not change it."""

    architecture: str   # the checkpoint's model_type: "llama", "qwen2", ...
    hidden_size: int
    vocab_size: int
    dtype: str          # stored dtype of the embedding table, e.g. "float32"
    weights_hash: str

    def __post_init__(self) -> None:
        if not self.architecture or not isinstance(self.architecture, str):
            raise ValueError(f"target identity: architecture must be a non-empty string, got {self.architecture!r}")
        _pos_int("target hidden_size", self.hidden_size)
        _pos_int("target vocab_size", self.vocab_size)
        if len(self.weights_hash) != 32 or any(c not in "0123456789abcdef" for c in self.weights_hash):
            raise ValueError(f"target identity: weights_hash must be 32 lowercase hex digits, "
                             f"got {self.weights_hash!r}")

    @classmethod
    def from_tensors(cls, architecture: str, embed: torch.Tensor, lm_head: torch.Tensor | None) -> TargetIdentity:
        """embed [V, H]; lm_head [V, H] or None when tied to the embedding."""
        if embed.dim() != 2 or (lm_head is not None and lm_head.shape != embed.shape):
            raise ValueError(f"target identity: embedding {tuple(embed.shape)} and lm_head "
                             f"{None if lm_head is None else tuple(lm_head.shape)} must both be [vocab, hidden]")
        h = hashlib.blake2b(digest_size=16)
        _tensor_digest(h, embed)
        if lm_head is None:
            h.update(b"tied")
        else:
            _tensor_digest(h, lm_head)
        dtype = str(embed.dtype).removeprefix("torch.")
        return cls(architecture, int(embed.shape[1]), int(embed.shape[0]), dtype, h.hexdigest())

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> TargetIdentity:
        return load_target_vocab(path).identity

    def check_same(self, other: TargetIdentity, what: str = "draft head") -> None:
        """Raise ValueError naming both when `other` (the head's recorded target) is not self."""
        if other != self:
            diff = [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
            raise ValueError(f"{what} was trained for target {other} but the target is {self} "
                             f"(differs in {', '.join(diff)})")


@dataclass(frozen=True)
class TargetVocab:
    """The target's frozen tensors the head borrows, and their identity."""

    identity: TargetIdentity
    embed: torch.Tensor     # [V, H]
    lm_head: torch.Tensor   # [V, H] (the embedding itself when tied)


def load_target_vocab(path: str | os.PathLike[str]) -> TargetVocab:
    """Read a Hugging Face checkpoint directory's embedding and lm_head (only those tensors) and
    its identity. Raises ValueError for a checkpoint that is not a Llama-family decoder."""
    from safetensors import safe_open

    from pdserve.model.arch import LLAMA_MODEL_TYPES

    root = pathlib.Path(path)
    cfg = json.loads((root / "config.json").read_text())
    arch = cfg.get("model_type")
    if arch not in LLAMA_MODEL_TYPES:
        raise ValueError(f"eagle heads support Llama-family targets {LLAMA_MODEL_TYPES}; '{root}' is {arch!r}")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        files = {k: root / weight_map[k] for k in (EMBED_KEY, LM_HEAD_KEY) if k in weight_map}
    else:
        files = {}
        for f in sorted(root.glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for k in handle.keys():
                    if k in (EMBED_KEY, LM_HEAD_KEY):
                        files[k] = f
    if EMBED_KEY not in files:
        raise ValueError(f"checkpoint '{root}' has no {EMBED_KEY}")
    tensors: dict[str, torch.Tensor] = {}
    for key, f in files.items():
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            tensors[key] = handle.get_tensor(key)
    tied = bool(cfg.get("tie_word_embeddings", False)) or LM_HEAD_KEY not in tensors
    lm_head = None if tied else tensors[LM_HEAD_KEY]
    identity = TargetIdentity.from_tensors(arch, tensors[EMBED_KEY], lm_head)
    return TargetVocab(identity, tensors[EMBED_KEY], tensors[EMBED_KEY] if lm_head is None else lm_head)


@dataclass(frozen=True)
class EagleTrainStats:
    """What training measured, recorded in the checkpoint's config.json.
    top1_agreement: on held-out text, teacher-forced, the fraction of rows where the head's argmax
    equals the target's (the acceptance rate of the first greedy draft token); top1_agreement_step2:
    the same for the second draft token, drafted from the head's own hidden state;
    top1_agreement_no_history: the first token with the head seeing no earlier rows of its own."""

    steps: int
    loss: float
    top1_agreement: float | None = None
    top1_agreement_step2: float | None = None
    top1_agreement_no_history: float | None = None
    heldout_tokens: int = 0
    train_tokens: int = 0


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    dtype: str
    target: TargetIdentity
    train_stats: EagleTrainStats | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            _pos_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"eagle config: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"eagle config: head_dim must be even (RoPE), got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, float) and 0 < self.rms_norm_eps < 1):
            raise ValueError(f"eagle config: rms_norm_eps must be a float in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, float) and self.rope_theta > 1):
            raise ValueError(f"eagle config: rope_theta must be a float > 1, got {self.rope_theta!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"eagle config: dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.hidden_size != self.target.hidden_size:
            raise ValueError(f"eagle config: hidden_size {self.hidden_size} must equal the target's "
                             f"{self.target.hidden_size} (the head reads and writes the target's hidden state)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def for_target(cls, hf_config: Mapping[str, object], target: TargetIdentity, dtype: str = "float32") -> EagleConfig:
        """The head of one target-sized decoder layer, from the target's config.json fields."""
        hidden = int(hf_config["hidden_size"])  # type: ignore[call-overload]
        heads = int(hf_config["num_attention_heads"])  # type: ignore[call-overload]
        head_dim = hf_config.get("head_dim") or hidden // heads
        return cls(hidden_size=hidden, num_heads=heads,
                   num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),  # type: ignore[call-overload]
                   head_dim=int(head_dim),  # type: ignore[call-overload]
                   intermediate_size=int(hf_config["intermediate_size"]),  # type: ignore[call-overload]
                   rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
                   rope_theta=float(_rope_theta(hf_config)),
                   dtype=dtype, target=target)

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        return {"format": EAGLE_FORMAT, "format_version": EAGLE_FORMAT_VERSION, **d}

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> EagleConfig:
        if d.get("format") != EAGLE_FORMAT or d.get("format_version") != EAGLE_FORMAT_VERSION:
            raise ValueError(f"not a {EAGLE_FORMAT} v{EAGLE_FORMAT_VERSION} config: format "
                             f"{d.get('format')!r} version {d.get('format_version')!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"format", "format_version"})
        if unknown:
            raise ValueError(f"eagle config: unknown keys {unknown}; known: {sorted(known)}")
        body = {k: v for k, v in d.items() if k in known}
        body["target"] = TargetIdentity(**body["target"])  # type: ignore[arg-type]
        stats = body.get("train_stats")
        body["train_stats"] = None if stats is None else EagleTrainStats(**stats)  # type: ignore[arg-type]
        return cls(**body)  # type: ignore[arg-type]


def _rope_theta(hf_config: Mapping[str, object]) -> float:
    """The target's RoPE base (transformers 5 nests it in rope_parameters). The head applies plain
    RoPE with that base; a scaling the target may use (llama3, yarn) is not copied."""
    params = hf_config.get("rope_parameters")
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    return float(theta or hf_config.get("rope_theta") or 10000.0)  # type: ignore[arg-type]


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
        cfg = self.config if train_stats is None else _replace_stats(self.config, train_stats)
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


# Heads that ship with pdserve (package data), one directory each: `{"method": "eagle"}` without a
# model takes the one trained for the target being served.
SHIPPED_HEADS = pathlib.Path(__file__).parent / "heads"


def shipped_head_for(target: TargetIdentity) -> pathlib.Path:
    """The shipped head trained for `target`; ValueError naming the target when none is."""
    found = [d for d in sorted(SHIPPED_HEADS.iterdir()) if (d / CONFIG_FILE).is_file()] \
        if SHIPPED_HEADS.is_dir() else []
    for d in found:
        if read_config(d).target == target:
            return d
    raise ValueError(f"no draft head ships for target {target} (shipped: {[d.name for d in found]}); "
                     "train one with `pdserve draft train --out DIR` and pass \"model\": DIR")


def read_config(directory: str | os.PathLike[str]) -> EagleConfig:
    path = pathlib.Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"draft head '{directory}' has no {CONFIG_FILE}")
    return EagleConfig.from_json(json.loads(path.read_text()))


def _replace_stats(c: EagleConfig, stats: EagleTrainStats) -> EagleConfig:
    from dataclasses import replace

    return replace(c, train_stats=stats)


def atomic_write(path: pathlib.Path, write: object) -> None:
    """write(temp_path) then rename onto path: a reader sees the old file or the new, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(pathlib.Path(tmp))  # type: ignore[operator]
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a head is shipped and read by other users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def param_count_for(config: EagleConfig) -> int:
    """Trained parameters of a head of this config (without building it)."""
    H, D, inter = config.hidden_size, config.head_dim, config.intermediate_size
    attn = H * D * (2 * config.num_heads + 2 * config.num_kv_heads)
    return 2 * H * H + attn + 3 * H * inter + 3 * H

