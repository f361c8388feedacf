"""A draft head's checkpoint format (pdserve.model.eagle_head): its config, the target it belongs to,
its training record, and the heads that ship as package data.

A head directory holds config.json (`EagleConfig.to_json`: format, version, the layer's shape,
`TargetIdentity`, `EagleTrainStats`), model.safetensors (the head's own weights) and optionally
draft_vocab.safetensors (the token ids it drafts from). `TargetIdentity` names the one target a
head is valid for: architecture, hidden size, vocabulary, dtype and a blake2b hash of the stored
embedding / lm_head bytes. Shipped heads live under pdserve/assets/heads/ (`SHIPPED_HEADS`);
`shipped_head_for` finds the one trained for a target (docs/speculative-handoff.md).

The model room (imports only kernels). Called by whoever loads or trains a head (the engine
thread when the engine is built, `pdserve draft train`); nothing here waits, its only I/O is
reading a checkpoint's config and embedding tables and writing files atomically.
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



# Heads that ship with pdserve (package data, pyproject.toml), one directory each: `{"method": "eagle"}`
# without a model takes the one trained for the target being served.
SHIPPED_HEADS = pathlib.Path(__file__).resolve().parent.parent / "assets" / "heads"


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


def replace_train_stats(c: EagleConfig, stats: EagleTrainStats) -> EagleConfig:
    """c with `stats` as its training record."""
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

