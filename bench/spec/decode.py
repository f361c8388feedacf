"""Speculative decoding (E20, issue 17) on the default model: per-user TPS at batch 1 and system TPS
at batch 16 with and without each method, paired and alternating in one process.

    python -m bench.spec.decode [--rounds 3 --budget-s 480 --max-tokens 64 --batch-max-tokens 32] [--update]
    python -m bench.spec.decode --configs plain,ngram-k4-n1,self-k8-K2 --rounds 1 \\
        --max-tokens 16 --batch 4          # a smoke run

One engine (float32, --threads torch threads, the prefix cache on, the pool faulted in) serves
every configuration: between runs, while it is idle, the bench installs the configuration's
speculator, `engine.speculator = make_speculator(SpeculativeConfig(...), engine.runner)` (what the
engine builds from `speculative_config`), one per configuration, built on its first run and kept
(its adaptive control, on by default, learns pass costs and acceptance across runs as a server's
does); each run reads the counters as differences.
Configurations: plain (none); n-gram prompt lookup K in {2, 4, 8} x prompt_lookup_min in {1, 2}
(prompt_lookup_max 4), and K in {4, 8}, n=1 with the control off ("adaptive": false: every
proposal verified in full); the self-draft (the target's first k of its 30 layers, its norm and
lm_head) k in {4, 8, 15} x K in {2, 4}; with --draft-model PATH that checkpoint as the draft and
with --eagle-head DIR that head (`pdserve draft train`), K in {2, 4} each.

Workloads (token ids built once; chat prompts through the model's chat template):
- repetition: code with repeated lines and text repeated verbatim (tests/support/reference.py
  REFERENCE_PROMPTS[6], [7]), a class of near-identical accessors, and a chat "rewrite this
  paragraph" request whose answer copies the prompt;
- prose: an open-ended story, raw text and as a chat request.
Each round, for each workload, every configuration runs (in an order rotated each round and
reversed every other round, so no configuration always follows another):
- batch 1: each prompt alone, greedy, --max-tokens (64) output tokens, EOS ignored. Per-user TPS =
  (tokens - 1) / (time of the last token - time of the first): the decode phase, the prefill
  pass excluded (the same for every configuration). The workload's TPS in a round pools its
  prompts (their tokens over their seconds);
- batch --batch (16): that many requests (the workload's prompts, cycled) added at once,
  --batch-max-tokens (32) each (fewer than at batch 1 so that the whole run fits ~10 min). System
  TPS = all output tokens / the seconds from the first add to the last finish; the decode-phase
  TPS (tokens of the passes that computed no prompt token over those passes' seconds) beside it.
Speed-ups are the median over rounds of (configuration / plain) in the same round.

Every engine.step() is timed by a wrapper installed on the engine instance (nothing in the engine
changes) and classed by the engine's counters: prefill (it computed prompt tokens), verify (the
speculator verified at least one draft) or decode (plain 1-token decode of every sequence); the
speculator's `drafts` (n-gram lookup) and `fill` (self-draft passes) calls are timed inside it, so
a verify step splits into drafting and the target's verification pass. Acceptance: rate =
accepted / drafted tokens, mean acceptance length = 1 + accepted / drafts (tokens per verified
sequence step), per position i = drafts whose token i was accepted / drafts (vLLM's meanings).

Self-drafts run in the first --self-draft-rounds (1) rounds only, on --self-draft-workloads (prose,
their goal's workload) only: their acceptance is far below what any goal needs, so the time goes
to plain and the n-gram configurations, whose verdicts are close enough to their goals for the
machine's noise to matter. A round starts only if, by the last round's time, the measurement
ends within --budget-s (480 s); the results say how many rounds ran. Beside the acceptance the engine
counts, `early_exit_agreement` gives the self-draft's ceiling from transformers (teacher-forced
top-1 agreement of the first k layers + norm + lm_head with the full model on plain's outputs).

Correctness: greedy speculative output must equal plain output token for token; every run is
compared with plain's run of the same prompt (batch 1) or batch (batch 16) in the same round, and
a mismatch is printed loudly and counted in the results (it is a bug, not noise).

--update writes <--results-dir>/spec_decode.md and .json (default bench/results/spec/; stamped with
commit, date, machine and the exact command, plus the load average); without it the report is only
printed.

Bounds: nothing here waits on anything but the engine's own steps in this thread; a run ends when
its requests finish (max_tokens each, EOS ignored), at most --max-tokens steps per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.common.results import add_results_args, write_results
from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.loader import make_speculator
from pdserve.engine.spec_decode.speculator import Speculator
from tests.support.reference import REFERENCE_PROMPTS

GOAL_SPEEDUP_BATCH1 = 1.5      # per-user TPS at batch 1: n-gram on repetition, the best draft on prose
GOAL_SYSTEM_RATIO = 1.0        # system TPS at batch 16: no loss against plain

# --- configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    name: str
    spec: SpeculativeConfig | None   # None: plain decoding
    label: str                       # for the tables


def all_configs(num_layers: int, draft_model: str | None, eagle_head: str | None) -> list[BenchConfig]:
    out = [BenchConfig("plain", None, "plain")]
    for k in (2, 4, 8):
        for n in (1, 2):
            out.append(BenchConfig(f"ngram-k{k}-n{n}", SpeculativeConfig(
                method="ngram", num_speculative_tokens=k, prompt_lookup_min=n, prompt_lookup_max=4),
                f"n-gram K={k}, n={n}..4"))
    for k in (4, 8):   # the control off: every proposal verified in full (what the control saves)
        out.append(BenchConfig(f"ngram-k{k}-n1-fixed", SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=4, adaptive=False),
            f"n-gram K={k}, n=1..4, adaptive off"))
    for layers in (4, 8, 15):
        if layers > num_layers:
            continue
        for k in (2, 4):
            out.append(BenchConfig(f"self-k{layers}-K{k}", SpeculativeConfig(
                method="draft_model", self_draft_layers=layers, num_speculative_tokens=k),
                f"self-draft {layers}/{num_layers} layers, K={k}"))
    if draft_model is not None:
        for k in (2, 4):
            out.append(BenchConfig(f"draft-K{k}", SpeculativeConfig(
                method="draft_model", model=draft_model, num_speculative_tokens=k),
                f"draft {os.path.basename(draft_model.rstrip('/'))}, K={k}"))
    if eagle_head is not None:
        for k in (2, 4):
            out.append(BenchConfig(f"eagle-K{k}", SpeculativeConfig(
                method="eagle", model=eagle_head, num_speculative_tokens=k),
                f"eagle head {os.path.basename(eagle_head.rstrip('/'))}, K={k}"))
    return out


# --- workloads ---------------------------------------------------------------------------------

_PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
              "night its keeper climbed the narrow stairs, lit the great lamp, and watched the ships pass "
              "safely through the dark water below. When the keeper grew old, the town decided to replace "
              "the lamp with an automatic light, but the people still gathered on the cliff each evening "
              "to watch it shine.")

_ACCESSORS = ("class Point3D:\n"
              "    def get_x(self):\n        return self._x\n\n"
              "    def set_x(self, value):\n        self._x = value\n\n"
              "    def get_y(self):\n        return self._y\n\n"
              "    def set_y(self, value):\n        self._y = value\n\n"
              "    def get_z(self):\n")


@dataclass(frozen=True)
class Prompt:
    name: str
    token_ids: tuple[int, ...]


def chat(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):   # newer transformers answer a BatchEncoding
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def workloads(tokenizer: Any) -> dict[str, list[Prompt]]:
    def raw(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text)["input_ids"])

    return {
        "repetition": [
            Prompt("code-repeated-lines", raw(REFERENCE_PROMPTS[6])),
            Prompt("text-repeated", raw(REFERENCE_PROMPTS[7])),
            Prompt("code-accessors", raw(_ACCESSORS)),
            Prompt("chat-rewrite", chat(tokenizer, "Rewrite the following paragraph word for word, keeping every "
                                                   "sentence, in the same words:\n\n" + _PARAGRAPH)),
        ],
        "prose": [
            Prompt("story-raw", raw("Once upon a time, in a small village at the foot of the mountains, there lived")),
            Prompt("chat-story", chat(tokenizer, "Write a short story about a robot who learns to paint.")),
        ],
    }


# --- step timing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    kind: str          # "prefill" | "verify" | "decode"
    wall_s: float      # the whole engine.step()
    draft_s: float     # of it, inside the speculator's drafts() + fill()
    tokens: int        # tokens emitted
    seqs: int          # sequences running (verify, decode); 0 for prefill


class StepTimer:
    """Wraps engine.step (an instance attribute; the class's method is untouched) and the current
    speculator's drafts / fill; files each step's record under `label`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inner = engine.step
        engine.step = self._step  # type: ignore[method-assign]
        self.label: tuple[str, ...] = ("untimed",)
        self.records: dict[tuple[str, ...], list[StepRecord]] = defaultdict(list)
        self._draft_s = 0.0
        self._specs: dict[str, Speculator | None] = {}

    def install(self, config: BenchConfig) -> Speculator | None:
        """`config`'s speculator on the idle engine, built as the engine builds its own on first
        use and kept for the later runs (its control learns pass costs and acceptance across
        runs, as a server's does); a run reads its counters as differences."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine must be idle to change its speculator")
        if config.name not in self._specs:
            e, c = self.engine, self.engine.config
            spec = None if config.spec is None else make_speculator(
                config.spec, e.runner, e.tokenizer, e.max_model_len, c.torch_dtype, c.small_batch_max_tokens,
                c.scheduler.max_batch_tokens, str(e.source.path))
            if spec is not None:
                spec.drafts = self._timed(spec.drafts)  # type: ignore[method-assign]
                spec.fill = self._timed(spec.fill)      # type: ignore[method-assign]
            self._specs[config.name] = spec
        self.engine.speculator = self._specs[config.name]
        return self.engine.speculator

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._draft_s += time.perf_counter() - t0
        return wrapper

    def _step(self) -> list[Any]:
        e = self.engine
        sp = e.speculator
        drafts0 = sp.num_drafts if sp is not None else 0
        prompt0, gen0 = e.num_prompt_tokens_computed, e.num_generated_tokens
        running = sum(1 for r in e.scheduler.running if not r.prefill_only)
        self._draft_s = 0.0
        t0 = time.perf_counter()
        out = self.inner()
        wall = time.perf_counter() - t0
        tokens = e.num_generated_tokens - gen0
        drafts = (sp.num_drafts if sp is not None else 0) - drafts0
        if e.num_prompt_tokens_computed > prompt0:
            kind, seqs = "prefill", 0
        elif drafts > 0:
            kind, seqs = "verify", running
        elif tokens > 0:
            kind, seqs = "decode", running
        else:
            return out   # nothing ran (a stalled step)
        self.records[self.label].append(StepRecord(kind, wall, self._draft_s, tokens, seqs))
        return out


# --- one run -----------------------------------------------------------------------------------


@dataclass
class RunResult:
    tokens: list[list[int]]        # output ids per request
    wall_s: float                  # first add -> last finish
    decode_s: float                # batch 1: first token -> last token; batch N: the non-prefill steps' seconds
    decode_tokens: int             # tokens emitted in that time
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def run(engine: LLMEngine, timer: StepTimer, config: BenchConfig, prompts: Sequence[Prompt], max_tokens: int,
        label: tuple[str, ...], tag: str) -> RunResult:
    """All `prompts` added at once, stepped to completion under `config`."""
    spec = timer.install(config)
    before = (0, 0, 0, []) if spec is None else (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                                                 list(spec.accepted_per_pos))
    timer.label = label
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = len(timer.records[label])
    t0 = time.perf_counter()
    reqs = [engine.add_request(list(p.token_ids), params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    t_first = None
    done = 0
    while done < len(reqs):
        for o in engine.step():
            if o.finished:
                if o.error:
                    raise RuntimeError(f"request {o.request_id} failed: {o.error}")
                done += 1
        if t_first is None and all(r.output_token_ids for r in reqs):
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    timer.label = ("untimed",)
    tokens = [list(r.output_token_ids) for r in reqs]
    bad = [len(t) for t in tokens if len(t) != max_tokens]
    if bad:
        raise RuntimeError(f"{config.name}: requests produced {bad} tokens, not {max_tokens}")
    if len(reqs) == 1:
        assert t_first is not None
        decode_s, decode_tokens = t_end - t_first, max_tokens - 1
    else:
        steps = [s for s in timer.records[label][first:] if s.kind != "prefill"]
        decode_s, decode_tokens = sum(s.wall_s for s in steps), sum(s.tokens for s in steps)
    res = RunResult(tokens, t_end - t0, decode_s, decode_tokens)
    if spec is not None:
        res.drafts, res.draft_tokens, res.accepted = (spec.num_drafts - before[0], spec.num_draft_tokens - before[1],
                                                      spec.num_accepted_tokens - before[2])
        res.accepted_per_pos = [a - b for a, b in zip(spec.accepted_per_pos, before[3], strict=True)]
    return res


# --- the measurement ---------------------------------------------------------------------------


def order_for(configs: list[BenchConfig], r: int) -> list[BenchConfig]:
    shift = (r * 5) % len(configs)
    order = configs[shift:] + configs[:shift]
    return order[::-1] if r % 2 else order


@dataclass
class Tally:
    """Everything one (config, workload, batch) collected over the rounds."""

    tps: dict[int, float] = field(default_factory=dict)          # round -> the workload's pooled TPS
    decode_tps: dict[int, float] = field(default_factory=dict)   # batch N: round -> decode-phase TPS
    prompt_tps: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))  # batch 1
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    mismatches: int = 0


def measure(llm: LLM, configs: list[BenchConfig], loads: dict[str, list[Prompt]], args: argparse.Namespace,
            timer: StepTimer) -> tuple[dict[tuple[str, str, int], Tally], list[str], dict[str, list[int]]]:
    """The tallies, the mismatch messages, and plain's batch-1 output of each prompt."""
    engine = llm.engine
    tallies: dict[tuple[str, str, int], Tally] = defaultdict(Tally)
    mismatches: list[str] = []
    plain_out: dict[str, list[int]] = {}

    t_start = time.perf_counter()   # --budget-s counts the warm-up in
    # warm-up, untimed: every prompt once (the prefix cache then holds each prompt's full blocks for
    # every configuration alike) and every configuration on one short batch (its code paths)
    for wl, prompts in loads.items():
        run(engine, timer, configs[0], prompts, 4, ("untimed",), f"warm-{wl}")
    for c in configs:
        run(engine, timer, c, loads["repetition"][:2], 8, ("untimed",), f"warm-{c.name}")

    def round_configs(r: int, wl: str) -> list[BenchConfig]:
        # self-drafts only on --self-draft-workloads in the first --self-draft-rounds rounds: their
        # verdict is far from every goal (acceptance < 0.1); the time goes to the n-gram configurations
        return [c for c in order_for(configs, r) if not c.name.startswith("self")
                or (r < args.self_draft_rounds and wl in args.self_draft_workloads)]

    def round_runs(r: int) -> int:
        return sum(len(round_configs(r, wl)) * len(ps) for wl, ps in loads.items())

    n = 0
    args.rounds_run = 0
    for r in range(args.rounds):
        t_round = time.perf_counter()
        for wl, prompts in loads.items():
            order = round_configs(r, wl)
            for batch in (1, args.batch):
                units = [[p] for p in prompts] if batch == 1 else [[prompts[i % len(prompts)] for i in range(batch)]]
                per_cfg: dict[str, list[RunResult]] = defaultdict(list)
                for unit in units:
                    results = {}
                    for c in order:
                        n += 1
                        res = run(engine, timer, c, unit, args.max_tokens if batch == 1 else args.batch_max_tokens,
                                  (c.name, wl, str(batch)), f"r{r}-{n}")
                        results[c.name] = res
                        per_cfg[c.name].append(res)
                    plain_tokens = results["plain"].tokens
                    if batch == 1:
                        plain_out[unit[0].name] = plain_tokens[0]
                    for name, res in results.items():
                        if res.tokens != plain_tokens:
                            where = unit[0].name if batch == 1 else f"batch {batch}"
                            diff = [i for i, (a, b) in enumerate(zip(res.tokens, plain_tokens, strict=True)) if a != b]
                            msg = (f"!!! MISMATCH !!! round {r}, {wl}, {where}: {name} differs from plain in "
                                   f"request(s) {diff}")
                            print(msg, flush=True)
                            mismatches.append(msg)
                            tallies[(name, wl, batch)].mismatches += 1
                for name, results_ in per_cfg.items():
                    t = tallies[(name, wl, batch)]
                    if batch == 1:
                        t.tps[r] = sum(x.decode_tokens for x in results_) / sum(x.decode_s for x in results_)
                        for p, x in zip(prompts, results_, strict=True):
                            t.prompt_tps[p.name][r] = x.decode_tokens / x.decode_s
                    else:
                        (x,) = results_
                        t.tps[r] = sum(map(len, x.tokens)) / x.wall_s
                        t.decode_tps[r] = x.decode_tokens / x.decode_s
                    for x in results_:
                        t.drafts += x.drafts
                        t.draft_tokens += x.draft_tokens
                        t.accepted += x.accepted
                        if x.accepted_per_pos:
                            if not t.accepted_per_pos:
                                t.accepted_per_pos = [0] * len(x.accepted_per_pos)
                            t.accepted_per_pos = [a + b for a, b in zip(t.accepted_per_pos, x.accepted_per_pos,
                                                                        strict=True)]
        took = time.perf_counter() - t_round
        args.rounds_run = r + 1
        print(f"round {r + 1}/{args.rounds} in {took:.0f} s, load average {os.getloadavg()[0]:.2f}", flush=True)
        # the next round's time, from this one's (scaled by the runs it has): stop before --budget-s
        if r + 1 < args.rounds:
            estimate = took * round_runs(r + 1) / round_runs(r)
            if time.perf_counter() - t_start + estimate > args.budget_s:
                print(f"stopping after {r + 1} rounds: the next (~{estimate:.0f} s) would pass --budget-s "
                      f"{args.budget_s:.0f}", flush=True)
                break
    return tallies, mismatches, plain_out


def early_exit_agreement(loads: dict[str, list[Prompt]], plain_out: dict[str, list[int]],
                         depths: Sequence[int]) -> dict[str, dict[int, float]]:
    """The self-draft's ceiling, independently of pdserve: transformers' model run once over each
    prompt + plain's greedy output; per workload and depth k, the share of output positions where
    argmax(lm_head(norm(hidden state after layer k))) equals the full model's argmax (teacher-forced:
    the first-position acceptance a k-layer self-draft could reach)."""
    from transformers import AutoModelForCausalLM

    from pdserve.model.loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(None).path), dtype=torch.float32).eval()
    out: dict[str, dict[int, float]] = {}
    for wl, prompts in loads.items():
        same = dict.fromkeys(depths, 0)
        total = 0
        for p in prompts:
            gen = plain_out[p.name]
            ids = torch.tensor([list(p.token_ids) + gen])                   # [1, P + G]
            n = len(p.token_ids)
            with torch.inference_mode():
                o = model(ids, output_hidden_states=True)
                final = o.logits[0, n - 1:-1].argmax(-1)                      # [G]
                for k in depths:
                    h = model.model.norm(o.hidden_states[k][0, n - 1:-1])     # [G, hidden]
                    same[k] += int((model.lm_head(h).argmax(-1) == final).sum())
            total += len(gen)
        out[wl] = {k: same[k] / total for k in depths}
    return out


