"""Builds the engine's speculator from its SpeculativeConfig (E20): the proposer the method names,
with whatever it loads (a separate draft checkpoint and its KV pool, an eagle head for the target).

Called once by the engine builder (pdserve.engine.builder) on the thread that builds the engine,
and by tests and benchmarks that install another speculator on an idle engine. Nothing here
waits; it reads checkpoints from disk. docs/speculative-handoff.md says how the pieces fit.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.runner import ModelRunner
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.proposers.draft_model import DraftModel
from pdserve.engine.spec_decode.proposers.eagle import EagleDrafts
from pdserve.engine.spec_decode.proposers.ngram import NgramDrafts
from pdserve.engine.spec_decode.proposers.self_draft import SelfDraft
from pdserve.engine.spec_decode.speculator import Speculator
from pdserve.model.arch import ModelArch
from pdserve.model.eagle_config import load_target_vocab, shipped_head_for
from pdserve.model.eagle_head import EagleHead
from pdserve.model.loader import iter_weights, load_config, load_tokenizer, resolve_model
from pdserve.model.registry import build_model

logger = logging.getLogger(__name__)


def load_draft_runner(config: SpeculativeConfig, runner: ModelRunner, tokenizer, max_model_len: int,
                      dtype: torch.dtype, small_batch_max_tokens: int) -> ModelRunner:
    """The draft checkpoint with its KV pool (the target's page count and page size), or
    ValueError naming what differs from the target."""
    source = resolve_model(config.model)
    hf_config = load_config(source)
    arch = ModelArch.from_hf_config(hf_config)
    target = runner.model.arch
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"speculative config: draft model {config.model!r} has a vocabulary of {arch.vocab_size} "
                         f"tokens, the target {target.vocab_size}; a draft must share the target's tokenizer")
    theirs = load_tokenizer(source).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise ValueError(f"speculative config: draft model {config.model!r} has a different tokenizer than the "
                         f"target ({len(theirs)} vs {len(ours)} tokens; e.g. {differ}); a draft must share it")
    if any(t != target.layer_types[0] for t in arch.layer_types) or arch.sliding_window is not None:
        raise ValueError(f"speculative config: draft model {config.model!r} has sliding-window layers; a draft "
                         f"model must use full attention only")
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative config: draft model {config.model!r} takes {arch.max_position_embeddings} "
                         f"positions, the target serves max_model_len {max_model_len}")
    model = build_model(arch, hf_config, dtype, max_model_len, small_batch_max_tokens=small_batch_max_tokens)
    model.load_weights(iter_weights(source))
    model.eval()
    s = runner.kv.shape
    kv = PagedKVCache(KVCacheShape(arch.num_layers, s.num_pages, arch.num_kv_heads, s.page_size, arch.head_dim),
                      runner.kv.dtype)
    logger.info("draft model %s: %d layers, KV pool of %d pages (%.2f GiB) indexed by the target's block ids",
                source.name, arch.num_layers, s.num_pages, kv.buffer.numel() * kv.buffer.element_size() / 2**30)
    return ModelRunner(model, kv, runner.cache_manager, runner.backend, padding_block=runner.padding_block)


def make_speculator(config: SpeculativeConfig | None, runner: ModelRunner, tokenizer=None, max_model_len: int = 0,
                    dtype: torch.dtype = torch.float32, small_batch_max_tokens: int = 0,
                    catch_up_tokens: int = 512, target_path: str | None = None) -> Speculator | None:
    """The engine's speculator (None: off); ValueError naming what does not fit the model.
    A separate draft model (config.model) is loaded here: `tokenizer` (the target's, to compare),
    `max_model_len`, `dtype` and `small_batch_max_tokens` are the engine's; `catch_up_tokens`
    bounds the draft's catch-up per step (the engine passes max_batch_tokens)."""
    if config is None:
        return None
    cm = runner.cache_manager
    if config.method == "ngram":
        return Speculator(config, NgramDrafts(config), cm)
    if config.method == "eagle":
        if target_path is None:
            raise ValueError("speculative config: an eagle head needs the target checkpoint's path to check it")
        vocab = load_target_vocab(target_path)
        path = config.model if config.model is not None else shipped_head_for(vocab.identity)
        head = EagleHead.load(path, vocab)
        head.eval()
        logger.info("eagle draft head %s: %d parameters", path, head.num_parameters())
        return Speculator(config, EagleDrafts(head, runner), cm)
    if config.self_draft_layers is not None:
        return Speculator(config, SelfDraft(config, runner), cm)
    if tokenizer is None:
        raise ValueError("speculative config: a draft model needs the target's tokenizer to compare with")
    draft_runner = load_draft_runner(config, runner, tokenizer, max_model_len, dtype, small_batch_max_tokens)
    return Speculator(config, DraftModel(config, runner, draft_runner, catch_up_tokens), cm)
