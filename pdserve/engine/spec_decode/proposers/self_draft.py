"""The self-draft proposer (`{"method": "draft_model", "self_draft_layers": k}`): the target's
first k layers draft into the lookahead slots.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.runner import ModelRunner
from pdserve.engine.scheduler.output import ScheduledChunk
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.proposers.base import Drafted, SlotProposer
from pdserve.engine.spec_decode.proposers.drafting import DraftPicker, draft_tokens


class SelfDraft(SlotProposer):
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
    for greedy and sampled requests alike (pdserve.engine.spec_decode.speculator). Under tensor parallelism every rank
    runs its shard of those k layers (the runner's StepMessage carries num_layers)."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        layers = runner.model.arch.num_layers
        k = config.self_draft_layers
        assert k is not None
        if not 1 <= k <= layers:
            raise ValueError(f"speculative config: self_draft_layers={k} but the model has {layers} layers")
        if not hasattr(runner.model, "_run_layers") or len(runner.batch_keys) != 1:
            raise ValueError(f"speculative config: a self-draft runs Llama-family models with one attention "
                             f"group, not {runner.model.arch.family!r} with {len(runner.batch_keys)}")
        self.num_layers = k
        self.runner = runner
        self.picker = DraftPicker()

    def draft(self, chunks: Sequence[ScheduledChunk]) -> list[Drafted]:
        # pass 1 feeds each sequence's last known token at its position (the target will
        # recompute it in the verification pass; the draft's layers get the same K/V)
        first = [ScheduledChunk(request=c.request, start=c.start, num_tokens=1, samples=False,
                                draft_token_ids=tuple(c.request.token_slice(c.start, c.start + 1))) for c in chunks]
        logits = self.runner.forward_chunks(first, range(len(first)), self.num_layers)      # [N, V]
        return draft_tokens(self.runner, chunks, logits, [len(c.draft_token_ids) for c in chunks],
                             self.picker, self.num_layers)
