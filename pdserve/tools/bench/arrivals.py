"""When each request is sent (L1): inter-arrival gaps drawn from a gamma distribution.

With shape `burstiness` and scale 1 / (rate * burstiness), the mean gap is 1 / rate whatever the
burstiness; burstiness 1 is a Poisson process (exponential gaps), lower is burstier, higher is
more regular (vLLM's definition, so rates and burstiness mean the same as in its benchmarks). An
infinite rate sends everything at once (then a concurrency cap, if any, paces the run).
"""

from __future__ import annotations

import math
import random


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start, one per request, non-decreasing; the first is 0."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be an integer >= 0, got {num!r}")
    if not rate > 0:  # also rejects NaN
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets = []
    t = 0.0
    for i in range(num):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets
