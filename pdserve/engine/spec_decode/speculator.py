"""What the engine calls for speculative decoding (E20): drafts before a pass, verdicts after it.

    drafts = speculator.drafts(decoding)            # request id -> proposed tokens (before scheduling)
    sched = scheduler.schedule(drafts)              # each decode chunk may grow by a prefix of its draft
    ...one target pass: logits at the last known position and at every draft position...
    verdict = speculator.verify(chunk, sampled)     # the tokens to emit, the number accepted

Verification samples the target at each of the chunk's 1 + k positions exactly as plain decoding
samples it there (the same filters; a seeded request's token n draws from its generator reseeded
for n, pdserve.engine.sampling.sampler), and accepts drafts while they equal those samples; the
first sample that differs from its draft (or the sample after the last draft, the bonus) is
emitted too. For a deterministic draft (n-gram; q one-hot) this is speculative rejection sampling
(accept draft d with probability min(1, p(d) / q(d)) = p(d); on rejection draw from
norm(max(0, p - q)) = p without d) realised with the draws plain decoding makes: the emitted
tokens are the target's own samples, so greedy output is unchanged, and so is a seeded request's
(up to the float rounding of a multi-token pass; tests/integration/test_spec_decode.py).

Counters (vLLM's meaning, EngineMetrics.spec_*): a draft is one verified proposal of one sequence
in one step; accepted tokens exclude the bonus token; per position i, the drafts whose token i
was accepted.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler.output import ScheduledChunk, SchedulerOutput
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.kernels.ops.norm_act import argmax_rows


@dataclass(frozen=True)
class Verdict:
    """What one verified chunk emits: `token_ids` = accepted drafts + the target's next token."""

    token_ids: tuple[int, ...]
    num_accepted: int


def draft_room(request: Request, k: int) -> int:
    """How many draft tokens a decoding request can verify this step (<= k): every emitted token
    must fit its max_tokens and the context (a verification emits up to 1 + drafts tokens)."""
    room = request.max_total_tokens - request.num_tokens - 1
    m = request.sampling.max_tokens
    if m is not None:
        room = min(room, m - len(request.output_token_ids) - 1)
    return max(0, min(k, room))


class Proposer:
    """Drafts tokens for sequences that decode: before scheduling (`propose`, from the tokens
    alone), or, `needs_slots`, after it (`draft`: a draft model writes its KV into the slots the
    scheduler granted, so it can only run once they exist)."""

    needs_slots: ClassVar[bool] = False

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        """At most k tokens to follow the request's tokens; () for none."""
        raise NotImplementedError(f"{type(self).__name__} drafts after scheduling (needs_slots)")

    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ...]]:
        """Exactly len(c.draft_token_ids) tokens for each granted chunk (its drafts are placeholders)."""
        raise NotImplementedError(f"{type(self).__name__} drafts before scheduling (propose)")


class NgramDrafts(Proposer):
    """Prompt lookup over the request's prompt and output so far (pdserve.engine.spec_decode.ngram)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        from pdserve.engine.spec_decode.ngram import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self._ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        return tuple(self._ngram.propose(request.prompt_token_ids + request.output_token_ids, k))


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def drafts(self, decoding: Sequence[Request]) -> dict[str, tuple[int, ...]]:
        """Proposals for requests whose next pass is a decode step (1 token left to feed)."""
        out: dict[str, tuple[int, ...]] = {}
        k = self.config.num_speculative_tokens
        for r in decoding:
            room = draft_room(r, k)
            if room < 1:
                continue
            # a drafting model reserves its slots first: placeholders, replaced by `fill`
            draft = (0,) * room if self.proposer.needs_slots else self.proposer.propose(r, room)[:room]
            if draft:
                out[r.request_id] = draft
        return out

    def fill(self, sched: SchedulerOutput) -> SchedulerOutput:
        """The scheduled pass with real drafts in the chunks whose slots were granted (a
        `needs_slots` proposer runs here, before the target pass); others pass through."""
        if not self.proposer.needs_slots:
            return sched
        idx = [i for i, c in enumerate(sched.chunks) if c.draft_token_ids]
        if not idx:
            return sched
        drafts = self.proposer.draft([sched.chunks[i] for i in idx])
        chunks = list(sched.chunks)
        for i, d in zip(idx, drafts, strict=True):
            c = chunks[i]
            if len(d) != len(c.draft_token_ids):
                raise RuntimeError(f"{type(self.proposer).__name__} drafted {len(d)} tokens for "
                                   f"{c.request_id!r}, {len(c.draft_token_ids)} slots were granted")
            chunks[i] = dataclasses.replace(c, draft_token_ids=tuple(d))
        return dataclasses.replace(sched, chunks=tuple(chunks))

    def verify(self, draft: tuple[int, ...], sampled: Sequence[int]) -> Verdict:
        """Accept the drafts that equal the target's samples at their positions (len(sampled) =
        1 + len(draft)); record the counters."""
        if len(sampled) != len(draft) + 1:
            raise ValueError(f"verification of {len(draft)} drafts needs {len(draft) + 1} samples, got {len(sampled)}")
        a = 0
        while a < len(draft) and draft[a] == sampled[a]:
            a += 1
        if draft:
            self.num_drafts += 1
            self.num_draft_tokens += len(draft)
            self.num_accepted_tokens += a
            for i in range(a):
                self.accepted_per_pos[i] += 1
        return Verdict(token_ids=tuple(sampled[: a + 1]), num_accepted=a)


class SelfDraft(Proposer):
    """The target's first k decoder layers, its final norm and lm_head as the draft model
    (`{"method": "draft_model", "self_draft_layers": k}`): K greedy single-token passes over the
    granted chunks (one pass per draft position, all sequences batched).

    Its KV is the target's own for layers < k: for every accepted token the target computed those
    layers' K/V from the same inputs, so the draft needs no pool of its own and is kept in step
    with the target's (allocated, freed, preempted, offloaded together) by construction. Its
    passes write layers < k at the positions it drafts (the last known token and the drafts but
    the last), which lie in the lookahead slots the scheduler granted; the verification pass then
    writes every layer there, and rejected slots are truncated or overwritten, never read as
    computed. Drafts are the draft's argmax (q one-hot), so verification by equality is exact
    for greedy and sampled requests alike (module docstring)."""

    needs_slots = True

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        layers = runner.model.arch.num_layers
        k = config.self_draft_layers
        assert k is not None
        if not 1 <= k <= layers:
            raise ValueError(f"speculative config: self_draft_layers={k} but the model has {layers} layers")
        if runner.tp is not None:
            raise ValueError("speculative config: a self-draft does not run under tensor parallelism yet "
                             f"(tensor_parallel_size {runner.tp.plan.tp_size}); use method 'ngram'")
        if not hasattr(runner.model, "_run_layers") or len(runner.batch_keys) != 1:
            raise ValueError(f"speculative config: a self-draft runs Llama-family models with one attention "
                             f"group, not {runner.model.arch.family!r} with {len(runner.batch_keys)}")
        self.num_layers = k
        self.runner = runner

    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ...]]:
        want = [len(c.draft_token_ids) for c in chunks]
        out: list[list[int]] = [[] for _ in chunks]
        # the token each sequence feeds next, at its position: first its last known token
        feed = [c.request.token_slice(c.start, c.start + 1)[0] for c in chunks]
        pos = [c.start for c in chunks]
        active = list(range(len(chunks)))
        while active:
            step = [ScheduledChunk(request=chunks[i].request, start=pos[i], num_tokens=1, samples=False,
                                   draft_token_ids=(feed[i],)) for i in active]
            logits = self.runner.run_layers_prefix(step, self.num_layers)      # [len(active), V]
            nxt = argmax_rows(logits).tolist()
            for j, i in enumerate(active):
                out[i].append(nxt[j])
                feed[i] = nxt[j]
                pos[i] += 1
            active = [i for i in active if len(out[i]) < want[i]]
        return [tuple(d) for d in out]


def make_speculator(config: SpeculativeConfig | None, runner: ModelRunner) -> Speculator | None:
    """The engine's speculator (None: off); ValueError naming what does not fit the model."""
    if config is None:
        return None
    if config.method == "ngram":
        return Speculator(config, NgramDrafts(config))
    if config.self_draft_layers is not None:
        return Speculator(config, SelfDraft(config, runner))
    raise ValueError(f"speculative config: a draft model from a checkpoint ({config.model!r}) is not built yet; "
                     f"use self_draft_layers (the target's own first layers) or method 'ngram'")
