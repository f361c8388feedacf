"""The one interface between the engine and a speculative decoder (E20), and what crosses it.

The engine (pdserve.engine.llm_engine) knows speculation only as "is there a decoder"; around
each step it calls, in this order:

    drafts = decoder.propose(running)            # before scheduling: request id -> draft (or slots)
    sched = scheduler.schedule(drafts)           # each decoding chunk may grow by a prefix of its draft
    sched = decoder.fill(sched)                  # a drafting model drafts into its granted slots
    out = runner.execute(sched, all_hidden=decoder.wants_all_hidden)
    decoder.after_pass(TargetPass(...))          # the pass's hidden states and when it began
    for each chunk that samples:
        with drafts:  decoder.verify(chunk, TargetRows(...), append)  # accept, emit, roll back
        without:      decoder.decoded(DecodedRow(...))                # the latest token's state

and, on a decode node, `decoder.handoff(Handoff(...))` when a request's KV and its prefill node's
context record have landed (D17/D19). `counters()` feeds EngineMetrics.spec_*; `share_swap`
lets the engine's CPU swap pool carry a drafting model's own KV. The only implementation is the
speculator (pdserve.engine.spec_decode.speculator), over one proposer
(pdserve.engine.spec_decode.proposers); docs/speculative-handoff.md walks through it.

Threading: every method runs on the engine thread (the caller of LLMEngine.step, or of apply_kv_events).
Nothing here waits.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.cache.swap import SwapSpace
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling.sampler import SampleLogprobs
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput

# Emits one token of the chunk being verified, through the engine's output path (detokenize, stop
# checks, finish): what it returns says whether the request finished.
AppendToken = Callable[[int, SampleLogprobs | None], RequestOutput]


@dataclass(frozen=True)
class Verdict:
    """What one verified chunk emits: `token_ids` = accepted drafts + the target's next token."""

    token_ids: tuple[int, ...]
    num_accepted: int


@dataclass(frozen=True)
class TargetPass:
    """One target pass, after it ran and before its verdicts."""

    chunks: tuple[ScheduledChunk, ...]
    num_batched_tokens: int
    all_hidden: torch.Tensor | None   # [T, H] final-norm states of every fed token (wants_all_hidden)
    began: float                      # time.perf_counter() before `fill` (the pass's cost includes drafting)


@dataclass(frozen=True)
class TargetRows:
    """What the target pass computed at one verification chunk's 1 + K sample rows."""

    logits: torch.Tensor                               # [K+1, V]
    hidden: torch.Tensor                               # [K+1, H] final-norm states at those rows
    # drafts verified by equality: the sampler's tokens and logprobs at those rows (drawn in the
    # step's one batched sampling, as plain decoding draws them)
    sampled: tuple[int, ...] = ()
    logprobs: tuple[SampleLogprobs | None, ...] = ()
    # drafts a draft model sampled (chunk.draft_probs): one generator per row for rejection sampling
    generators: tuple[torch.Generator, ...] = ()


@dataclass(frozen=True)
class DecodedRow:
    """A sampling chunk without drafts emitted one token (a plain decode, or a prompt's first sample)."""

    request: Request
    hidden: torch.Tensor      # [H] the target's final-norm state at `position`, which it was sampled from
    position: int
    finished: bool


@dataclass(frozen=True)
class Handoff:
    """A decode node's remote-prefilled request: its prefill node's hidden states (context record, D17/D19)."""

    request: Request
    position: int                     # the position before the last prompt token
    hidden: torch.Tensor              # [H] the target's state there
    history: torch.Tensor | None      # [n, H] the states of the n positions before it (context_history_rows)


@dataclass(frozen=True)
class SpecCounters:
    """EngineMetrics.spec_* (vLLM's meaning): a draft is one verified proposal of one sequence in
    one step; accepted tokens exclude the bonus token; per position i, the drafts whose token i was
    accepted; history rows: a draft head's rows a decode node wrote from context records."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    handoff_history_rows: int = 0


class SpeculativeDecoder(abc.ABC):
    """What the engine calls for speculative decoding (module docstring: the order)."""

    @property
    @abc.abstractmethod
    def uses_hidden(self) -> bool:
        """Wants the target's hidden state of each sampled position (decode nodes ship it, D17)."""

    @property
    @abc.abstractmethod
    def wants_all_hidden(self) -> bool:
        """Wants the hidden state of every position a pass computes (`TargetPass.all_hidden`)."""

    @abc.abstractmethod
    def propose(self, running: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """Drafts (or placeholder slots for a drafting model) for the running requests whose next
        pass decodes; the scheduler grants each a prefix of its draft."""

    @abc.abstractmethod
    def fill(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The scheduled pass with real drafts in the slots it granted (unchanged for a token proposer)."""

    @abc.abstractmethod
    def after_pass(self, target: TargetPass) -> None:
        """The pass ran: write what the drafter keeps of its hidden states, weigh its cost."""

    @abc.abstractmethod
    def verify(self, chunk: ScheduledChunk, rows: TargetRows, append: AppendToken) -> RequestOutput:
        """Accept a prefix of the chunk's drafts, emit it and the next token through `append`
        (stopping where the request ends), and give back the KV slots past what the request
        keeps; the output covers every token emitted."""

    @abc.abstractmethod
    def decoded(self, row: DecodedRow) -> None:
        """A chunk without drafts emitted its token (`row`)."""

    @abc.abstractmethod
    def handoff(self, handoff: Handoff) -> None:
        """A remote-prefilled request's KV has landed with its prefill node's hidden states."""

    @abc.abstractmethod
    def counters(self) -> SpecCounters:
        """A snapshot of the counters."""

    @abc.abstractmethod
    def share_swap(self, swap: SwapSpace) -> None:
        """The engine's CPU swap pool: a drafter with a KV pool of its own moves it with the target's."""