# --- summary -----------------------------------------------------------------------------------


def median(xs: dict[int, float]) -> float | None:
    return statistics.median(xs.values()) if xs else None


def paired(xs: dict[int, float], base: dict[int, float]) -> float | None:
    """The median over the rounds `xs` ran in of its ratio to plain in the same round."""
    return statistics.median(v / base[r] for r, v in xs.items()) if xs else None


def step_summary(records: list[StepRecord]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("decode", "verify", "prefill"):
        rs = [s for s in records if s.kind == kind]
        if not rs:
            continue
        out[kind] = {"steps": len(rs), "median_ms": statistics.median(s.wall_s for s in rs) * 1e3,
                     "draft_median_ms": statistics.median(s.draft_s for s in rs) * 1e3,
                     "pass_median_ms": statistics.median(s.wall_s - s.draft_s for s in rs) * 1e3,
                     "tokens_per_seq_step": sum(s.tokens for s in rs) / max(1, sum(s.seqs for s in rs))}
    return out


def summarize(configs: list[BenchConfig], loads: dict[str, list[Prompt]], batch: int,
              tallies: dict[tuple[str, str, int], Tally], timer: StepTimer) -> list[dict[str, Any]]:
    rows = []
    for wl in loads:
        for b in (1, batch):
            base = tallies[("plain", wl, b)]
            plain_steps = step_summary(timer.records[("plain", wl, str(b))])
            plain_decode = plain_steps.get("decode", {}).get("median_ms")
            for c in configs:
                t = tallies[(c.name, wl, b)]
                steps = step_summary(timer.records[(c.name, wl, str(b))])
                verify = steps.get("verify", {})
                row = {"config": c.name, "label": c.label, "workload": wl, "batch": b,
                       "tps": median(t.tps), "speedup": paired(t.tps, base.tps),
                       "decode_tps": median(t.decode_tps), "decode_speedup": paired(t.decode_tps, base.decode_tps),
                       "prompt_speedup": {p: paired(v, base.prompt_tps[p]) for p, v in t.prompt_tps.items()},
                       "drafts": t.drafts, "draft_tokens": t.draft_tokens, "accepted": t.accepted,
                       "acceptance_rate": t.accepted / t.draft_tokens if t.draft_tokens else None,
                       "mean_acceptance_length": 1 + t.accepted / t.drafts if t.drafts else None,
                       "per_pos": [a / t.drafts for a in t.accepted_per_pos] if t.drafts else [],
                       "steps": steps, "plain_decode_step_ms": plain_decode,
                       "verify_over_decode": (verify["median_ms"] / plain_decode
                                              if verify and plain_decode else None),
                       "mismatches": t.mismatches}
                rows.append(row)
    return rows


def goals(rows: list[dict[str, Any]], batch: int) -> list[dict[str, Any]]:
    def best(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        cand = [r for r in rows if pred(r) and r["speedup"] is not None]
        return max(cand, key=lambda r: r["speedup"]) if cand else None

    out = []
    for name, pred in (
        ("n-gram, repetition, batch 1: per-user TPS >= 1.5x plain",
         lambda r: r["config"].startswith("ngram") and r["workload"] == "repetition" and r["batch"] == 1),
        ("best draft, prose, batch 1: per-user TPS >= 1.5x plain",
         lambda r: r["config"].startswith("self") and r["workload"] == "prose" and r["batch"] == 1),
    ):
        b = best(pred)
        out.append({"goal": name, "config": b["config"] if b else None, "value": b["speedup"] if b else None,
                    "verdict": "n/a" if b is None else "MET" if b["speedup"] >= GOAL_SPEEDUP_BATCH1 else "MISSED"})
    for wl in ("repetition", "prose"):
        # the batch-1 winner of the workload's method, at batch N
        for method, prefix in (("n-gram", "ngram"), ("self-draft", "self")):
            b1 = best(lambda r, wl=wl, prefix=prefix: r["config"].startswith(prefix) and r["workload"] == wl
                      and r["batch"] == 1)
            if b1 is None:
                continue
            bn = next(r for r in rows if r["config"] == b1["config"] and r["workload"] == wl and r["batch"] == batch)
            v = bn["speedup"]
            out.append({"goal": f"{method} best at batch 1 ({b1['config']}), {wl}, batch {batch}: system TPS >= plain",
                        "config": b1["config"], "value": v,
                        "verdict": "MET" if v is not None and v >= GOAL_SYSTEM_RATIO else "MISSED"})
    return out


# --- report ------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def report(rows: list[dict[str, Any]], goal_rows: list[dict[str, Any]], loads: dict[str, list[Prompt]],
           args: argparse.Namespace, loadavg: dict[str, list[float]], wall_s: float,
           mismatches: list[str], num_layers: int,
           ceiling: dict[str, dict[int, float]]) -> list[str]:
    b = args.batch
    lines = ["# Speculative decoding: per-user and system TPS (issue 17)", "",
             f"{wall_s:.0f} s (commit, machine and command at the end). Load average (1/5/15 min) at start "
             f"{loadavg['start']}, at end {loadavg['end']} (a shared machine).",
             "",
             f"{'Default model (SmolLM2-135M-Instruct' if args.model is None else 'Model (' + args.model}, "
             f"{num_layers} layers), float32, {args.threads} threads, one "
             f"engine; greedy, EOS ignored, {args.max_tokens} output tokens per request at batch 1, "
             f"{args.batch_max_tokens} at batch {b}; {args.rounds_run} rounds of --rounds {args.rounds} "
             f"(--budget-s {args.budget_s:.0f}; self-drafts in the first {args.self_draft_rounds}, on "
             f"{', '.join(args.self_draft_workloads)} only), every configuration in each, in a rotating order. "
             "Batch 1: per-user decode TPS (first to last token), "
             f"pooled over the workload's prompts; batch {b}: system TPS (first add to last finish) and decode-phase "
             "TPS. Speed-up: the median over rounds of the per-round ratio to plain. Acceptance: rate = accepted / "
             "drafted tokens; length = 1 + accepted / drafts; per position i = drafts whose token i was accepted / "
             "drafts.", ""]
    for wl, prompts in loads.items():
        lines.append(f"- {wl}: " + ", ".join(f"{p.name} ({len(p.token_ids)} tokens)" for p in prompts))
    lines += ["", f"Greedy outputs equal plain, token for token, in every run: "
              f"{'yes' if not mismatches else 'NO: ' + str(len(mismatches)) + ' mismatches (below)'}", ""]
    lines += ["## Goals", "", "| goal | config | measured | verdict |", "|---|---|---:|---|"]
    for g in goal_rows:
        lines.append(f"| {g['goal']} | {g['config']} | {fmt(g['value'], '.2f', 'x')} | {g['verdict']} |")
    for wl in loads:
        lines += ["", f"## {wl}", "",
                  f"| config | batch 1 TPS | x plain | batch {b} TPS | x plain | batch {b} decode TPS | x plain | "
                  f"accept rate (b1) | accept len (b1) | accept rate (b{b}) | accept len (b{b}) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        by = {(r["config"], r["batch"]): r for r in rows if r["workload"] == wl}
        for name in dict.fromkeys(r["config"] for r in rows):
            r1, rn = by[(name, 1)], by[(name, b)]
            lines.append(f"| {r1['label']} | {fmt(r1['tps'], '.1f')} | {fmt(r1['speedup'], '.2f', 'x')} | "
                         f"{fmt(rn['tps'], '.1f')} | {fmt(rn['speedup'], '.2f', 'x')} | "
                         f"{fmt(rn['decode_tps'], '.1f')} | "
                         f"{fmt(rn['decode_speedup'], '.2f', 'x')} | {fmt(r1['acceptance_rate'])} | "
                         f"{fmt(r1['mean_acceptance_length'])} | {fmt(rn['acceptance_rate'])} | "
                         f"{fmt(rn['mean_acceptance_length'])} |")
        names = [p.name for p in loads[wl]]
        lines += ["", f"Batch 1 speed-up per prompt ({wl}):", "",
                  "| config | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for name in dict.fromkeys(r["config"] for r in rows):
            if name == "plain":
                continue
            r1 = by[(name, 1)]
            lines.append(f"| {r1['label']} | " + " | ".join(fmt(r1['prompt_speedup'].get(p), '.2f', 'x')
                                                           for p in names) + " |")
        lines += ["", f"Per-position acceptance ({wl}, batch 1 / batch {b}):", "",
                  f"| config | per position, batch 1 | per position, batch {b} |", "|---|---|---|"]
        for name in dict.fromkeys(r["config"] for r in rows):
            if name == "plain":
                continue
            r1, rn = by[(name, 1)], by[(name, b)]
            lines.append(f"| {r1['label']} | {' '.join(f'{x:.2f}' for x in r1['per_pos'])} | "
                         f"{' '.join(f'{x:.2f}' for x in rn['per_pos'])} |")
        lines += ["", f"Step times ({wl}; medians, ms): plain decode step vs the configuration's verify step "
                  "(drafting + the target's verification pass), and tokens emitted per sequence per step:", "",
                  f"| config | b1 plain decode | b1 verify (draft + pass) | b1 verify / decode | b1 tokens/step | "
                  f"b{b} plain decode | b{b} verify (draft + pass) | b{b} verify / decode | b{b} tokens/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name in dict.fromkeys(r["config"] for r in rows):
            if name == "plain":
                continue
            cells = [by[(name, 1)]["label"]]
            for bb in (1, b):
                r = by[(name, bb)]
                v = r["steps"].get("verify")
                split = "-" if not v else (f"{v['median_ms']:.2f} ({v['draft_median_ms']:.2f} + "
                                           f"{v['pass_median_ms']:.2f})")
                cells += [fmt(r["plain_decode_step_ms"]), split,
                          fmt(r["verify_over_decode"], ".2f", "x"),
                          "-" if not v else f"{v['tokens_per_seq_step']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    if ceiling:
        lines += ["", "## Self-draft ceiling (transformers, teacher-forced)", "",
                  "Share of plain's output positions where the first k layers + final norm + lm_head give the full "
                  "model's argmax (the first-position acceptance a k-layer self-draft could reach; "
                  "`early_exit_agreement`):", "",
                  "| workload | " + " | ".join(f"k={k}" for k in next(iter(ceiling.values()))) + " |",
                  "|---|" + "---:|" * len(next(iter(ceiling.values())))]
        for wl, by_k in ceiling.items():
            lines.append(f"| {wl} | " + " | ".join(f"{v:.2f}" for v in by_k.values()) + " |")
    if mismatches:
        lines += ["", "## MISMATCHES", ""] + [f"- {m}" for m in mismatches]
    return lines


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--self-draft-rounds", type=int, default=1, help="rounds (the first ones) that run self-drafts")
    p.add_argument("--self-draft-workloads", default="prose", help="comma list: the workloads self-drafts run on")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="no round starts that would (by the last round's time) end the measurement after this")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request at batch 1")
    p.add_argument("--batch-max-tokens", type=int, default=32, help="output tokens per request at --batch")
    p.add_argument("--batch", type=int, default=16, help="requests of the system-TPS batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="the target checkpoint (default: pdserve's default model, "
                                                 "which the shipped heads and the self-draft depths are for)")
    p.add_argument("--configs", default=None, help="comma list of config names (default: all; plain always runs)")
    p.add_argument("--draft-model", default=None,
                   help="a checkpoint sharing the target's tokenizer: adds configs draft-K2, draft-K4")
    p.add_argument("--eagle-head", default=None,
                   help="a draft head trained for the target (pdserve draft train): adds configs eagle-K2, eagle-K4")
    p.add_argument("--workloads", default=None, help="comma list of repetition, prose (default: both)")
    p.add_argument("--update", action="store_true", help="write spec_decode.md/.json into --results-dir")
    add_results_args(p, "spec")
    args = p.parse_args(argv)
    args.self_draft_workloads = [w.strip() for w in args.self_draft_workloads.split(",") if w.strip()]
    if args.rounds < 1 or min(args.max_tokens, args.batch_max_tokens) < 2 or args.batch < 2:
        p.error(f"need --rounds >= 1, --max-tokens and --batch-max-tokens >= 2, --batch >= 2 (got {args.rounds}, "
                f"{args.max_tokens}, {args.batch_max_tokens}, {args.batch})")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    loadavg = {"start": [round(x, 2) for x in os.getloadavg()]}
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype="float32", num_threads=args.threads, num_blocks=64 * args.batch,
              max_batch_tokens=512, max_requests_per_batch=max(16, args.batch), kv_prefault=True)
    num_layers = llm.engine.arch.num_layers
    configs = all_configs(num_layers, args.draft_model, args.eagle_head)
    if args.configs:
        want = {"plain", *(s.strip() for s in args.configs.split(",") if s.strip())}
        unknown = sorted(want - {c.name for c in configs})
        if unknown:
            raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(c.name for c in configs)}")
        configs = [c for c in configs if c.name in want]
    loads = workloads(llm.tokenizer)
    if args.workloads:
        want_wl = [s.strip() for s in args.workloads.split(",") if s.strip()]
        unknown = sorted(set(want_wl) - set(loads))
        if unknown:
            raise SystemExit(f"--workloads: unknown {unknown}; known: {', '.join(loads)}")
        loads = {w: loads[w] for w in want_wl}
    print(f"{len(configs)} configs x {list(loads)}, {args.rounds} rounds, {args.max_tokens} tokens, batch 1 and "
          f"{args.batch}; model loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    timer = StepTimer(llm.engine)
    tallies, mismatches, plain_out = measure(llm, configs, loads, args, timer)
    depths = sorted({c.spec.self_draft_layers for c in configs if c.spec is not None and c.spec.self_draft_layers})
    ceiling = early_exit_agreement(loads, plain_out, depths) if depths else {}
    rows = summarize(configs, loads, args.batch, tallies, timer)
    goal_rows = goals(rows, args.batch)
    loadavg["end"] = [round(x, 2) for x in os.getloadavg()]
    lines = report(rows, goal_rows, loads, args, loadavg, time.perf_counter() - t0, mismatches, num_layers, ceiling)
    print("\n" + "\n".join(lines), flush=True)
    if mismatches:
        print(f"\n!!! {len(mismatches)} MISMATCHES between speculative and plain greedy output !!!", flush=True)
    if args.update:
        payload = {"load_average": loadavg, "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
                   "workloads": {w: [{"name": p.name, "prompt_tokens": len(p.token_ids)} for p in ps]
                                 for w, ps in loads.items()},
                   "rows": rows, "goals": goal_rows, "self_draft_ceiling": ceiling, "mismatches": mismatches}
        write_results(args.results_dir, "spec_decode", payload=payload, lines=lines,
                      argv=None if argv is None else list(argv))


if __name__ == "__main__":
    main()
