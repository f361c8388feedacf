"""The requests a benchmark sends (L1): random or fixed lengths, the shipped prompt set, a JSONL file.

    requests = random_requests(100, input_len=LengthRange(512, 2048), output_len=LengthRange(128, 256), seed=0)
    requests = prompt_file_requests(SHIPPED_PROMPTS, 50, output_len=LengthRange(64), seed=0)

Random and fixed-length prompts are token ids drawn uniformly from `token_range` (by default the
ordinary tokens of the default model, SmolLM2: ids 0-16 are its special tokens), sent as ids so the
server sees exactly `prompt_len` tokens. Text prompts (the shipped set, JSONL files) have no known
token count here; the server's usage count is what the records keep. Every draw comes from one
`random.Random(seed)`: the same arguments give the same requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Union

SHIPPED_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
DEFAULT_TOKEN_RANGE = (17, 49152)  # SmolLM2's vocabulary without its 17 special tokens

Prompt = Union[str, tuple[int, ...]]


@dataclass(frozen=True)
class LengthRange:
    """Token counts drawn uniformly from [low, high] (both included); high defaults to low (fixed)."""

    low: int
    high: int | None = None

    def __post_init__(self) -> None:
        if self.high is None:
            object.__setattr__(self, "high", self.low)
        if isinstance(self.low, bool) or not isinstance(self.low, int) or self.low < 1:
            raise ValueError(f"a length must be an integer >= 1, got low={self.low!r}")
        if not isinstance(self.high, int) or self.high < self.low:
            raise ValueError(f"a length range needs low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """"N" (fixed) or "LOW:HIGH"."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"a length must be N or LOW:HIGH (integers), got {text!r}") from None
        if len(values) not in (1, 2):
            raise ValueError(f"a length must be N or LOW:HIGH, got {text!r}")
        return cls(*values)

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    def draw(self, rng: random.Random) -> int:
        return self.low if self.fixed else rng.randint(self.low, self.high)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return str(self.low) if self.fixed else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: a prompt (text or token ids), how many tokens to ask for.
    prompt_len: the prompt's token count when known here (token-id prompts), else None."""

    index: int
    prompt: Prompt
    max_tokens: int
    prompt_len: int | None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.index}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.index}: max_tokens must be >= 1, got {self.max_tokens}")

    def __repr__(self) -> str:  # prompts stay out of logs: lengths only
        kind = "ids" if isinstance(self.prompt, tuple) else "text"
        size = len(self.prompt)
        return f"BenchRequest(index={self.index}, {kind}[{size}], max_tokens={self.max_tokens})"


def random_requests(num: int, input_len: LengthRange, output_len: LengthRange, seed: int = 0,
                    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[BenchRequest]:
    """`num` prompts of random token ids; lengths uniform in the ranges (fixed when low == high)."""
    _check_num(num)
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"token_range must be (low, high) with 0 <= low < high, got {token_range}")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        n = input_len.draw(rng)
        ids = tuple(rng.randrange(lo, hi) for _ in range(n))
        out.append(BenchRequest(i, ids, output_len.draw(rng), n))
    return out


def load_prompt_file(path: str | Path) -> list[tuple[Prompt, int | None]]:
    """Prompts of a JSONL file: one object per line with "prompt" (text, or a list of token ids) and
    optionally "max_tokens". Blank lines are skipped; anything else malformed raises ValueError
    naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from None
    items: list[tuple[Prompt, int | None]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise ValueError(f'{where}: each line must be an object with a "prompt" field')
        prompt = obj["prompt"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in prompt):
            prompt = tuple(prompt)
        elif not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{where}: "prompt" must be non-empty text or a list of token ids >= 0')
        max_tokens = obj.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f'{where}: "max_tokens" must be an integer >= 1, got {max_tokens!r}')
        items.append((prompt, max_tokens))
    if not items:
        raise ValueError(f"prompt file {path} has no prompts")
    return items


def prompt_file_requests(path: str | Path, num: int, output_len: LengthRange | None,
                         seed: int = 0) -> list[BenchRequest]:
    """`num` requests from a JSONL prompt file, drawn with replacement in a seeded order (every prompt
    once before any repeats). max_tokens: drawn from `output_len` when given, else the line's
    "max_tokens" (a line without one then raises)."""
    _check_num(num)
    items = load_prompt_file(path)
    rng = random.Random(seed)
    out = []
    order: list[int] = []
    for i in range(num):
        if not order:
            order = list(range(len(items)))
            rng.shuffle(order)
        prompt, line_max = items[order.pop()]
        if output_len is not None:
            max_tokens = output_len.draw(rng)
        elif line_max is not None:
            max_tokens = line_max
        else:
            raise ValueError(f'{path}: a prompt has no "max_tokens" and no output length was given (--output-len)')
        out.append(BenchRequest(i, prompt, max_tokens, len(prompt) if isinstance(prompt, tuple) else None))
    return out


def _check_num(num: int) -> None:
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise ValueError(f"the number of prompts must be an integer >= 1, got {num!r}")


DATASETS = ("random", "fixed", "prompts", "jsonl")
_WARMUP_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class DatasetSpec:
    """Which requests to build: kind "random" (input/output lengths drawn from ranges), "fixed" (the
    ranges must be single values), "prompts" (the shipped prompt set), "jsonl" (the file at path)."""

    kind: str
    num_prompts: int
    input_len: LengthRange | None = None
    output_len: LengthRange | None = None
    path: str | None = None
    seed: int = 0
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE

    def __post_init__(self) -> None:
        if self.kind not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.kind!r}")
        if self.kind in ("random", "fixed"):
            if self.input_len is None or self.output_len is None:
                raise ValueError(f"dataset {self.kind} needs an input and an output length")
            if self.kind == "fixed" and not (self.input_len.fixed and self.output_len.fixed):
                raise ValueError(f"dataset fixed takes single lengths, got input {self.input_len}, "
                                 f"output {self.output_len} (use dataset random for ranges)")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("dataset jsonl needs a file path (--dataset-path)")
        if self.kind in ("prompts", "random", "fixed") and self.path:
            raise ValueError(f"dataset {self.kind} takes no file path (got {self.path!r}); use dataset jsonl")

    def build(self) -> list[BenchRequest]:
        if self.kind in ("random", "fixed"):
            assert self.input_len is not None and self.output_len is not None
            return random_requests(self.num_prompts, self.input_len, self.output_len, self.seed, self.token_range)
        path = SHIPPED_PROMPTS if self.kind == "prompts" else Path(self.path or "")
        return prompt_file_requests(path, self.num_prompts, self.output_len, self.seed)

    def warmup_requests(self, count: int) -> list[BenchRequest]:
        """`count` short requests (at most 64 prompt and 8 output tokens: a warm-up loads what a server
        loads lazily, it need not be long) of random token ids from a seed of their own, so that a
        server's prefix cache holds none of the run's prompts after the warm-up."""
        low = self.input_len.low if self.kind in ("random", "fixed") and self.input_len is not None else 64
        out = self.output_len.low if self.output_len is not None else 8
        return random_requests(count, LengthRange(min(low, 64)), LengthRange(min(out, 8)),
                               self.seed + _WARMUP_SEED_OFFSET, self.token_range)

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "num_prompts": self.num_prompts,
                "input_len": None if self.input_len is None else str(self.input_len),
                "output_len": None if self.output_len is None else str(self.output_len),
                "path": self.path, "seed": self.seed, "token_range": list(self.token_range)}
