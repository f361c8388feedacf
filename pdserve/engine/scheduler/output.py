"""The contract between the scheduler and the model runner (and the KV messenger, D6)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request run in this pass.

    samples: the chunk reaches the end of the request's known tokens, so the pass samples the
    next token from its last position. A prefill chunk that stops short does not sample.
    draft_token_ids: speculative decoding (E20): tokens proposed after the known ones; they are
    the chunk's last len(draft_token_ids) tokens (num_tokens counts them), and the pass samples
    the target at the last known position and at every draft position, to verify them.
    """

    request: Request
    start: int
    num_tokens: int
    samples: bool
    draft_token_ids: tuple[int, ...] = ()
    # the draft's distribution of each draft token when it was sampled (a draft model under
    # temperature > 0): [len(draft_token_ids), V]; None: deterministic drafts (n-gram, greedy)
    draft_probs: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def num_known(self) -> int:
        """Tokens of the request itself (the chunk's tokens before its drafts)."""
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Positions the pass samples: 1 + drafts for a sampling chunk, 0 otherwise."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class StalledRequest:
    """A running request that got nothing this step: the pool could not supply the blocks its
    next chunk needs (the engine may offload or soft-reset others to make room, E15)."""

    request: Request
    num_blocks: int  # net blocks its wanted chunk needs from the pool

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class SchedulerOutput:
    """One forward pass: single-token (decode) chunks first, then multi-token (prefill) chunks."""

    chunks: tuple[ScheduledChunk, ...]
    stalled: tuple[StalledRequest, ...] = ()
    # Remote-prefill requests admitted this step: their pages are allocated and they now wait
    # for their KV (the decode node asks a prefill node to fill them).
    kv_waits: tuple[Request, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
