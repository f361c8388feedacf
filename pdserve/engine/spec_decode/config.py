"""The speculative-decoding configuration (E20): one frozen, validated dataclass.

Its JSON form is vLLM's `--speculative-config`:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "self_draft_layers": 8, "num_speculative_tokens": 4}
    {"method": "eagle", "model": "/path/to/head", "num_speculative_tokens": 3}

method "ngram": prompt lookup over the sequence's own tokens (prompt and output so far);
    prompt_lookup_max / prompt_lookup_min bound the n-gram that is matched (defaults 4 and 2; when
    only one is given the other takes its value, as vLLM does).
method "draft_model": a smaller model drafts K tokens autoregressively. `self_draft_layers: k`
    is the built-in draft: the target's own first k decoder layers, its final norm and its
    lm_head (pdserve.engine.spec_decode.proposers.self_draft). `model: PATH` names a separate
    checkpoint (proposers.draft_model).
method "eagle": a draft head (`pdserve draft train`; pdserve.model.eagle_head) drafts from
    the target's own last hidden state: `model: DIR` names the head, trained for this target;
    without a model, the head that ships for the target (pdserve/assets/heads/,
    eagle_config.SHIPPED_HEADS; the default model has one).
num_speculative_tokens (K): draft tokens verified per sequence per step, 1..MAX_SPECULATIVE_TOKENS.
adaptive (pdserve's, default true): verify only the draft tokens expected to pay for their share
    of the pass (pdserve.engine.spec_decode.control), so speculation turns itself down where it
    costs (large batches, drafts that are rejected); false verifies every proposal in full.

Every invalid value raises ValueError naming it; unknown keys are refused, listing the accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

SPEC_METHODS = ("ngram", "draft_model", "eagle")
MAX_SPECULATIVE_TOKENS = 16        # a verification chunk is 1 + K query tokens of one sequence
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2
# Rows of its own history an eagle head attends over when it drafts: the window it was trained on
# (`pdserve draft train --seq-len`, default 128), which also bounds the gather of each draft; and
# the prompt rows a prefill node hands a decode node for it (EngineConfig.context_history_rows).
EAGLE_HISTORY_ROWS = 128


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative config: {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    self_draft_layers: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative config: adaptive must be true or false, got {self.adaptive!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative config: unknown method {self.method!r}; known: {', '.join(SPEC_METHODS)}")
        _int_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if self.model is not None or self.self_draft_layers is not None:
                raise ValueError("speculative config: method 'ngram' takes no model or self_draft_layers "
                                 f"(got model={self.model!r}, self_draft_layers={self.self_draft_layers!r})")
            hi, lo = self.prompt_lookup_max, self.prompt_lookup_min
            if hi is None and lo is None:
                hi, lo = DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN
            elif hi is None:
                hi = lo
            elif lo is None:
                lo = hi
            _int_at_least("prompt_lookup_min", lo, 1)
            _int_at_least("prompt_lookup_max", hi, 1)
            if lo > hi:
                raise ValueError(f"speculative config: prompt_lookup_min ({lo}) must not exceed "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_max", hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
        elif self.method == "eagle":
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None or \
                    self.self_draft_layers is not None:
                raise ValueError("speculative config: method 'eagle' takes only model (a draft head directory, "
                                 "`pdserve draft train`) and num_speculative_tokens")
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                raise ValueError(f"speculative config: method 'eagle' takes model: the draft head's directory "
                                 f"(or no model: the head shipped for the target), got {self.model!r}")
        else:
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative config: prompt_lookup_max / prompt_lookup_min apply to method "
                                 "'ngram' only")
            if (self.model is None) == (self.self_draft_layers is None):
                raise ValueError("speculative config: method 'draft_model' takes exactly one of model (a local "
                                 "checkpoint path) or self_draft_layers (the target's first k layers), got "
                                 f"model={self.model!r}, self_draft_layers={self.self_draft_layers!r}")
            if self.self_draft_layers is not None:
                _int_at_least("self_draft_layers", self.self_draft_layers, 1)
            if self.model is not None and (not isinstance(self.model, str) or not self.model):
                raise ValueError(f"speculative config: model must be a non-empty path, got {self.model!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SpeculativeConfig:
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; accepted: {', '.join(sorted(names))}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative config: {key!r} is required (got keys {sorted(d)})")
        return cls(**d)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, object] | str | None) -> SpeculativeConfig | None:
        """A config from what users give: a SpeculativeConfig, a dict, a JSON string, or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON ({exc.msg} at column {exc.colno}): "
                                 f"{value!r}") from None
        return cls.from_dict(value)  # type: ignore[arg-type]

    def to_json(self) -> str:
        """The JSON form (what the launcher passes on to every node's --speculative-config)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None},
                          sort_keys=True)
