"""A point-in-time snapshot of one engine's counters, for the servers to export (R5).

The engine thread owns every counter; `Engine.metrics()` copies them into this frozen dataclass so
that a server thread can read a consistent snapshot without touching engine state. Counters are
monotonic since the engine started; gauges describe the moment of the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineMetrics:
    # gauges
    num_running: int                 # requests in the running set (prefilling or decoding)
    num_waiting: int                 # requests queued for admission (incl. soft-reset ones)
    num_waiting_for_kv: int          # admitted, their prompt KV is arriving from elsewhere
    num_offloaded: int               # requests whose KV sits in the CPU swap pool
    total_blocks: int                # usable blocks of the pool (padding blocks excluded)
    free_blocks: int                 # blocks never used or evicted: handed out first
    cached_blocks: int               # freed blocks that keep content for the prefix cache
    kv_cache_usage: float            # used / total, in [0, 1]
    # counters (monotonic)
    prefix_cache_queries: int        # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int           # of those, tokens whose KV was reused
    num_offloads: int                # requests moved to the CPU swap pool
    num_soft_resets: int             # requests preempted by freeing their blocks (recompute later)
    num_prompt_tokens_computed: int  # prompt tokens run through forward passes
    num_generated_tokens: int        # tokens sampled
    num_steps: int                   # forward passes
    # the pass that sampled each request's first output (on a decode node: its first step after
    # the transfer) and the tokens it emitted: 1 each without speculation, more when drafts from
    # the hidden state the prefill node shipped (D17) were accepted at once
    num_first_steps: int = 0
    num_first_step_tokens: int = 0
    # rows of a draft head's history a decode node wrote from context records (the hidden states of
    # the prompt's last positions a prefill node handed over, EngineConfig.context_history_rows)
    spec_handoff_history_rows: int = 0
    # speculative decoding (E20), vLLM's meaning: a "draft" is one verified proposal of one sequence
    # in one step (0 proposed tokens is no draft); accepted tokens exclude the bonus token
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0             # proposed tokens verified
    spec_num_accepted_tokens: int = 0          # of those, accepted
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: drafts whose token at position i was accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens; 0 before any lookup."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is now, for routing (NodeInfo.load): read on the engine thread."""

    num_unfinished: int              # requests the engine holds (any state but finished)
    num_waiting: int                 # queued for admission, plus admitted and waiting for KV
    num_running: int
    prompt_tokens_left: int          # tokens still to compute before each request samples (or ends)
    output_tokens_left: int          # tokens still to generate, at each request's max_tokens (or context)
    free_blocks: int                 # blocks a new request can take now (empty + evictable cached)
    total_blocks: int


@dataclass(frozen=True)
class EngineInfo:
    """What the engine serves, fixed once it is built (NodeInfo, request validation)."""

    model_name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_model_len: int
    num_blocks: int                  # usable blocks of the pool
