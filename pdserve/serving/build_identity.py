"""A node's build identity (NodeInfo.build), and whether two nodes may pair for KV transfers.

Every prefill and decode node reports what it was built from (package version, git commit) and
what its transfers depend on: the model (its name and a hash of its config.json) and the KV layout
(layers, KV heads, head_dim, page size, KV dtype, the context record's layout: its version,
the hidden state's width and kind, the top-k width), hashed. A decode
node pairs only with prefill nodes whose model and KV-layout hash are its own (`incompatibility`);
version and commit are reported and logged, never compared, so a rolling update may mix builds whose
transfers agree.

    key = KvLayoutKey(num_layers=2, kv_heads=2, head_dim=16, page_size=16, dtype="float32",
                      hidden_size=64, context_top_k=32)
    ident = node_identity(model_name, model_dir, key)   # BuildIdentity (frozen)
    ident = engine_identity(llm_engine, context_top_k=32)  # the same, from a built LLMEngine
    info.build.CopyFrom(ident.to_pb())
    why = incompatibility(ident, BuildIdentity.from_pb(peer_info.build))   # '' when they pair

Commit: $PDSERVE_GIT_COMMIT when set (the container build records it there), else read from the
checkout the package runs from (.git's HEAD, a loose ref or packed-refs; no git process), else ''.
Resolving it never raises. Nothing here blocks but the small file reads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve_api.v1 import node_pb2

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    from pdserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

COMMIT_ENV = "PDSERVE_GIT_COMMIT"
# The context slot's layout (kv_messenger.context, D19): a versioned 64-byte header (identity,
# layout, position, crc32), then the hidden state, the top-k ids and logprobs, and the history rows
# (hidden states of earlier positions, a draft head's; 0 of them by default). Bump the version
# (here and kv_messenger.context.RECORD_VERSION; tests/unit/test_context_record.py checks they
# agree) when the record changes in any other way than its sizes.
CONTEXT_RECORD = "ctx3"
CONTEXT_RECORD_VERSION = 3
HIDDEN_KIND = "final_norm"   # the state the draft head was made for: the target's final-norm output
HASH_DIGITS = 16
_SHA = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")   # sha1 or sha256 object names


@dataclass(frozen=True)
class KvLayoutKey:
    """What a KV transfer between two nodes needs them to agree on. `kv_heads` is the model's total
    (a tensor-parallel side shards it; the shard plan maps heads across sizes)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str            # the KV pages' dtype, e.g. "float32", "bfloat16"
    hidden_size: int      # context record: the hidden state's width (float32)
    context_top_k: int    # context record: top-k ids (int32) and logprobs (float32); 0: none (colocated)
    context_version: int = CONTEXT_RECORD_VERSION   # context record: its header's version
    hidden_kind: str = HIDDEN_KIND                  # context record: which state of the target the hidden is
    context_history: int = 0                        # context record: hidden rows of earlier positions

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_size", "hidden_size", "context_top_k",
                     "context_version", "context_history"):
            v, least = getattr(self, name), 0 if name in ("context_top_k", "context_history") else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"KvLayoutKey.{name} must be an integer >= {least}, got {v!r}")
        if not self.dtype or not isinstance(self.dtype, str):
            raise ValueError(f"KvLayoutKey.dtype must be a dtype name, got {self.dtype!r}")
        if not self.hidden_kind or not isinstance(self.hidden_kind, str):
            raise ValueError(f"KvLayoutKey.hidden_kind must be a name, got {self.hidden_kind!r}")

    def describe(self) -> str:
        """The covered fields, readable (BuildIdentity.kv_layout); the hash is of this string."""
        return (f"layers={self.num_layers} kv_heads={self.kv_heads} head_dim={self.head_dim} "
                f"page={self.page_size} dtype={self.dtype} {CONTEXT_RECORD}=v{self.context_version}header,"
                f"hidden{self.hidden_size}xf32:{self.hidden_kind},top{self.context_top_k}xi32,"
                f"top{self.context_top_k}xf32,crc32" + (f",history{self.context_history}x{self.hidden_size}xf32"
                                                        if self.context_history else ""))

    def digest(self) -> str:
        return hashlib.sha256(self.describe().encode()).hexdigest()[:HASH_DIGITS]


@dataclass(frozen=True)
class BuildIdentity:
    """NodeInfo.build as a value."""

    version: str
    commit: str             # '' when unknown
    model: str
    model_config_hash: str  # '' when the config could not be read
    kv_layout_hash: str     # '' from a node that reports no identity
    kv_layout: str

    def to_pb(self) -> node_pb2.BuildIdentity:
        return node_pb2.BuildIdentity(version=self.version, commit=self.commit, model=self.model,
                                      model_config_hash=self.model_config_hash, kv_layout_hash=self.kv_layout_hash,
                                      kv_layout=self.kv_layout)

    @staticmethod
    def from_pb(pb: node_pb2.BuildIdentity) -> BuildIdentity:
        return BuildIdentity(version=pb.version, commit=pb.commit, model=pb.model,
                             model_config_hash=pb.model_config_hash, kv_layout_hash=pb.kv_layout_hash,
                             kv_layout=pb.kv_layout)

    def describe(self) -> str:
        """One line for logs: model (config hash), KV layout (hash), version and commit."""
        if not self.kv_layout_hash:
            return "no build identity reported"
        commit = self.commit[:12] or "commit unknown"
        return (f"model {self.model!r} (config {self.model_config_hash or '?'}), KV layout {self.kv_layout_hash} "
                f"[{self.kv_layout}], pdserve {self.version} ({commit})")


