"""The injected fault plan: the faults a test asks a node process to make, as one typed value.

Production code never reads a test switch itself: it takes a `FaultPlan` (default `NO_FAULTS`,
which changes nothing) from whoever built it. Only a process's entry point reads the plan from the
environment (`FaultPlan.from_env`, the four variables below, so a test can set them on a child it
starts) and injects it into the components that make the faults:

- `corrupt_kv` (`$PDSERVE_TEST_ONLY_CORRUPT_KV="PREFIX:N[,...]"`): a decode node's S7 verification
  of attempts 0 .. N-1 of request ids starting with PREFIX sees one byte flipped
  (kv_messenger.receiver.KvReceiver.verify);
- `bad_context` (`$PDSERVE_TEST_ONLY_BAD_CONTEXT="PREFIX:KIND:N[,...]"`): a prefill node damages the
  context records of those attempts one way (KIND in kv_messenger.context.DAMAGES) before posting;
- `bad_shard_key` (`$PDSERVE_TEST_ONLY_BAD_SHARD_KEY="PREFIX:RANK:N[,...]"`): a decode node names
  decode rank RANK's pool under a wrong memory key in those attempts' Prefill calls, so that on
  tcp;ofi_rxm that shard's writes are refused while the other ranks' land;
- `engine_death_file` (`$PDSERVE_TEST_ONLY_ENGINE_DEATH_FILE=PATH`, `{pid}` replaced by the
  process id): the engine thread dies (pdserve.engine.engine_thread.InjectedEngineDeath) once
  PATH exists.

Unset (always, outside the tests that set them): the plan is `NO_FAULTS`. A malformed entry is a
ValueError naming the variable and the entry, raised at the entry point, before anything starts.
This module is a leaf: it imports nothing of ours, so every room below the nodes may take a plan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

CORRUPT_KV_ENV = "PDSERVE_TEST_ONLY_CORRUPT_KV"
BAD_CONTEXT_ENV = "PDSERVE_TEST_ONLY_BAD_CONTEXT"
BAD_SHARD_KEY_ENV = "PDSERVE_TEST_ONLY_BAD_SHARD_KEY"
ENGINE_DEATH_FILE_ENV = "PDSERVE_TEST_ONLY_ENGINE_DEATH_FILE"
FAULT_ENVS = (CORRUPT_KV_ENV, BAD_CONTEXT_ENV, BAD_SHARD_KEY_ENV, ENGINE_DEATH_FILE_ENV)


@dataclass(frozen=True)
class CorruptKv:
    """Attempts < `attempts` of request ids starting with `prefix` fail their S7 verification."""

    prefix: str
    attempts: int


@dataclass(frozen=True)
class BadContext:
    """The context records of attempts < `attempts` of request ids starting with `prefix` are
    damaged one way (`kind`, one of kv_messenger.context.DAMAGES, checked where it is used)."""

    prefix: str
    kind: str
    attempts: int


@dataclass(frozen=True)
class BadShardKey:
    """Attempts < `attempts` of request ids starting with `prefix` name decode rank `rank`'s pool
    under a wrong memory key."""

    prefix: str
    rank: int
    attempts: int


def _entries(name: str, raw: str, shape: str) -> list[list[str]]:
    """`raw`'s comma-separated entries split like `shape` (PREFIX:N, PREFIX:KIND:N, ...) from the right."""
    fields = shape.count(":") + 1
    out = []
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        parts = entry.rsplit(":", fields - 1)
        if len(parts) != fields or not all(parts) or not parts[-1].isdigit():
            raise ValueError(f"{name}: expected {shape} entries, got {entry!r}")
        out.append(parts)
    return out


def parse_corrupt_kv(raw: str) -> tuple[CorruptKv, ...]:
    return tuple(CorruptKv(p, int(n)) for p, n in _entries(CORRUPT_KV_ENV, raw, "PREFIX:N"))


def parse_bad_contexts(raw: str) -> tuple[BadContext, ...]:
    return tuple(BadContext(p, kind, int(n)) for p, kind, n in _entries(BAD_CONTEXT_ENV, raw, "PREFIX:KIND:N"))


def parse_bad_shard_keys(raw: str) -> tuple[BadShardKey, ...]:
    out = []
    for p, rank, n in _entries(BAD_SHARD_KEY_ENV, raw, "PREFIX:RANK:N"):
        if not rank.isdigit():
            raise ValueError(f"{BAD_SHARD_KEY_ENV}: expected PREFIX:RANK:N entries, got {':'.join((p, rank, n))!r}")
        out.append(BadShardKey(p, int(rank), int(n)))
    return tuple(out)


@dataclass(frozen=True)
class FaultPlan:
    """Every fault a test asked this process to make (module docstring); empty: none."""

    corrupt_kv: tuple[CorruptKv, ...] = ()
    bad_context: tuple[BadContext, ...] = ()
    bad_shard_key: tuple[BadShardKey, ...] = ()
    engine_death_file: str | None = None      # `{pid}` already replaced

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, pid: int | None = None) -> FaultPlan:
        """The plan the TEST ONLY variables describe (entry points only); ValueError on a bad entry."""
        env = os.environ if environ is None else environ
        death = env.get(ENGINE_DEATH_FILE_ENV) or None
        if death is not None:
            death = death.replace("{pid}", str(os.getpid() if pid is None else pid))
        return cls(corrupt_kv=parse_corrupt_kv(env.get(CORRUPT_KV_ENV, "")),
                   bad_context=parse_bad_contexts(env.get(BAD_CONTEXT_ENV, "")),
                   bad_shard_key=parse_bad_shard_keys(env.get(BAD_SHARD_KEY_ENV, "")),
                   engine_death_file=death)

    def corrupts_kv(self, request_id: str, attempt: int) -> bool:
        return any(request_id.startswith(c.prefix) and attempt < c.attempts for c in self.corrupt_kv)

    def context_damage(self, request_id: str, attempt: int) -> str | None:
        """The damage to make to this attempt's context record (a DAMAGES kind), or None."""
        for b in self.bad_context:
            if request_id.startswith(b.prefix) and attempt < b.attempts:
                return b.kind
        return None

    def bad_key_ranks(self, request_id: str, attempt: int) -> tuple[int, ...]:
        """The decode ranks whose pool this attempt names under a wrong key."""
        return tuple(b.rank for b in self.bad_shard_key if request_id.startswith(b.prefix) and attempt < b.attempts)


NO_FAULTS = FaultPlan()
