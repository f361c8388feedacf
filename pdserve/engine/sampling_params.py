"""Per-request sampling options (E19), validated when built.

`SamplingParams` is frozen: once a request is admitted its sampling contract never changes.
Every invalid value raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax); > 0 scales logits before sampling.
    top_k: keep the k most likely tokens (0 or -1 disables).
    top_p: nucleus sampling, keep the smallest set whose probability mass reaches top_p, in (0, 1].
    min_p: drop tokens whose probability is below min_p x the most likely token's, in [0, 1].
    seed: per-request seed; two requests with the same seed and prompt sample the same tokens.
    max_tokens: generated tokens at most (>= 1). None means "until the context is full".
    stop: strings that end generation; the matched stop string is not part of the output text.
    stop_token_ids: token ids that end generation (in addition to EOS unless ignore_eos).
    ignore_eos: keep generating past EOS tokens (benchmarks).
    logprobs: None for none; n >= 0 returns the sampled token's logprob plus the n most likely.
    skip_special_tokens: drop special tokens from the output text.
    rng_skip_tokens: tokens of the seed's stream already drawn elsewhere (needs a seed): the first
        token sampled is the stream's token number rng_skip_tokens (a request resumed after that many
        streamed tokens continues exactly as an uninterrupted run; pdserve.engine.sampling.sampler).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    rng_skip_tokens: int = 0

    def __post_init__(self) -> None:
        # Accept lists and a single string for convenience, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        mt = self.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {mt!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for tid in self.stop_token_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {tid!r}")
        sk = self.rng_skip_tokens
        if isinstance(sk, bool) or not isinstance(sk, int) or sk < 0:
            raise ValueError(f"rng_skip_tokens must be an integer >= 0, got {sk!r}")
        if sk and self.seed is None:
            raise ValueError(f"rng_skip_tokens={sk} needs a seed: an unseeded stream cannot be continued")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not (0 <= lp <= 20)):
            raise ValueError(f"logprobs must be an integer in [0, 20] or None, got {lp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
