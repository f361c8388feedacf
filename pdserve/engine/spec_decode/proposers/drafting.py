"""How a drafting model picks its draft tokens, and its batched single-token draft passes
(shared by the self-draft and the draft-model proposers).

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling.sampler import GREEDY_EPS, filtered_probs, token_seed
from pdserve.engine.scheduler.output import ScheduledChunk
from pdserve.engine.spec_decode.proposers.base import Drafted
from pdserve.kernels.ops.norm_act import argmax_rows

_DRAFT_SEED_SALT = 0x5D5A_17E9_D12A_F7B3   # a seeded request's draft draws: a stream apart from its own


class DraftPicker:
    """How a draft model picks each draft token: the argmax for a greedy request (q one-hot:
    verified by equality); for a sampled one, a draw from the draft's distribution under the
    request's own filters (temperature, top-k, top-p, min-p), verified by rejection sampling
    against the target's (pdserve.engine.spec_decode.rejection), which keeps the target's
    distribution whatever the draft's. A seeded request's draw for its output token n comes
    from a generator seeded by (seed, n) in a stream of its own, so it is reproducible."""

    def __init__(self) -> None:
        self._gen = torch.Generator().manual_seed(0x5EED)

    def pick(self, logits: torch.Tensor, requests: Sequence[Request], offsets: Sequence[int]
             ) -> tuple[list[int], list[torch.Tensor | None]]:
        """logits: [A, V] the draft's, row a for requests[a]'s draft token number offsets[a]."""
        tokens = argmax_rows(logits).tolist()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        for a, r in enumerate(requests):
            params = r.sampling
            if params.temperature < GREEDY_EPS:
                continue
            q = filtered_probs(logits[a:a + 1], [params])[0]                          # [V]
            if params.seed is None:
                gen = self._gen
            else:
                index = params.rng_skip_tokens + len(r.output_token_ids) + offsets[a]
                gen = torch.Generator().manual_seed(token_seed(params.seed ^ _DRAFT_SEED_SALT, index))
            noise = torch.empty_like(q).exponential_(generator=gen).clamp_(min=torch.finfo(q.dtype).tiny)
            tokens[a] = int((q / noise).argmax())
            probs[a] = q
        return tokens, probs


def draft_tokens(runner: ModelRunner, chunks: Sequence[ScheduledChunk], first: torch.Tensor,
                  want: Sequence[int], picker: DraftPicker, num_layers: int | None = None) -> list[Drafted]:
    """chunks[i] gets want[i] draft tokens: the first picked from first[i] ([N, V]: the draft's
    logits after the chunk's last known token), each next one from a single-token pass of the
    draft over the one before it (all sequences batched, one pass per draft position)."""
    toks: list[list[int]] = [[] for _ in chunks]
    qs: list[list[torch.Tensor | None]] = [[] for _ in chunks]
    active = [i for i in range(len(chunks)) if want[i] > 0]
    logits = first[torch.tensor(active, dtype=torch.long)] if len(active) != len(chunks) else first  # [A, V]
    pos = {i: chunks[i].start + chunks[i].num_known for i in active}     # where each next token goes
    while active:
        picked, probs = picker.pick(logits, [chunks[i].request for i in active], [len(toks[i]) for i in active])
        for j, i in enumerate(active):
            toks[i].append(picked[j])
            qs[i].append(probs[j])
        active = [i for i in active if len(toks[i]) < want[i]]
        if not active:
            break
        step = [ScheduledChunk(request=chunks[i].request, start=pos[i], num_tokens=1, samples=False,
                               draft_token_ids=(toks[i][-1],)) for i in active]
        for i in active:
            pos[i] += 1
        logits = runner.forward_chunks(step, range(len(step)), num_layers)                  # [A, V]
    out = []
    for t, q in zip(toks, qs, strict=True):
        sampled = [x for x in q if x is not None]
        out.append(Drafted(tuple(t), torch.stack(sampled) if sampled and len(sampled) == len(q) else None))
    return out
