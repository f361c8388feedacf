"""The prefill side of the speculative handoff (D17/D19): the last final-norm hidden states each
prefill-only request computed, kept until its prefill ends and shipped in its context record.

A prefill node's engine keeps, per prefill-only request, the states of its last
EngineConfig.context_history_rows + 1 positions (`keep`, after every pass, from the pass's
all-hidden output); when the prefill completes the engine takes them (`take`) for the
PrefillConnector's PrefillDone, which the KV messenger writes into the context record. A decode
node's draft head starts from the last of them and writes its history rows from the others
(SpeculativeDecoder.handoff). docs/speculative-handoff.md follows the rows end to end.

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Request
from pdserve.engine.scheduler.output import ScheduledChunk


class ContextTails:
    """rows: EngineConfig.context_history_rows (> 0); each request keeps up to rows + 1 states."""

    def __init__(self, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"context tails need history rows >= 1, got {rows}")
        self.keep_rows = rows + 1
        self._tails: dict[str, tuple[int, torch.Tensor]] = {}   # rid -> (position of row 0, [n, H])

    def keep(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Keep the last rows + 1 states of each prefill-only chunk's request. hidden: [T, H], the
        chunks' tokens in order."""
        keep = self.keep_rows
        q = 0
        for c in chunks:
            base, q = q, q + c.num_tokens
            r = c.request
            if not r.prefill_only:
                continue
            rows = hidden[max(base, q - keep):q].detach().clone()                     # [<= keep, H], to c.end
            start, held = self._tails.get(r.request_id, (c.start, rows[:0]))
            if start + held.shape[0] != c.start:      # not where the last chunk ended (a recompute)
                start, held = c.start, rows[:0]
            both = torch.cat((held, rows))[-keep:]
            self._tails[r.request_id] = (c.end - both.shape[0], both)

    def take(self, r: Request, end: int) -> torch.Tensor:
        """The kept states of positions .. end - 1 ([n, H], n <= rows + 1, at least that one)."""
        start, rows = self._tails.pop(r.request_id)
        if start + rows.shape[0] != end:
            raise RuntimeError(f"{r!r}: kept hidden states end at {start + rows.shape[0]}, its prefill at {end}")
        return rows

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted) before its prefill completed."""
        self._tails.pop(request_id, None)
