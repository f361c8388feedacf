"""The n-gram proposer (`{"method": "ngram"}`): prompt lookup over a request's own tokens
(the matcher is pdserve.engine.spec_decode.ngram).

Threading: owned by the engine thread. Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.request import Request
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.ngram import NgramProposer
from pdserve.engine.spec_decode.proposers.base import TokenProposer


class NgramDrafts(TokenProposer):
    """Prompt lookup over the request's prompt and output so far (pdserve.engine.spec_decode.ngram)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self._ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose_batch(self, requests: Sequence[Request], ks: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(self._ngram.propose(r.prompt_token_ids + r.output_token_ids, k))
                for r, k in zip(requests, ks, strict=True)]
