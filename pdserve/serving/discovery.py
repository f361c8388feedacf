"""Peers found by name (K4): `dns:NAME:PORT` beside static `HOST:PORT`, resolved again and again.

    members = Membership(("10.0.0.7:50071", "dns:pdserve-decode.ns.svc.cluster.local:50071"))
    members.static                      # the static addresses, usable before any resolution
    change = await members.refresh()    # None when nothing changed, else Change(added, removed, current)

A headless Kubernetes Service has one DNS record per ready pod, so resolving its name each poll
round gives the pods that serve now: a pod that joins, leaves or comes back with a new address is
picked up without restarting the caller (the router polls its decode nodes, a decode node its
prefill nodes, and each calls `refresh` at the start of its round).

The resolver is a seam (`Resolver`): `DnsResolver` (socket.getaddrinfo, the default),
`StaticResolver` (a mapping the tests set), `FileResolver` (a JSON file of name -> addresses,
re-read at every resolution, so that tests can feed processes they start). `default_resolver()`
is a FileResolver when $PDSERVE_RESOLVER_FILE is set, else DnsResolver.

A name that fails to resolve keeps its last answer (a DNS hiccup must not empty the pool; the
peers' own health checks take dead ones out of rotation) and is logged once per failure streak.
A name that resolves to no address at all empties its share.

Blocking waits, with their bounds: one resolution runs in a worker thread (asyncio.to_thread), so
the event loop never waits on DNS; getaddrinfo's own bound is the system resolver's (resolv.conf
`timeout` x `attempts`, 5 s x 2 by default), and a refresh waits for all names together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:"
RESOLVER_FILE_ENV = "PDSERVE_RESOLVER_FILE"


def split_host_port(address: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); ValueError naming the address."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address must be HOST:PORT with a port in 1..65535, got {address!r}")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Target:
    """One entry of an address list: a static address, or a name resolved each round."""

    text: str          # as given
    host: str
    port: int
    dynamic: bool      # a dns: entry

    @classmethod
    def parse(cls, text: str) -> Target:
        text = text.strip()
        dynamic = text.startswith(DNS_PREFIX)
        host, port = split_host_port(text[len(DNS_PREFIX):] if dynamic else text)
        if dynamic and not host:
            raise ValueError(f"{text!r}: expected dns:NAME:PORT")
        return cls(text, host, port, dynamic)


def parse_targets(entries: str | Iterable[str]) -> tuple[Target, ...]:
    """Targets of a comma-separated string or a sequence of entries; ValueError naming a bad one."""
    items = entries.split(",") if isinstance(entries, str) else list(entries)
    return tuple(Target.parse(e) for e in items if e.strip())


def is_dynamic(entries: str | Iterable[str]) -> bool:
    return any(t.dynamic for t in parse_targets(entries))


class Resolver(Protocol):
    """Name -> addresses. Called from a worker thread; raises OSError when the name cannot be resolved."""

    def resolve(self, host: str, port: int) -> tuple[str, ...]: ...   # 'HOST:PORT' each, sorted


class DnsResolver:
    """The system resolver: every A / AAAA record of the name (a headless Service: one per ready pod)."""

    def resolve(self, host: str, port: int) -> tuple[str, ...]:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        return tuple(sorted({join_host_port(str(info[4][0]), port) for info in infos}))


class StaticResolver:
    """Names the test sets: `set(name, [addresses])`; an unknown name raises as DNS would (NXDOMAIN)."""

    def __init__(self, records: Mapping[str, Sequence[str]] | None = None) -> None:
        self._records: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (records or {}).items()}

    def set(self, name: str, addresses: Sequence[str]) -> None:
        self._records[name] = tuple(addresses)

    def resolve(self, host: str, port: int) -> tuple[str, ...]:
        if host not in self._records:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: no such name (test resolver)")
        return tuple(sorted(set(self._records[host])))


class FileResolver:
    """A JSON object {name: ["HOST:PORT", ...]} in a file, read at every resolution (tests that
    start processes rewrite it to make pods join and leave). A name missing from it raises."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def resolve(self, host: str, port: int) -> tuple[str, ...]:
        try:
            records = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise socket.gaierror(socket.EAI_AGAIN, f"{self.path}: {e}") from e
        if host not in records:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: not in {self.path}")
        return tuple(sorted(set(records[host])))


def default_resolver() -> Resolver:
    path = os.environ.get(RESOLVER_FILE_ENV)
    return FileResolver(path) if path else DnsResolver()


@dataclass(frozen=True)
class Change:
    """What one refresh found: the addresses that came and went, and all of them now (static first)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    current: tuple[str, ...]


class Membership:
    """The current addresses of a list of targets. Not thread-safe: one owner (an event loop) calls refresh."""

    def __init__(self, entries: str | Iterable[str], resolver: Resolver | None = None) -> None:
        self.targets = parse_targets(entries)
        self.resolver = resolver if resolver is not None else default_resolver()
        self.static: tuple[str, ...] = tuple(t.text for t in self.targets if not t.dynamic)
        self._dynamic = tuple(t for t in self.targets if t.dynamic)
        self._resolved: dict[Target, tuple[str, ...]] = {t: () for t in self._dynamic}
        self._failing: set[Target] = set()
        self.current: tuple[str, ...] = self.static

    @property
    def dynamic(self) -> bool:
        return bool(self._dynamic)

    async def refresh(self) -> Change | None:
        """Resolve every dns: target again; None when the address set did not change."""
        if not self._dynamic:
            return None
        answers = await asyncio.gather(*(asyncio.to_thread(self.resolver.resolve, t.host, t.port)
                                         for t in self._dynamic), return_exceptions=True)
        for target, answer in zip(self._dynamic, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, OSError):
                    raise answer
                if target not in self._failing:
                    logger.warning("discovery: %s does not resolve (%s); keeping its last %d address(es)",
                                   target.text, answer, len(self._resolved[target]))
                    self._failing.add(target)
                continue
            if target in self._failing:
                logger.info("discovery: %s resolves again", target.text)
                self._failing.discard(target)
            self._resolved[target] = answer
        seen = set(self.static)
        current = list(self.static)
        for target in self._dynamic:
            for address in self._resolved[target]:
                if address not in seen:
                    seen.add(address)
                    current.append(address)
        before = set(self.current)
        if set(current) == before:
            return None
        change = Change(added=tuple(a for a in current if a not in before),
                        removed=tuple(a for a in self.current if a not in seen), current=tuple(current))
        self.current = change.current
        logger.info("discovery: %s now %d address(es): +%s -%s", ",".join(t.text for t in self._dynamic),
                    len(current), list(change.added), list(change.removed))
        return change
