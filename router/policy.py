"""How the router picks a decode node for a request (R3): `--routing least-loaded` (default) or `prefix`.

- least-loaded: the healthy node with the least outstanding work (then fewest requests in flight,
  then round-robin).
- prefix: the node most likely to hold the request's prompt prefix in its prefix cache, judged from
  what the router itself has sent (a `PrefixIndex` of chained block hashes), among the nodes whose
  load is under a cap (least + max(slack, ratio x least)); with no match, least-loaded. The router
  has no tokenizer: text prompts (and chat messages, role and content in order) are cut into blocks
  of `block_chars` characters, token-id prompts into blocks of `block_tokens` ids.

A policy sees `Candidate`s (address, load, rank), never the nodes themselves, and returns a `Route`.
Runs on the router's event loop; not thread-safe.

    routing = RoutingConfig(policy="prefix")
    policy = make_policy(routing)
    route = policy.choose(request, candidates)   # then policy.sent(route) once forwarded
"""

from __future__ import annotations

import abc
import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.serving.convert import Prompt
from pdserve.serving.prefix_index import (
    REASON_LEAST_LOADED,
    Candidate,
    LoadCap,
    PrefixIndex,
    chain_hashes,
    choose,
    text_blocks,
    token_blocks,
)
from pdserve_api.v1 import generate_pb2

POLICIES = ("least-loaded", "prefix")


@dataclass(frozen=True)
class RoutingConfig:
    """policy: "least-loaded" or "prefix". The rest tunes the prefix policy:
    block_chars / block_tokens: block size for text and token-id prompts (the engine's page is 16
        tokens by default, about 64 characters of English);
    max_blocks: leading blocks hashed per request (longer prompts are judged by their first blocks);
    load_slack_tokens / load_ratio: the load cap, least + max(slack, ratio x least) outstanding tokens;
    index_capacity: block hashes remembered (least recently sent dropped first).
    """

    policy: str = "least-loaded"
    block_chars: int = 64
    block_tokens: int = 16
    max_blocks: int = 128
    load_slack_tokens: int = 1024
    load_ratio: float = 0.5
    index_capacity: int = 1 << 16

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("block_chars", "block_tokens", "max_blocks", "index_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"routing {name} must be >= 1, got {getattr(self, name)}")
        LoadCap(self.load_slack_tokens, self.load_ratio)  # validates both

    @property
    def load_cap(self) -> LoadCap:
        return LoadCap(self.load_slack_tokens, self.load_ratio)


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """The router's routing flags; `routing_from_args` turns them into a RoutingConfig."""
    g = p.add_argument_group("routing")
    g.add_argument("--routing", default="least-loaded", choices=POLICIES,
                   help="decode node selection: least outstanding work, or prefix-aware with a load cap "
                        "(default: least-loaded)")
    g.add_argument("--prefix-block-chars", type=int, default=RoutingConfig.block_chars, metavar="N",
                   help="prefix routing: characters per hashed block of a text prompt")
    g.add_argument("--prefix-load-slack", type=int, default=RoutingConfig.load_slack_tokens, metavar="TOKENS",
                   help="prefix routing: a node holding the prefix may carry this many outstanding tokens "
                        "more than the least loaded node (or --prefix-load-ratio times its load, if more)")
    g.add_argument("--prefix-load-ratio", type=float, default=RoutingConfig.load_ratio, metavar="R",
                   help="prefix routing: see --prefix-load-slack")


def routing_from_args(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(policy=args.routing, block_chars=args.prefix_block_chars,
                         load_slack_tokens=args.prefix_load_slack, load_ratio=args.prefix_load_ratio)


def prompt_hashes(request: generate_pb2.GenerateRequest, config: RoutingConfig) -> tuple[int, ...]:
    """Chained hashes of the prompt's leading complete blocks, as far as the router can see them."""
    p = Prompt.from_pb(request) if request.WhichOneof("prompt") else Prompt(text="")
    if p.token_ids is not None:
        return chain_hashes(token_blocks(p.token_ids, config.block_tokens, config.max_blocks))
    if p.messages is not None:
        # Role and content of each turn, separated so that ("ab", "c") and ("a", "bc") differ.
        text = "".join(f"\x1e{m.role}\x1f{m.content}" for m in p.messages)
    else:
        text = p.text or ""
    return chain_hashes(text_blocks(text, config.block_chars, config.max_blocks))


@dataclass(frozen=True)
class Route:
    """Where a request goes and why (reason: least_loaded, prefix or load_cap), with its prompt's
    block hashes (empty under least-loaded) so that `sent` can record them."""

    address: str
    reason: str
    matched_blocks: int = 0
    hashes: tuple[int, ...] = ()


class RoutingPolicy(abc.ABC):
    """Chooses among candidates (never empty, healthy, in round-robin rank order)."""

    name: str

    @abc.abstractmethod
    def choose(self, request: generate_pb2.GenerateRequest, candidates: Sequence[Candidate]) -> Route:
        """Where `request` should go."""

    def sent(self, route: Route) -> None:  # noqa: B027 - optional hook: a stateless policy keeps the no-op
        """The request was forwarded along `route`."""

    def forget(self, address: str) -> None:  # noqa: B027 - optional hook, as sent
        """The node at `address` left the rotation: whatever it held may be gone."""


class LeastLoadedPolicy(RoutingPolicy):
    name = "least-loaded"

    def choose(self, request: generate_pb2.GenerateRequest, candidates: Sequence[Candidate]) -> Route:
        if not candidates:
            raise ValueError("choose needs at least one candidate")
        best = min(candidates, key=lambda c: (c.load, c.rank))
        return Route(best.key, REASON_LEAST_LOADED)


class PrefixPolicy(RoutingPolicy):
    name = "prefix"

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.index = PrefixIndex(config.index_capacity)
        self._cap = config.load_cap

    def choose(self, request: generate_pb2.GenerateRequest, candidates: Sequence[Candidate]) -> Route:
        hashes = prompt_hashes(request, self.config)
        choice = choose(candidates, self.index.matches(hashes), self._cap)
        return Route(choice.key, choice.reason, choice.matched_blocks, hashes)

    def sent(self, route: Route) -> None:
        self.index.record(route.hashes, route.address)

    def forget(self, address: str) -> None:
        self.index.forget(address)


def make_policy(config: RoutingConfig) -> RoutingPolicy:
    if config.policy == "prefix":
        return PrefixPolicy(config)
    return LeastLoadedPolicy()