def incompatibility(own: BuildIdentity, peer: BuildIdentity) -> str:
    """Why a node of identity `own` must not pair with `peer` for KV transfers ('' when it may):
    another model (name or config), another KV layout, or no identity reported."""
    if not peer.kv_layout_hash:
        return "the peer reports no build identity"
    diffs = []
    if peer.model != own.model or peer.model_config_hash != own.model_config_hash:
        diffs.append("model")
    if peer.kv_layout_hash != own.kv_layout_hash:
        diffs.append("KV layout")
    if not diffs:
        return ""
    return f"{' and '.join(diffs)} differ: peer has {peer.describe()}; this node has {own.describe()}"


def model_config_hash(model_dir: str | os.PathLike[str]) -> str:
    """sha256 (first HASH_DIGITS hex digits) of the model's config.json with its keys sorted (so a
    rewrite that only reorders keys hashes alike); '' when it cannot be read."""
    path = pathlib.Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("build identity: cannot read %s (%s); its hash is left empty", path, e)
        return ""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_DIGITS]


def _git_dir(start: pathlib.Path) -> pathlib.Path | None:
    """The .git directory of the checkout holding `start` (a worktree's `gitdir:` file followed)."""
    for d in (start, *start.parents):
        dot = d / ".git"
        if dot.is_dir():
            return dot
        if dot.is_file():
            text = dot.read_text().strip()
            if text.startswith("gitdir:"):
                g = pathlib.Path(text.removeprefix("gitdir:").strip())
                return g if g.is_absolute() else (d / g).resolve()
            return None
    return None


def commit_of_checkout(start: pathlib.Path) -> str:
    """The commit HEAD names in the checkout holding `start`, read from files; '' when there is no
    checkout or its HEAD cannot be resolved."""
    try:
        git = _git_dir(start)
        if git is None:
            return ""
        head = (git / "HEAD").read_text().strip()
        if _SHA.match(head):
            return head   # detached
        if not head.startswith("ref:"):
            return ""
        ref = head.removeprefix("ref:").strip()
        common = git
        if (git / "commondir").is_file():   # a linked worktree keeps its refs in the main .git
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for base in (git, common):
            loose = base / ref
            if loose.is_file():
                sha = loose.read_text().strip()
                return sha if _SHA.match(sha) else ""
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref and _SHA.match(parts[0]):
                    return parts[0]
    except OSError as e:
        logger.debug("build identity: no commit from the checkout at %s: %s", start, e)
    return ""


@functools.lru_cache(maxsize=1)
def build_commit() -> str:
    """$PDSERVE_GIT_COMMIT, else the commit of the checkout the pdserve package runs from, else ''."""
    env = os.environ.get(COMMIT_ENV, "").strip()
    if env:
        return env
    return commit_of_checkout(pathlib.Path(__file__).resolve().parents[1])


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """The installed pdserve distribution's version; '0+unknown' when it is not installed."""
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def node_identity(model: str, model_dir: str | os.PathLike[str], layout: KvLayoutKey) -> BuildIdentity:
    """This node's identity: computed once when the node is built (it reads config.json and .git)."""
    return BuildIdentity(version=package_version(), commit=build_commit(), model=model,
                         model_config_hash=model_config_hash(model_dir), kv_layout_hash=layout.digest(),
                         kv_layout=layout.describe())


def engine_identity(engine: LLMEngine, context_top_k: int, context_version: int = CONTEXT_RECORD_VERSION,
                    hidden_kind: str = HIDDEN_KIND, context_history: int = 0) -> BuildIdentity:
    """`node_identity` of a built engine: its model, and its KV pool's geometry (the model's total KV
    heads, the pages' dtype) with a context record of `context_top_k` (0 for a colocated node), of
    header version `context_version`, carrying the hidden state of kind `hidden_kind` (the nodes
    pass their ContextCodec's) and `context_history` rows of earlier hidden states."""
    info = engine.info()
    layout = KvLayoutKey(num_layers=info.num_layers, kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                         page_size=info.page_size, dtype=str(engine.kv_cache.dtype).removeprefix("torch."),
                         hidden_size=info.hidden_size, context_top_k=context_top_k,
                         context_version=context_version, hidden_kind=hidden_kind,
                         context_history=context_history)
    return node_identity(info.model_name, engine.source.path, layout)
