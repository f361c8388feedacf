"""Deprecated import path (issue 30): the draft head moved beside the models.

The nn.Module is pdserve.model.eagle_head (EagleHead, draft_vocab_from_counts) and its checkpoint
format pdserve.model.eagle_config (EagleConfig, TargetIdentity, TargetVocab, load_target_vocab,
read_config, SHIPPED_HEADS, shipped_head_for, ...); the shipped weights are package data under
pdserve/assets/heads/. The engine's proposer that drafts with a head is
pdserve.engine.spec_decode.proposers.eagle.EagleDrafts. Import from those modules; this one only
re-exports their names for code written before the move and will be removed.
"""

from pdserve.model.eagle_config import (  # noqa: F401  (re-exports for the old path)
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    DTYPES,
    EAGLE_FORMAT,
    EAGLE_FORMAT_VERSION,
    EMBED_KEY,
    LM_HEAD_KEY,
    SHIPPED_HEADS,
    WEIGHTS_FILE,
    EagleConfig,
    EagleTrainStats,
    TargetIdentity,
    TargetVocab,
    atomic_write,
    load_target_vocab,
    param_count_for,
    read_config,
    shipped_head_for,
)
from pdserve.model.eagle_head import EagleHead, draft_vocab_from_counts  # noqa: F401
