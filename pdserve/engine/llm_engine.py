"""The engine every pdserve node runs: one step = schedule -> run -> update.

    sched = scheduler.schedule(drafts)    # which tokens of which requests (E2-E6, E10, E11)
    out = runner.execute(sched)           # one forward pass over all of them
    return self._update(sched, out)       # sample, append, detokenize, stop, free

Speculative decoding (E20, pdserve.engine.spec_decode): with a speculator, `drafts` are the
proposals for the sequences that decode; the scheduler grants each a prefix of its draft from
what the step has left; a drafting model fills its granted slots (`Speculator.fill`); the pass
verifies them as extra query tokens of their sequence, and `_verify` emits the accepted drafts
plus the next sample, then truncates the pages past what the request keeps.

Memory (issue 4): the cache manager keeps one block table per attention group (E8) and the prefix
cache (E12, E13); `_update` publishes newly complete blocks after each pass. Around the three
calls, the `Preemptor` brings offloaded requests back before scheduling and, when the scheduler
reports stalled requests, offloads or soft-resets others after the pass (E14, E15); when nothing
could be scheduled at all it does so at once and the step schedules again.

A KV transfer plugs in through one connector (pdserve.engine.kv_connector), given at
construction: a PrefillConnector sees each pass before it runs (D6), each finished layer (D7) and
each finished prefill's hidden state and logits (D12); a DecodeConnector learns which requests
wait for KV in which pages (D3). The engine owns its KV memory (an anonymous mapping on
transparent huge pages on the CPU, pdserve.engine.cache.hostmem) and hands the connector the pool
once it exists (`register_kv_cache`).

Threading: an engine is driven by one thread (the caller of `step`); `EngineThread` runs that
thread for servers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.cache.block_pool import BlockPool, CacheIntegrityError
from pdserve.engine.cache.groups import PADDING_BLOCK, attention_groups, max_blocks_per_request
from pdserve.engine.cache.kv_cache import KVCacheShape, PagedKVCache
from pdserve.engine.cache.manager import KVCacheManager
from pdserve.engine.cache.swap import SwapSpace
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import (
    AttentionGroupSpec,
    DecodeConnector,
    KvCacheSpec,
    KvConnector,
    KvWait,
    PrefillConnector,
    PrefillDone,
)
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request import FinishReason, Request, RequestStatus
from pdserve.engine.runner import (
    ModelOutput,
    ModelRunner,
    start_tensor_parallel,
    tensor_parallel_plan,
    tp_shard_pools,
)
from pdserve.engine.sampling.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling.sampler import SampleLogprobs, Sampler, compute_logprobs, filtered_probs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput, make_scheduler
from pdserve.engine.scheduler.preemption import Preemptor
from pdserve.engine.sizing import (
    MemoryBudget,
    activation_bytes,
    available_memory_bytes,
    fit_max_model_len,
    module_nbytes,
    size_pool,
)
from pdserve.engine.spec_decode.rejection import seeded_generators
from pdserve.engine.spec_decode.speculator import Verdict, make_speculator
from pdserve.engine.stats import EngineInfo, EngineLoad, EngineMetrics
from pdserve.kernels.attention import get_backend
from pdserve.model.arch import ModelArch
from pdserve.model.loader import (
    ModelSource,
    iter_weights,
    load_config,
    load_generation_eos,
    load_tokenizer,
    resolve_model,
)
from pdserve.model.registry import build_model

logger = logging.getLogger(__name__)

QUARANTINE_PREFIX = "\x00quarantine:"   # cache tables of quarantined pages (no request id starts so)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[SampleLogprobs]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, kv_connector: KvConnector | None = None) -> None:
        """Load the model and build the KV pool; `kv_connector` (a PrefillConnector or a
        DecodeConnector) is handed the pool before this returns (its ValueError propagates)."""
        self.config = config = config or EngineConfig()
        if kv_connector is not None and not isinstance(kv_connector, (PrefillConnector, DecodeConnector)):
            raise TypeError(f"kv_connector must be a PrefillConnector or a DecodeConnector, "
                            f"got {type(kv_connector).__name__}")
        self._prefill_conn = kv_connector if isinstance(kv_connector, PrefillConnector) else None
        self._decode_conn = kv_connector if isinstance(kv_connector, DecodeConnector) else None
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.source: ModelSource = resolve_model(config.model)
        hf_config = load_config(self.source)
        self.arch = ModelArch.from_hf_config(hf_config)
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = frozenset(load_generation_eos(self.source))
        model_max = self.arch.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        # One block table per attention kind (E8): ("full",), ("sliding",) or both for hybrids.
        groups = attention_groups(self.arch.layer_types, self.arch.sliding_window)
        dtype = config.torch_dtype
        device = torch.device("cpu")
        available = available_memory_bytes(device) if config.cache.num_blocks is None else None
        # Tensor parallelism (E22): the split, refused here when it cannot be made; rank 0's shard is ours.
        self.tp_plan = tensor_parallel_plan(config.tensor_parallel_size, self.arch)
        self.model = build_model(self.arch, hf_config, dtype, self.max_model_len,
                                 small_batch_max_tokens=config.small_batch_max_tokens,
                                 shard=self.tp_plan.ranks[0] if self.tp_plan else None,
                                 tp_invariant=config.tp_invariant_active)
        logger.info("row-parallel sums: %s (tp_invariant=%s, tensor_parallel_size=%d)",
                    "TP-invariant fold blocks" if config.tp_invariant_active else "plain (one block per rank)",
                    "auto" if config.tp_invariant is None else config.tp_invariant, config.tensor_parallel_size)
        logger.info("layer loop: C ops bound to the weights for passes of at most %d float32 tokens "
                    "(small_batch_max_tokens; 0: never), where the model has them", config.small_batch_max_tokens)
        self.model.load_weights(iter_weights(self.source))
        self.model.eval()

        P = config.cache.page_size
        sched = config.scheduler
        probe = KVCacheShape(self.arch.num_layers, 1, self.arch.num_kv_heads, P, self.arch.head_dim)
        kv_dtype = config.kv_torch_dtype   # the model's dtype, or bfloat16 K/V under a float32 model
        block_nbytes = probe.block_nbytes(kv_dtype)
        per_request = max_blocks_per_request(groups, P, self.max_model_len, sched.max_batch_tokens)
        budget = None
        if available is not None:
            budget = MemoryBudget(available=available, weights=module_nbytes(self.model),
                                  activations=self._activation_bytes(dtype))
        size = size_pool(config.cache, block_nbytes, sched.max_requests_per_batch * per_request, budget)
        self.max_model_len = fit_max_model_len(groups, P, size.num_blocks - config.cache.num_padding_blocks,
                                               self.max_model_len, config.max_model_len is not None,
                                               sched.max_batch_tokens)
        sharing = config.cache.allow_block_sharing and all(g.sliding_window is None for g in groups)
        kv_heads = len(self.tp_plan.ranks[0].kv_heads) if self.tp_plan else self.arch.num_kv_heads
        self.kv_cache = PagedKVCache(KVCacheShape(self.arch.num_layers, size.num_blocks, kv_heads, P,
                                                  self.arch.head_dim), kv_dtype, prefault=config.cache.kv_prefault)
        self.tp = None if self.tp_plan is None else start_tensor_parallel(
            self.tp_plan, self.model, self.kv_cache, str(self.source.path), config.dtype, self.max_model_len,
            config.small_batch_max_tokens, config.attention_backend, config.cache.kv_prefault,
            config.tp_invariant_active)
        self.pool = BlockPool(size.num_blocks, config.cache.num_padding_blocks)
        self.cache_manager = KVCacheManager(self.pool, P, groups, enable_prefix_caching=sharing)
        # no CPU swap under TP (it would move rank 0's shard only): stalled requests are recomputed
        swap_slots = config.cache.swap_slots(size.num_blocks, block_nbytes) if self.tp is None else 0
        self.swap = SwapSpace(self.kv_cache, self.cache_manager, swap_slots) if swap_slots > 0 else None
        logger.info("KV cache: %d blocks of %d tokens (%s, %.2f MiB each, %.2f GiB total; %s), groups %s, "
                    "prefix cache %s%s, swap pool %d blocks (%.2f GiB), max_model_len %d",
                    size.num_blocks, P, str(kv_dtype).removeprefix("torch."), block_nbytes / 2**20,
                    size.num_blocks * block_nbytes / 2**30, size.reason,
                    self.cache_manager.group_names, "on" if sharing else "off",
                    "" if sharing or not config.cache.allow_block_sharing else " (sliding-window layers)",
                    swap_slots, swap_slots * block_nbytes / 2**30, self.max_model_len)
        self.scheduler = make_scheduler(config.scheduler, self.cache_manager)
        if kv_connector is not None:
            kv_connector.register_kv_cache(self._kv_cache_spec(groups))
        self.preemptor = Preemptor(self.scheduler, self.cache_manager, self.swap)
        self.runner = ModelRunner(self.model, self.kv_cache, self.cache_manager, get_backend(config.attention_backend),
                                  tp=self.tp)
        self.speculator = make_speculator(config.speculative_config, self.runner, self.tokenizer, self.max_model_len,
                                          dtype, config.small_batch_max_tokens, sched.max_batch_tokens,
                                          str(self.source.path))
        own = self.speculator.proposer.own_pool() if self.speculator is not None else None
        if own is not None and self.swap is not None:
            self.swap.attach(own)   # a draft model's pages are offloaded and restored with the target's
            self.speculator.proposer.carry_offloads()
        self.sampler = Sampler()
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        # a prefill node's last hidden states per prefill-only request (_keep_tails): rid -> (position of row 0, [n, H])
        self._history_rows = config.context_history_rows
        self._tails: dict[str, tuple[int, torch.Tensor]] = {}
        self._hold_on_finish: set[str] = set()
        self._held: dict[str, Request] = {}  # finished, blocks kept until release_blocks
        # Pages of abandoned transfers that a write may still land in (S5), by quarantine id:
        # owned by no request, reused by nobody, until release_quarantine. Their tables live in
        # the cache under QUARANTINE_PREFIX + id, so the pool's own balance check counts them.
        self._quarantine: dict[str, int] = {}   # quarantine id -> blocks
        self.num_quarantined_blocks = 0
        self._ids = itertools.count()
        # The load as of the last scheduled pass (or `load()` call by the driving thread): a frozen
        # snapshot other threads may read at any time (EngineThread.last_load).
        self.last_load: EngineLoad | None = None
        self.num_steps = 0
        self.num_forward_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_first_steps = 0          # passes that sampled a request's first output token(s)
        self.num_first_step_tokens = 0    # tokens those passes emitted (> 1 each: drafts accepted)
        self.num_handoff_history_rows = 0  # head history rows written from context records (kv_ready)

    def _kv_cache_spec(self, groups) -> KvCacheSpec:
        layer_types = tuple(self.arch.layer_types)
        specs = []
        for g in groups:
            kind = "full_attention" if g.sliding_window is None else "sliding_attention"
            specs.append(AttentionGroupSpec(g.name, tuple(i for i, t in enumerate(layer_types) if t == kind),
                                            g.sliding_window))
        return KvCacheSpec(buffer=self.kv_cache.buffer, shape=self.kv_cache.shape, dtype=self.kv_cache.dtype,
                           groups=tuple(specs), hidden_size=self.arch.hidden_size, model_name=self.source.name,
                           shards=tp_shard_pools(self.tp, self.kv_cache),
                           context_history_rows=self.config.context_history_rows)

    def _activation_bytes(self, dtype: torch.dtype) -> int:
        a, s = self.arch, self.config.scheduler
        return activation_bytes(
            hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, vocab_size=a.vocab_size,
            max_batch_tokens=s.max_batch_tokens, max_requests_per_batch=s.max_requests_per_batch,
            max_model_len=self.max_model_len, dtype=dtype,
        )

    # --- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        ids = list(prompt)
        vocab = self.arch.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        remote_prefill: bool = False,
        hold_blocks: bool = False,
    ) -> Request:
        """Validate and queue a request; raises ValueError (nothing queued) for bad input.

        prefill_only: compute the KV of every given token and sample nothing (prefill nodes: the
            decode node sends the prompt minus its last token, D17).
        remote_prefill: the prompt's KV arrives from elsewhere (decode nodes): admission allocates
            its pages and parks it in WAITING_FOR_KV until `kv_ready` (or `kv_abandoned`).
        hold_blocks: when the request finishes or is aborted, keep its blocks until
            `release_blocks` (a transfer may still read from them, D11).
        """
        if prefill_only and remote_prefill:
            raise ValueError("a request cannot be both prefill_only and remote_prefill")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the model's context is {self.max_model_len} tokens "
                f"(at least one must be left to generate)"
            )
        need = self.cache_manager.max_blocks_per_request(len(ids) + 1, self.config.scheduler.max_batch_tokens)
        if need > self.pool.num_usable_blocks:
            raise ValueError(
                f"prompt of {len(ids)} tokens needs {need} KV blocks but the cache has only "
                f"{self.pool.num_usable_blocks}"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=params,
            max_total_tokens=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            prefill_only=prefill_only,
            remote_prefill=remote_prefill,
        )
        if hold_blocks:
            self._hold_on_finish.add(request_id)
        self._tracked[request_id] = _Tracked(request, IncrementalDetokenizer(self.tokenizer, ids, params), [])
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a request now (ABORT, or ERROR when `error` is given); None if it is not running."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        reason = FinishReason.ERROR if error is not None else FinishReason.ABORT
        return self._finish(tracked, reason, new_ids=(), delta="", error=error)

    def kv_ready(self, request_id: str, context_hidden: torch.Tensor | None = None,
                 context_history: torch.Tensor | None = None) -> None:
        """All of a remote-prefill request's KV writes have landed: schedule its first decode.

        From now on its complete prompt blocks are valid, so they join the prefix cache.
        context_hidden: the prefill node's final-norm hidden state of the position before the
        last prompt token ([hidden], D12/D17): a draft head starts from it, so the first decode
        step already verifies drafts. context_history: [n, hidden] the states of the n positions
        before that one (EngineConfig.context_history_rows), from which a draft head writes its
        history rows for the end of the prompt."""
        request = self._tracked[request_id].request
        self.scheduler.kv_ready(request)
        self.cache_manager.commit(request)
        if context_hidden is not None and self.speculator is not None and self.speculator.uses_hidden:
            position = request.num_computed_tokens - 1
            if context_history is not None and context_history.shape[0] and self.speculator.wants_all_hidden:
                self.speculator.seed_history(request, context_history, position)
                self.num_handoff_history_rows += context_history.shape[0]
            self.speculator.note(request, context_hidden, position)

    def kv_abandoned(self, request_id: str, prefill_locally: bool, error: str) -> RequestOutput | None:
        """The remote prefill of a request waiting for its KV failed (S3, S5).

        prefill_locally: no write can land any more; compute the prompt here in the pages already
        held. Otherwise the request ends with `error` and its pages stay held (a write may still
        land in them): the owner frees them with `release_blocks` once none can, or moves them to
        quarantine (`quarantine_blocks`).
        """
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        if prefill_locally:
            logger.warning("request %s: remote prefill abandoned (%s); prefilling locally", request_id, error)
            self.scheduler.prefill_locally(tracked.request)
            return None
        return self._finish(tracked, FinishReason.ERROR, new_ids=(), delta="", error=error, keep_blocks=True)

    def kv_retry(self, request_id: str, prefill_locally: bool = False) -> bool:
        """A request waiting for its KV, whose pages were moved to quarantine (or that never had
        a write in flight), goes back to the head of the waiting queue, to be admitted again into
        fresh pages: remote (a new KvWait, so a new ticket) or, prefill_locally, computed here.
        Pages it still holds are freed (the caller vouches that no write can land in them).
        False if the request is not waiting for KV."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.request.status is not RequestStatus.WAITING_FOR_KV:
            return False
        r = tracked.request
        self.scheduler.detach(r)
        self.cache_manager.free(r)
        r.num_computed_tokens = 0
        r.remote_prefill = not prefill_locally
        r.status = RequestStatus.PENDING
        self.scheduler.waiting.appendleft(r)
        return True

    def quarantine_blocks(self, request_id: str, quarantine_id: str) -> int:
        """Move the pages of `request_id` (waiting for KV, or finished and held) out of it into
        quarantine under `quarantine_id`: nobody owns or reuses them until `release_quarantine`.
        The request keeps running without pages (`kv_retry`) or is forgotten (held). Returns the
        number of blocks moved."""
        if quarantine_id in self._quarantine:
            raise ValueError(f"quarantine id {quarantine_id!r} is in use")
        held = self._held.pop(request_id, None)
        tracked = self._tracked.get(request_id)
        if held is None and (tracked is None or tracked.request.status is not RequestStatus.WAITING_FOR_KV):
            raise KeyError(f"request {request_id!r} neither waits for KV nor holds blocks")
        qkey = QUARANTINE_PREFIX + quarantine_id
        n = 0
        for g in self.cache_manager.groups:
            table = g.tables.pop(request_id, [])
            n += sum(1 for b in table if b != PADDING_BLOCK)
            g.replace(qkey, table)
        self._quarantine[quarantine_id] = n
        self.num_quarantined_blocks += n
        return n

    def release_quarantine(self, quarantine_id: str) -> int:
        """No write can land in the quarantined pages any more: free them. Returns how many."""
        n = self._quarantine.pop(quarantine_id, None)
        if n is None:
            raise KeyError(f"no quarantine {quarantine_id!r}")
        qkey = QUARANTINE_PREFIX + quarantine_id
        for g in self.cache_manager.groups:
            self.pool.free(g.pop(qkey))
        self.num_quarantined_blocks -= n
        return n

    @property
    def num_quarantines(self) -> int:
        return len(self._quarantine)

    def release_blocks(self, request_id: str) -> int:
        """Free the blocks a finished request kept (hold_blocks, or aborted while waiting for KV)."""
        request = self._held.pop(request_id, None)
        if request is None:
            raise KeyError(f"request {request_id!r} holds no blocks")
        return self.cache_manager.free(request)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        tracked = self._tracked.get(request_id)
        return tracked.request if tracked is not None else None

    def unfinished_requests(self) -> list[Request]:
        return [t.request for t in self._tracked.values()]

    def is_held(self, request_id: str) -> bool:
        """True while a finished request's blocks wait for release_blocks."""
        return request_id in self._held

    def block_table(self, request_id: str) -> list[int]:
        return list(self.cache_manager.block_table(request_id))

    def _group_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Every attention group's table of a request, in KvCacheSpec.groups order."""
        m = self.cache_manager
        return tuple(tuple(m.block_table(request_id, g)) for g in m.group_names)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def has_schedulable_work(self) -> bool:
        """True when step() can make progress (requests waiting for KV cannot)."""
        return self.scheduler.has_work()

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.preemptor.restore()
        drafts = self._drafts()
        sched = self.scheduler.schedule(drafts)
        kv_waits = list(sched.kv_waits)
        if sched.is_empty and sched.stalled and not self.preemptor.relieve(sched.stalled).is_empty:
            sched = self.scheduler.schedule(drafts)  # nothing could run: make room and retry in this step (E15)
            kv_waits += sched.kv_waits
        if self._decode_conn is not None:
            for r in kv_waits:
                self._decode_conn.on_kv_wait(KvWait(r.request_id, tuple(r.prompt_token_ids),
                                                    tuple(self.block_table(r.request_id)),
                                                    self._group_tables(r.request_id)))
        if sched.is_empty:
            return self._stalled()
        began = time.perf_counter()
        if self.speculator is not None:
            sched = self.speculator.fill(sched)   # a draft model drafts into its granted slots
        self.last_load = self.load()   # what runs now holds its pages: routing reads this during the pass
        conn = self._prefill_conn
        if conn is not None:
            conn.on_schedule(sched, {c.request_id: self._group_tables(c.request_id) for c in sched.chunks})
        heads = self.speculator is not None and self.speculator.wants_all_hidden
        tails = self._history_rows > 0 and conn is not None and any(c.request.prefill_only for c in sched.chunks)
        out = self.runner.execute(sched, conn.on_layer_done if conn is not None else None, all_hidden=heads or tails)
        if heads:   # a draft head writes its rows for what the pass computed (before the verdicts)
            self.speculator.after_pass(sched.chunks, out.all_hidden)
        if tails:
            self._keep_tails(sched.chunks, out.all_hidden)
        # what speculation's control weighs drafts against: passes of decodes and verifications
        # only (a prefill chunk's tokens cost on another slope: compute-bound, and its attention)
        if self.speculator is not None and all(c.samples and c.num_known == 1 for c in sched.chunks):
            self.speculator.observe(sched.num_batched_tokens, time.perf_counter() - began)
        results = self._update(sched, out)
        if sched.stalled:
            self.preemptor.relieve(sched.stalled)  # they run next step
        return results

    def _drafts(self) -> dict[str, tuple[int, ...]] | None:
        """Speculative proposals (E20) for the running requests whose next pass decodes."""
        if self.speculator is None:
            return None
        return self.speculator.drafts([r for r in self.scheduler.running
                                       if not r.prefill_only and r.num_remaining_tokens == 1])

    def _update(self, sched: SchedulerOutput, out: ModelOutput) -> list[RequestOutput]:
        self.num_steps += 1
        self.num_forward_tokens += sched.num_batched_tokens
        self.num_prompt_tokens_computed += sum(
            max(0, min(c.end, c.request.num_prompt_tokens) - c.start) for c in sched.chunks)
        # chunks whose drafts were sampled from a draft distribution are verified by rejection
        # sampling (`_verify_sampled`); every other sampling row goes through the sampler at once
        sampling_chunks = [c for c in sched.chunks if c.samples and c.draft_probs is None]
        sampled = None
        if sampling_chunks:
            rows: list[int] = []
            params: list[SamplingParams] = []
            generators: list[torch.Generator] = []
            for c in sampling_chunks:
                first = out.chunk_rows[c.request_id]
                rows.extend(range(first, first + c.num_sample_rows))
                params.extend([c.request.sampling] * c.num_sample_rows)
                generators.extend(self._generators(c))
            # logits: [R, V]; a decode step samples every row in order: no 6 MB gather copy then
            logits = out.logits if rows == list(range(out.logits.shape[0])) else out.logits[torch.tensor(rows)]
            sampled = self.sampler.sample(logits, params, generators)
        results: list[RequestOutput] = []
        # the passes that sample a request's first output: on a decode node its first step after
        # the transfer, which emits more than one token when drafts from the shipped hidden state
        # (D17) are accepted
        firsts = [c.request for c in sched.chunks if c.samples and not c.request.prefill_only
                  and not c.request.output_token_ids]
        k = 0
        for c in sched.chunks:
            r = c.request
            tracked = self._tracked[r.request_id]
            if c.draft_probs is not None:
                results.append(self._verify_sampled(tracked, c, out))
                continue
            if c.draft_token_ids:
                n = c.num_sample_rows
                results.append(self._verify(tracked, c, sampled.token_ids[k:k + n], sampled.logprobs[k:k + n], out))
                k += n
                continue
            r.num_computed_tokens = c.end
            self.cache_manager.commit(r)  # its newly complete blocks join the prefix cache
            if r.prefill_only and c.end == r.target_computed_tokens:
                row = out.chunk_rows[r.request_id]
                if self._prefill_conn is not None:
                    hidden = self._tail_of(r, c.end) if self._history_rows else out.hidden[row]
                    self._prefill_conn.on_prefill_done(PrefillDone(r.request_id, tuple(self.block_table(r.request_id)),
                                                                   hidden, out.logits[row]))
                results.append(self._finish(tracked, FinishReason.PREFILLED, new_ids=(), delta=""))
                continue
            if not c.samples:
                continue
            token = sampled.token_ids[k]
            lp = sampled.logprobs[k]
            k += 1
            if self.speculator is not None and self.speculator.uses_hidden:
                self.speculator.note(r, out.hidden[out.chunk_rows[r.request_id]], c.end - 1)
            self.num_generated_tokens += 1
            done = self._append_token(tracked, token, lp)
            results.append(done)
            if not done.finished and self.speculator is not None and self.speculator.proposer.needs_slots:
                # a drafting model that filled none of its granted slots (Speculator.fill made the
                # chunk a plain decode): give back the lookahead pages, as a verification does
                self.cache_manager.truncate(r, r.num_tokens)
        self.num_first_steps += len(firsts)
        self.num_first_step_tokens += sum(len(r.output_token_ids) for r in firsts)
        return results

    def _keep_tails(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """A prefill node's context history (EngineConfig.context_history_rows): keep the last
        rows + 1 final-norm hidden states each prefill-only request computed. hidden: [T, H], the
        chunks' tokens in order."""
        keep = self._history_rows + 1
        q = 0
        for c in chunks:
            base, q = q, q + c.num_tokens
            r = c.request
            if not r.prefill_only:
                continue
            rows = hidden[max(base, q - keep):q].detach().clone()                     # [<= keep, H], to c.end
            start, held = self._tails.get(r.request_id, (c.start, rows[:0]))
            if start + held.shape[0] != c.start:      # not where the last chunk ended (a recompute)
                start, held = c.start, rows[:0]
            both = torch.cat((held, rows))[-keep:]
            self._tails[r.request_id] = (c.end - both.shape[0], both)

    def _tail_of(self, r: Request, end: int) -> torch.Tensor:
        """The kept states of positions .. end - 1 ([n, H], n <= rows + 1, at least that one)."""
        start, rows = self._tails.pop(r.request_id)
        if start + rows.shape[0] != end:
            raise RuntimeError(f"{r!r}: kept hidden states end at {start + rows.shape[0]}, its prefill at {end}")
        return rows

    def _generators(self, c: ScheduledChunk) -> list[torch.Generator]:
        """One generator per sampled row of a chunk. A seeded request's row j draws as its output
        token number (tokens so far + j) would in plain decoding (sampler.token_seed); unseeded
        rows share the engine's generator, drawn in row order."""
        r = c.request
        first = r.sample_generator() or self._default_generator
        if c.num_sample_rows == 1:
            return [first]
        if r.sampling.seed is None:
            return [first] * c.num_sample_rows
        base = r.sampling.rng_skip_tokens + len(r.output_token_ids)
        return [first] + seeded_generators(r.sampling.seed, base + 1, c.num_sample_rows - 1)

    def _verify_sampled(self, tracked: _Tracked, c: ScheduledChunk, out: ModelOutput) -> RequestOutput:
        """A verification of drafts the draft model sampled (E20): speculative rejection sampling
        of the target's filtered distributions at the chunk's rows against the draft's."""
        r = c.request
        first = out.chunk_rows[r.request_id]
        logits = out.logits[first:first + c.num_sample_rows]                  # [K+1, V]
        params = [r.sampling] * c.num_sample_rows
        target = filtered_probs(logits, params)                               # [K+1, V]
        gens = self._generators(c)
        verdict = self.speculator.verify_sampled(r.request_id, c.draft_token_ids, target, c.draft_probs, gens)
        n = len(verdict.token_ids)
        lps = compute_logprobs(logits[:n], params[:n], verdict.token_ids)
        return self._emit(tracked, c, verdict, lps, out)

    def _verify(self, tracked: _Tracked, c: ScheduledChunk, sampled: list[int],
                logprobs: list[SampleLogprobs | None], out: ModelOutput) -> RequestOutput:
        """A verification chunk (E20): emit the drafts the target's samples confirm plus the next
        sample, stopping where the request ends; then give back the pages past what it keeps."""
        verdict = self.speculator.verify(c.request_id, c.draft_token_ids, sampled)
        return self._emit(tracked, c, verdict, logprobs, out)

    def _emit(self, tracked: _Tracked, c: ScheduledChunk, verdict: Verdict,
              logprobs: Sequence[SampleLogprobs | None], model_out: ModelOutput) -> RequestOutput:
        r = c.request
        # KV of the known token is valid whatever the verdict: commit up to it first
        r.num_computed_tokens = c.start + c.num_known
        self.cache_manager.commit(r)
        out: RequestOutput | None = None
        new_ids: list[int] = []
        new_lps: list[SampleLogprobs] = []
        delta = ""
        for i, token in enumerate(verdict.token_ids):
            out = self._append_token(tracked, token, logprobs[i])
            self.num_generated_tokens += 1
            new_ids.extend(out.new_token_ids)
            new_lps.extend(out.new_logprobs)
            delta += out.delta_text
            if out.finished:
                break
        assert out is not None
        if not out.finished:
            # KV is valid through the accepted drafts; the rejected ones' slots are reused
            r.num_computed_tokens = c.start + c.num_known + verdict.num_accepted
            self.cache_manager.commit(r)
            self.cache_manager.truncate(r, r.num_tokens)
            if self.speculator.uses_hidden:   # the row its latest token was sampled from
                row = model_out.chunk_rows[r.request_id] + verdict.num_accepted
                self.speculator.note(r, model_out.hidden[row], r.num_computed_tokens - 1)
        return dataclasses.replace(out, new_token_ids=tuple(new_ids), delta_text=delta, new_logprobs=tuple(new_lps))

    def _append_token(self, tracked: _Tracked, token: int, lp: SampleLogprobs | None) -> RequestOutput:
        r = tracked.request
        r.output_token_ids.append(token)
        r.status = RequestStatus.DECODING
        if lp is not None:
            tracked.logprobs.append(lp)
        params = r.sampling
        reason: FinishReason | None = None
        delta = ""
        # A token that ends the request by its id (EOS, a stop token) is kept in token_ids but
        # not in the text, as the OpenAI-style APIs report it.
        if token in params.stop_token_ids:
            reason, r.stop_reason = FinishReason.STOP, token
        elif not params.ignore_eos and token in r.eos_token_ids:
            reason = FinishReason.STOP
        else:
            step = tracked.detok.push(token)
            delta = step.delta_text
            if step.stop_string is not None:
                reason, r.stop_reason = FinishReason.STOP, step.stop_string
            elif params.max_tokens is not None and len(r.output_token_ids) >= params.max_tokens:
                reason = FinishReason.LENGTH
            elif r.num_tokens >= r.max_total_tokens:
                reason = FinishReason.LENGTH
        new_lp = (lp,) if lp is not None else ()
        if reason is not None:
            return self._finish(tracked, reason, new_ids=(token,), delta=delta, new_logprobs=new_lp)
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=(token,),
            delta_text=delta,
            finished=False,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=len(r.output_token_ids),
            new_logprobs=new_lp,
            num_cached_tokens=r.num_reused_tokens or 0,
            first_scheduled_time=r.first_scheduled_time,
        )

    def _finish(
        self,
        tracked: _Tracked,
        reason: FinishReason,
        new_ids: tuple[int, ...],
        delta: str,
        new_logprobs: tuple[SampleLogprobs, ...] = (),
        error: str | None = None,
        keep_blocks: bool | None = None,
    ) -> RequestOutput:
        r = tracked.request
        # A request still waiting for its KV may have writes in flight into its pages (S5): its
        # blocks are kept until the owner has abandoned the transfer and calls release_blocks.
        if keep_blocks is None:
            keep_blocks = r.request_id in self._hold_on_finish or r.status is RequestStatus.WAITING_FOR_KV
        self._hold_on_finish.discard(r.request_id)
        if keep_blocks:
            self.scheduler.detach(r)
            self._held[r.request_id] = r
        else:
            self.scheduler.remove_request(r)
        self.preemptor.forget(r)
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        del self._tracked[r.request_id]
        self._tails.pop(r.request_id, None)
        delta += tracked.detok.finish()
        completion = CompletionOutput(
            text=tracked.detok.text,
            token_ids=tuple(r.output_token_ids),
            finish_reason=reason.value,
            logprobs=tuple(tracked.logprobs) if r.sampling.logprobs is not None else None,
            stop_reason=r.stop_reason,
        )
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=new_ids,
            delta_text=delta,
            finished=True,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=len(r.output_token_ids),
            new_logprobs=new_logprobs,
            completion=completion,
            error=error,
            num_cached_tokens=r.num_reused_tokens or 0,
            first_scheduled_time=r.first_scheduled_time,
        )

    def _stalled(self) -> list[RequestOutput]:
        """Nothing could be scheduled. If requests wait that can never fit, fail them explicitly."""
        s = self.scheduler
        if s.running or s.waiting_for_kv or s.offloaded or self._held or self._quarantine or not s.waiting:
            return []
        # Nothing runs or holds pages, so the whole pool is free: a head that cannot start never will.
        head = self.scheduler.waiting[0]
        tracked = self._tracked[head.request_id]
        msg = (f"request {head.request_id} needs {self.cache_manager.num_blocks_for(head.num_tokens)} KV blocks "
               f"but only {self.pool.num_free_blocks} exist")
        logger.error(msg)
        return [self._finish(tracked, FinishReason.ERROR, new_ids=(), delta="", error=msg)]

    @property
    def num_soft_resets(self) -> int:
        return self.preemptor.num_soft_resets

    @property
    def num_offloads(self) -> int:
        return self.preemptor.num_offloads

    def info(self) -> EngineInfo:
        a = self.arch
        return EngineInfo(model_name=self.source.name, vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                          num_layers=a.num_layers, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                          page_size=self.cache_manager.page_size, max_model_len=self.max_model_len,
                          num_blocks=self.pool.num_usable_blocks)

    def load(self) -> EngineLoad:
        """How busy the engine is now (engine thread; from another thread, a snapshot that may
        straddle one step)."""
        s = self.scheduler
        prompt_left = output_left = 0
        for t in self._tracked.values():
            r = t.request
            prompt_left += max(0, r.target_computed_tokens - r.num_computed_tokens)
            if not r.prefill_only:
                output_left += max(0, (r.sampling.max_tokens or self.max_model_len) - len(r.output_token_ids))
        return EngineLoad(num_unfinished=len(self._tracked), num_waiting=len(s.waiting) + len(s.waiting_for_kv),
                          num_running=len(s.running), prompt_tokens_left=prompt_left, output_tokens_left=output_left,
                          free_blocks=self.pool.num_free_blocks, total_blocks=self.pool.num_usable_blocks)

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine's gauges and counters (call from the engine thread, or accept
        a snapshot that may straddle one step when called from another thread)."""
        s = self.scheduler
        pc = self.cache_manager.prefix_cache
        return EngineMetrics(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_kv=len(s.waiting_for_kv),
            num_offloaded=len(s.offloaded),
            total_blocks=self.pool.num_usable_blocks,
            free_blocks=self.pool.num_empty_blocks,
            cached_blocks=self.pool.num_cached_blocks,
            kv_cache_usage=self.pool.usage,
            prefix_cache_queries=pc.num_queried_tokens if pc is not None else 0,
            prefix_cache_hits=pc.num_hit_tokens if pc is not None else 0,
            num_offloads=self.preemptor.num_offloads,
            num_soft_resets=self.preemptor.num_soft_resets,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            num_first_steps=self.num_first_steps,
            num_first_step_tokens=self.num_first_step_tokens,
            spec_handoff_history_rows=self.num_handoff_history_rows,
            **self._spec_metrics(),
        )

    def _spec_metrics(self) -> dict[str, object]:
        sp = self.speculator
        if sp is None:
            return {}
        return dict(spec_num_drafts=sp.num_drafts, spec_num_draft_tokens=sp.num_draft_tokens,
                    spec_num_accepted_tokens=sp.num_accepted_tokens, spec_accepted_per_pos=tuple(sp.accepted_per_pos))

    def check_integrity(self) -> None:
        """The pool balances (empty + used + cached == total; quarantined pages count as used),
        every block's reference count matches the tables that hold it, the swap pool balances, and
        exactly the requests that may hold blocks do (running, waiting for KV, finished but held,
        and the quarantines)."""
        self.cache_manager.check_integrity()
        if self.swap is not None:
            self.swap.check_integrity()
        s = self.scheduler
        may_hold = ({r.request_id for r in s.running} | set(s.waiting_for_kv) | set(self._held)
                    | {QUARANTINE_PREFIX + q for q in self._quarantine})
        holders = {rid for g in self.cache_manager.groups for rid in g.tables}
        if not holders <= may_hold:
            raise CacheIntegrityError(f"requests hold blocks but are not running, waiting for KV or held: "
                                      f"{sorted(holders - may_hold)[:10]}")
        swapped = self.swap.num_offloaded if self.swap is not None else 0
        if swapped != len(s.offloaded):
            raise CacheIntegrityError(f"the swap pool holds {swapped} requests but {len(s.offloaded)} are offloaded")
