"""The proposer interface (E20): what drafts tokens for the speculator (pdserve.engine.spec_decode.speculator).

Two kinds: a TokenProposer drafts before scheduling, from what it knows of each sequence (n-gram,
a draft head); a SlotProposer drafts after it, into the lookahead slots the scheduler granted,
because a drafting model writes its KV there (a self-draft, a separate draft model). How a
proposer plugs in: docs/speculative-handoff.md.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from pdserve.engine.cache.kv_cache import PagedKVCache
from pdserve.engine.request import Request
from pdserve.engine.scheduler.output import ScheduledChunk


@dataclass(frozen=True)
class Drafted:
    """One sequence's drafts: tokens, and the draft's distribution of each when it was sampled
    ([len(token_ids), V]; None when every token was the draft's argmax: a greedy request)."""

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None


class Proposer(abc.ABC):
    """Drafts tokens for sequences that decode. Two kinds: a TokenProposer drafts before
    scheduling, from what it knows of each sequence; a SlotProposer (`needs_slots`) drafts after
    it, because a draft model writes its KV into the slots the scheduler granted."""

    needs_slots: ClassVar[bool]
    uses_hidden: ClassVar[bool] = False   # wants the target's hidden state of each sampled position (`note`)
    wants_all_hidden: ClassVar[bool] = False  # wants every computed position's (`after_pass`)
    # drafting costs per token (a model step), so the control chooses how many before drafting
    costly: ClassVar[bool] = False

    def note(self, request: Request, hidden: torch.Tensor, position: int) -> None:  # noqa: B027
        """The target's final-norm hidden state at `position` of `request` ([hidden]), the one its
        latest token was sampled from; kept by proposers that draft from it, ignored by others."""

    def after_pass(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:  # noqa: B027
        """After a target pass over `chunks` (before its verdicts): the final-norm hidden state of
        every token it fed ([T, hidden], the chunks' tokens in order); for `wants_all_hidden`."""

    def seed_history(self, request: Request, hidden: torch.Tensor, position: int) -> None:  # noqa: B027
        """A decode node's handed-over history: the target's hidden states of the positions
        position - n .. position - 1 ([n, hidden], before the one `note` gets); for `wants_all_hidden`."""

    def own_pool(self) -> PagedKVCache | None:
        """A KV pool of the proposer's own indexed by the target's block ids (a draft model's), for
        the engine's swap pool to move with the target's (`carry_offloads`); None: it has none."""
        return None

    def carry_offloads(self) -> None:  # noqa: B027
        """The swap pool now moves `own_pool()` with the target's pages: an offload and restore
        keeps the proposer's KV valid."""


class TokenProposer(Proposer):
    needs_slots = False

    @abc.abstractmethod
    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[tuple[int, ...]]:
        """At most ks[i] tokens to follow requests[i]'s tokens; () for none."""


class SlotProposer(Proposer):
    needs_slots = True

    @abc.abstractmethod
    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[Drafted]:
        """At most len(c.draft_token_ids) tokens for each granted chunk (its drafts are placeholders)."""
