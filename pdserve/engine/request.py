"""Request state as the engine tracks it (E1).

A request's life: PENDING -> PREFILLING -> DECODING -> FINISHED. A decode node adds
WAITING_FOR_KV between admission and the first decode step (its prompt KV arrives over the
fabric), and the scheduler never schedules a request in that state (D4).

Progress is one number, `num_computed_tokens`: how many of `all_token_ids` have their KV in the
cache. A step feeds tokens [num_computed_tokens, num_computed_tokens + n); when that reaches the
end of the known tokens, the step samples the next token. Prefill and decode are the same
arithmetic; a prefill chunk is simply a step that stops short of the end.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdserve.engine.sampling.sampler import token_seed
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    # the leaf module; only for the annotation: importing the cache package at runtime from here
    # would run its __init__, whose manager imports this module
    from pdserve.engine.cache.block_hash import BlockHash


class RequestStatus(enum.Enum):
    PENDING = "pending"
    WAITING_FOR_KV = "waiting_for_kv"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class TransferRole(enum.Enum):
    """What a request is to a KV transfer: one role per request, fixed at add_request (a decode
    node's REMOTE_PREFILL becomes LOCAL when its prompt is computed here after all, S3)."""

    LOCAL = "local"                      # computed and sampled here (colocated nodes, offline use)
    # Prefill nodes: compute the KV of every given token and sample nothing (the decode node sends
    # the prompt minus its last token, D17). With a PrefillConnector attached, its pages are held
    # when it finishes, until the connector releases them (a transfer may still read them, D11).
    PREFILL = "prefill"
    # Decode nodes: the prompt's KV (all tokens but the last) arrives over the fabric into pages
    # allocated at admission; the request waits in WAITING_FOR_KV until the connector's KvLanded.
    REMOTE_PREFILL = "remote_prefill"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the context limit
    ABORT = "abort"      # cancelled by the client or the server
    ERROR = "error"      # failed (the error text travels with the output)
    PREFILLED = "prefilled"  # prefill-only request: KV computed, nothing sampled


@dataclass(eq=False)
class Request:
    """One sequence inside the engine. Prints lengths, never tokens (prompts stay out of logs)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (model context)
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    role: TransferRole = TransferRole.LOCAL

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0   # soft resets (E14)
    num_offloads: int = 0      # moves of its KV to the CPU swap pool (E15)
    # Prefix cache (E12), set at each admission: the leading prompt tokens whose KV was found in
    # shared blocks, so computing starts there (a multiple of page_size).
    num_prefix_hit_tokens: int = 0
    # Usage (RequestOutput.num_cached_tokens): the prefix hit of the FIRST admission, kept across
    # soft resets (as vLLM counts it). None until admitted; None for a remote-prefill request.
    num_reused_tokens: int | None = None
    # When the scheduler first gave it pages (time.monotonic()); None while it waits.
    first_scheduled_time: float | None = None
    # Chained hashes of its complete blocks, extended on demand (prefix_cache.request_block_hashes).
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.sampling.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    def sample_generator(self) -> torch.Generator | None:
        """The generator of this request's next sampled token (None: unseeded, the engine's own).

        A seeded request's generator is reseeded for every token from (seed, the token's number in
        the stream: rng_skip_tokens + tokens output so far), so a token's draw never depends on the
        draws before it (exact resume, S10; pdserve.engine.sampling.sampler)."""
        if self.generator is not None and self.sampling.seed is not None:
            index = self.sampling.rng_skip_tokens + len(self.output_token_ids)
            self.generator.manual_seed(token_seed(self.sampling.seed, index))
        return self.generator

    @property
    def prefill_only(self) -> bool:
        """TransferRole.PREFILL: computes its given tokens' KV and never samples."""
        return self.role is TransferRole.PREFILL

    @property
    def remote_prefill(self) -> bool:
        """TransferRole.REMOTE_PREFILL: its prompt's KV arrives from a prefill node."""
        return self.role is TransferRole.REMOTE_PREFILL

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def target_computed_tokens(self) -> int:
        """How many tokens must be in the cache before this request samples (or ends, prefill-only)."""
        if self.prefill_only:
            return self.num_prompt_tokens
        return self.num_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to feed before the next sample (1 while decoding)."""
        return self.target_computed_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_remaining_tokens > 1 or (self.prefill_only and self.num_remaining_tokens > 0)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, prompt_len={len(self.prompt_token_ids)}, "
            f"output_len={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
