"""The speculative hidden-state handoff through `pdserve up` (issue 18): TTFT, time to the second
token and per-user TPS at batch 1 and 8, eagle vs draft vs n-gram vs none, on 1P+1D clusters.

    python -m bench.spec.eagle_handoff --rounds 3 --budget-s 1200 --max-tokens 64 --batch 8 \\
        --update                                         # the full run, on an idle machine (~15 min)
        # add --train-log LOG (the draft train run's log) and/or --train-time-s S for the training line;
        # --eagle-head DIR to measure another head than the shipped one
    python -m bench.spec.eagle_handoff --configs none,ngram --rounds 1 --max-tokens 8 \\
        --batch 2                                        # a smoke run

Configurations (speculative_config of the decode node; never the prefill node's, see launcher.py):
- none: no speculation;
- ngram: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2};
- draft: {"method": "draft_model", "self_draft_layers": 8, "num_speculative_tokens": 2} (the
  target's first 8 layers, its norm and lm_head);
- eagle: {"method": "eagle", "num_speculative_tokens": 3}, with --eagle-head DIR adding "model":
  DIR; without it, the head that ships with pdserve for the default model
  (pdserve/assets/heads/, pdserve.model.eagle_config.shipped_head_for). Both nodes run with
  --context-history-rows 128 (launcher.py does that for eagle): the context record carries the
  prompt's last 128 hidden states and the decode node writes the head's history rows from them;
- eagle-nohist: the same with --context-history-rows 0: the head starts from the one shipped
  hidden state, no history (TTFT and acceptance of the handoff's history, both ways).
"none" always runs: it is the reference of every speed-up and of the greedy-equality check.

Clusters: one per configuration, all started at the beginning and kept up to the end (each about
2 GB: two model copies and their pools), so that rounds can alternate configurations (paired
A/B on a machine whose speed drifts within minutes); only the one being measured has work, the
others idle. Each: `pdserve up`'s Cluster with 1 prefill + 1 decode node + router, provider shm,
the default model, --threads-per-node (1: the two nodes do not fight on a 2-core machine),
--num-blocks (256) blocks per node, the prefix cache off unless --prefix-cache (every request
pays its prefill and its transfer, as a fresh prompt does: TTFT is the point here). Each is
warmed up (every prompt once, then one batch, 4 tokens each) before any measurement.

Prompts (token ids, built once with the default model's tokenizer): bench.spec.decode's
workloads (imported, not copied: repetition = tests/support/reference.py REFERENCE_PROMPTS[6], [7],
the accessor class, the chat "rewrite this paragraph"; prose = the raw and the chat story), plus
REFERENCE_PROMPTS[0] and [4] as short prose. Greedy, --max-tokens (64) output tokens, EOS ignored.

Each round (configurations in an order rotated each round and reversed every other round):
- batch 1: each prompt alone, one configuration after the other. Per request, measured by the
  client from its gRPC stream (pdserve.tools.client.AsyncClient.generate; a chunk per decode
  step): TTFT = send -> first token; time to the second token = send -> arrival of the chunk that
  carries the second output token (equal to TTFT when the first decode step after the transfer
  emits more than one token: the handoff's point); per-user TPS = (tokens - 1) / (last token -
  first token), the decode phase. The server's TTFT (ServerTimings) is reported beside it.
- batch --batch (8): that many requests (the prompts, cycled) sent at once; the same per request
  (median / p90 over requests and rounds) and system TPS = all output tokens / (first send ->
  last finish).
Speed-ups are the median over rounds of (configuration / none) in the same round.

Acceptance, from the decode node's /metrics (tests/support/prometheus.py), as differences around
each request (batch 1) or batch: rate = accepted / draft tokens, mean acceptance length = 1 +
accepted / drafts, per position i = drafts whose token i was accepted / drafts (vLLM's meanings;
pdserve:spec_decode_* counters); first-step tokens = pdserve:first_step_tokens_total /
pdserve:first_steps_total, the tokens emitted by each request's first decode step after the KV
transfer (1.0 without speculation; above 1 when the drafts from the shipped hidden state are
accepted at once).

Correctness: greedy output of every configuration must equal none's token for token; each run is
compared with none's run of the same prompt (batch 1) or the same batch (batch N) in the same
round, and every mismatch is printed loudly and counted in the results (a bug, not noise).

Training: the eagle head's config.json train_stats (steps, loss, held-out top-1 agreement) and,
with --train-log FILE (repeatable: a run and its --resume), the log of `pdserve draft train`: the
progress bar's elapsed time per segment (summed), the last step and the final agreement line; a
--no-progress log has no times, so --train-time-s S puts the wall time its runner measured in the
report, marked as given. train_stats are read before the clusters start (what they load); the
report warns when config.json changed during the run (a training run writing the same folder).

A round starts only if, by the last round's time, the run ends within --budget-s (1200 s,
counted from the start, cluster starts included); the results say how many rounds ran. --update
writes bench/results/spec/eagle_handoff.md and .json (the machine, commit, date, load average and the
exact command); without it the report is only printed.

Bounds: each cluster's start, at most --startup-timeout-s (300 s; Cluster.start); each request,
at most --request-timeout-s (300 s; the gRPC deadline); each /metrics read, 10 s
(support.prometheus.fetch); each cluster's stop, 10 s before SIGKILL (Cluster.stop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common.results import add_results_args, write_results
from bench.spec import decode as spec_bench
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, GenerationChunk
from pdserve.tools.launcher import Cluster
from tests.support import prometheus
from tests.support.reference import REFERENCE_PROMPTS

DECODE_NODE = "decode-0"
WARMUP_TOKENS = 4

# --- configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    name: str
    spec: dict[str, Any] | None   # the decode node's speculative_config; None: no speculation
    label: str
    engine_args: tuple[str, ...] = ()   # more engine flags for both nodes


def all_configs(eagle_head: str | None) -> list[BenchConfig]:
    eagle: dict[str, Any] = {"method": "eagle", "num_speculative_tokens": 3}
    if eagle_head is not None:
        eagle["model"] = eagle_head
    return [
        BenchConfig("none", None, "none"),
        BenchConfig("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                              "prompt_lookup_min": 2}, "n-gram K=4, n=2..4"),
        BenchConfig("draft", {"method": "draft_model", "self_draft_layers": 8, "num_speculative_tokens": 2},
                    "self-draft 8 layers, K=2"),
        BenchConfig("eagle", eagle, "eagle K=3, " + (os.path.basename(eagle_head.rstrip("/")) if eagle_head
                                                      else "shipped head")),
        # the same head without the prompt's history rows in the context record: the decode node's
        # head starts from the one shipped hidden state (what the handoff did before the history)
        BenchConfig("eagle-nohist", eagle, "eagle K=3, no handed-over history", ("--context-history-rows", "0")),
    ]


# --- prompts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    name: str
    workload: str                  # "repetition" | "prose"
    token_ids: tuple[int, ...]


def build_prompts(model: str | None = None) -> list[Prompt]:
    from pdserve.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    out = [Prompt(p.name, wl, tuple(p.token_ids)) for wl, ps in spec_bench.workloads(tok).items() for p in ps]
    for i, name in ((0, "capital-raw"), (4, "qa-raw")):
        out.append(Prompt(name, "prose", tuple(tok(REFERENCE_PROMPTS[i])["input_ids"])))
    return out


# --- metrics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCounters:
    """The decode node's counters at one moment (or a difference of two)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple[float, ...] = ()
    first_steps: float = 0.0
    first_step_tokens: float = 0.0

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + (0.0,) * (n - len(self.per_pos))
        b = other.per_pos + (0.0,) * (n - len(other.per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, tuple(x - y for x, y in zip(a, b, strict=True)),
                            self.first_steps - other.first_steps, self.first_step_tokens - other.first_step_tokens)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.per_pos), len(other.per_pos))
        a = self.per_pos + (0.0,) * (n - len(self.per_pos))
        b = other.per_pos + (0.0,) * (n - len(other.per_pos))
        return SpecCounters(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                            self.accepted + other.accepted, tuple(x + y for x, y in zip(a, b, strict=True)),
                            self.first_steps + other.first_steps, self.first_step_tokens + other.first_step_tokens)

    def summary(self) -> dict[str, Any]:
        return {"acceptance_rate": self.accepted / self.draft_tokens if self.draft_tokens else None,
                "mean_acceptance_length": 1 + self.accepted / self.drafts if self.drafts else None,
                "per_pos": [x / self.drafts for x in self.per_pos] if self.drafts else [],
                "first_step_tokens": self.first_step_tokens / self.first_steps if self.first_steps else None,
                "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "first_steps": self.first_steps}


def read_counters(url: str) -> SpecCounters:
    text, _ = prometheus.fetch(url)
    s = prometheus.parse(text)
    pos: dict[int, float] = {}
    for (name, labels), v in s.items():
        if name == "pdserve:spec_decode_num_accepted_tokens_per_pos_total":
            p = int(dict(labels)["position"])
            pos[p] = pos.get(p, 0.0) + v
    return SpecCounters(
        drafts=prometheus.total(s, "pdserve:spec_decode_num_drafts_total"),
        draft_tokens=prometheus.total(s, "pdserve:spec_decode_num_draft_tokens_total"),
        accepted=prometheus.total(s, "pdserve:spec_decode_num_accepted_tokens_total"),
        per_pos=tuple(pos.get(i, 0.0) for i in range(max(pos) + 1)) if pos else (),
        first_steps=prometheus.total(s, "pdserve:first_steps_total"),
        first_step_tokens=prometheus.total(s, "pdserve:first_step_tokens_total"))


# --- one request, one run ----------------------------------------------------------------------


@dataclass(frozen=True)
class RequestResult:
    prompt: str
    workload: str
    token_ids: tuple[int, ...]
    ttft_s: float                  # send -> first token (client)
    second_token_s: float          # send -> the chunk carrying output token 2
    decode_tps: float | None       # (tokens - 1) / (last token - first token); None if all came at once
    e2e_s: float
    first_chunk_tokens: int
    server_ttft_s: float | None
    counters: SpecCounters | None  # batch 1: the decode node's counters around this request


@dataclass(frozen=True)
class RunResult:
    requests: tuple[RequestResult, ...]
    wall_s: float                  # first send -> last finish
    counters: SpecCounters


async def one_request(client: AsyncClient, p: Prompt, max_tokens: int, tag: str,
                      metrics_url: str | None = None) -> RequestResult:
    before = read_counters(metrics_url) if metrics_url else None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids: list[int] = []
    arrivals: list[tuple[float, int]] = []   # (time since send, tokens so far) per chunk with tokens
    last: GenerationChunk | None = None
    t0 = time.perf_counter()
    async for chunk in client.generate(list(p.token_ids), params, request_id=tag):
        if chunk.token_ids:
            ids.extend(chunk.token_ids)
            arrivals.append((time.perf_counter() - t0, len(ids)))
        last = chunk
    e2e = time.perf_counter() - t0
    if last is None or last.finish_reason != "length" or len(ids) != max_tokens:
        raise RuntimeError(f"request {tag} ({p.name}) ended with {len(ids)} of {max_tokens} tokens, finish "
                           f"{None if last is None else last.finish_reason!r}, error "
                           f"{None if last is None else last.error!r}")
    ttft = arrivals[0][0]
    second = next(t for t, n in arrivals if n >= 2) if max_tokens >= 2 else ttft
    span = arrivals[-1][0] - ttft
    counters = read_counters(metrics_url) - before if metrics_url and before is not None else None
    return RequestResult(p.name, p.workload, tuple(ids), ttft, second,
                         (len(ids) - 1) / span if span > 0 else None, e2e, arrivals[0][1],
                         last.timings.time_to_first_token_s if last.timings else None, counters)


async def run_batch1(client: AsyncClient, metrics_url: str, prompts: Sequence[Prompt], max_tokens: int,
                     tag: str) -> RunResult:
    t0 = time.perf_counter()
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(await one_request(client, p, max_tokens, f"{tag}-{i}", metrics_url))
    total = SpecCounters()
    for r in reqs:
        assert r.counters is not None
        total = total + r.counters
    return RunResult(tuple(reqs), time.perf_counter() - t0, total)


async def run_batch(client: AsyncClient, metrics_url: str, prompts: Sequence[Prompt], max_tokens: int,
                    tag: str) -> RunResult:
    before = read_counters(metrics_url)
    t0 = time.perf_counter()
    reqs = await asyncio.gather(*(one_request(client, p, max_tokens, f"{tag}-{i}") for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return RunResult(tuple(reqs), wall, read_counters(metrics_url) - before)


# --- the measurement ---------------------------------------------------------------------------


@dataclass
class Tally:
    """Every run of one (configuration, batch), over rounds."""

    runs: list[RunResult] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)


def order_for(configs: list[BenchConfig], r: int) -> list[BenchConfig]:
    shift = r % len(configs)
    order = configs[shift:] + configs[:shift]
    return order[::-1] if r % 2 else order


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def measure(clusters: dict[str, Cluster], configs: list[BenchConfig], prompts: list[Prompt],
                  args: argparse.Namespace, t_start: float) -> tuple[dict[tuple[str, int], Tally], list[str]]:
    batch_prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    tallies: dict[tuple[str, int], Tally] = defaultdict(Tally)
    mismatches: list[str] = []
    clients = {c.name: AsyncClient(clusters[c.name].url, timeout=args.request_timeout_s) for c in configs}
    murls = {c.name: clusters[c.name].metrics_urls[DECODE_NODE] for c in configs}
    try:
        for c in configs:   # warm-up: every prompt alone, then one batch (not measured, not compared)
            t = time.perf_counter()
            await run_batch1(clients[c.name], murls[c.name], prompts, WARMUP_TOKENS, f"warm-{c.name}")
            await run_batch(clients[c.name], murls[c.name], batch_prompts, WARMUP_TOKENS, f"warm-{c.name}-b")
            print(f"warmed up {c.name} in {time.perf_counter() - t:.1f} s", flush=True)
        last_round_s = 0.0
        args.rounds_run = 0
        for r in range(args.rounds):
            elapsed = time.perf_counter() - t_start
            if r and elapsed + last_round_s > args.budget_s:
                print(f"round {r + 1} skipped: {elapsed:.0f} s + the last round's {last_round_s:.0f} s > "
                      f"--budget-s {args.budget_s:.0f}", flush=True)
                break
            t_round = time.perf_counter()
            order = order_for(configs, r)
            for batch in (1, args.batch):
                ref: RunResult | None = None
                runs: dict[str, RunResult] = {}
                for c in order:
                    tag = f"r{r}-b{batch}-{c.name}"
                    if batch == 1:
                        res = await run_batch1(clients[c.name], murls[c.name], prompts, args.max_tokens, tag)
                    else:
                        res = await run_batch(clients[c.name], murls[c.name], batch_prompts, args.max_tokens, tag)
                    runs[c.name] = res
                    tallies[(c.name, batch)].runs.append(res)
                    tallies[(c.name, batch)].rounds.append(r)
                    reqs = res.requests
                    print(f"round {r + 1} batch {batch} {c.name:6s}: TTFT median "
                          f"{statistics.median(q.ttft_s for q in reqs) * 1e3:7.1f} ms, 2nd token "
                          f"{statistics.median(q.second_token_s for q in reqs) * 1e3:7.1f} ms, "
                          f"{sum(len(q.token_ids) for q in reqs) / res.wall_s:6.1f} tok/s over {res.wall_s:.1f} s",
                          flush=True)
                ref = runs["none"]
                for name, res in runs.items():
                    if name == "none":
                        continue
                    for q, want in zip(res.requests, ref.requests, strict=True):
                        if q.token_ids != want.token_ids:
                            i = first_diff(q.token_ids, want.token_ids)
                            msg = (f"round {r + 1}, batch {batch}, {name}, prompt {q.prompt}: differs from none at "
                                   f"output token {i}: {list(q.token_ids[i:i + 4])} vs {list(want.token_ids[i:i + 4])}")
                            mismatches.append(msg)
                            print(f"!!! MISMATCH {msg}", flush=True)
            last_round_s = time.perf_counter() - t_round
            args.rounds_run = r + 1
    finally:
        for cl in clients.values():
            await cl.close()
    return tallies, mismatches


# --- summary -----------------------------------------------------------------------------------


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs by linear interpolation; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def per_round_ratio(t: Tally, ref: Tally, stat: Any) -> float | None:
    """Median over rounds of stat(run) / stat(none's run of the same round)."""
    ref_by = dict(zip(ref.rounds, ref.runs, strict=True))
    ratios = []
    for r, run in zip(t.rounds, t.runs, strict=True):
        a, b = stat(run), stat(ref_by[r]) if r in ref_by else None
        if a is not None and b:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def pooled_tps(run: RunResult) -> float | None:
    """Batch 1: the run's decode tokens over its decode seconds, pooled over its prompts."""
    toks = sum(len(q.token_ids) - 1 for q in run.requests if q.decode_tps)
    secs = sum((len(q.token_ids) - 1) / q.decode_tps for q in run.requests if q.decode_tps)
    return toks / secs if secs else None


def system_tps(run: RunResult) -> float:
    return sum(len(q.token_ids) for q in run.requests) / run.wall_s


def median_ttft(run: RunResult) -> float:
    return statistics.median(q.ttft_s for q in run.requests)


def median_second(run: RunResult) -> float:
    return statistics.median(q.second_token_s for q in run.requests)


def summarize(configs: list[BenchConfig], batches: Sequence[int],
              tallies: dict[tuple[str, int], Tally]) -> list[dict[str, Any]]:
    rows = []
    for c in configs:
        for b in batches:
            t, ref = tallies[(c.name, b)], tallies[("none", b)]
            reqs = [q for run in t.runs for q in run.requests]
            counters = SpecCounters()
            for run in t.runs:
                counters = counters + run.counters
            tps = [q.decode_tps for q in reqs if q.decode_tps is not None]
            server = [q.server_ttft_s for q in reqs if q.server_ttft_s is not None]
            row: dict[str, Any] = {
                "config": c.name, "label": c.label, "batch": b, "runs": len(t.runs), "requests": len(reqs),
                "ttft_ms": {"median": 1e3 * pct([q.ttft_s for q in reqs], 0.5) if reqs else None,
                            "p90": 1e3 * pct([q.ttft_s for q in reqs], 0.9) if reqs else None},
                "second_token_ms": {"median": 1e3 * pct([q.second_token_s for q in reqs], 0.5) if reqs else None,
                                    "p90": 1e3 * pct([q.second_token_s for q in reqs], 0.9) if reqs else None},
                "server_ttft_ms_median": 1e3 * statistics.median(server) if server else None,
                "per_user_tps": {"median": pct(tps, 0.5), "p10": pct(tps, 0.1)},
                "first_chunk_tokens_mean": statistics.fmean(q.first_chunk_tokens for q in reqs) if reqs else None,
                "ttft_vs_none": per_round_ratio(t, ref, median_ttft),
                "second_token_vs_none": per_round_ratio(t, ref, median_second),
                **counters.summary(),
            }
            if b == 1:
                row["pooled_tps_vs_none"] = per_round_ratio(t, ref, pooled_tps)
                by_wl: dict[str, list[RequestResult]] = defaultdict(list)
                for q in reqs:
                    by_wl[q.workload].append(q)
                row["workloads"] = {}
                for wl, qs in by_wl.items():
                    wc = SpecCounters()
                    for q in qs:
                        assert q.counters is not None
                        wc = wc + q.counters
                    wtps = [q.decode_tps for q in qs if q.decode_tps is not None]
                    row["workloads"][wl] = {
                        "ttft_ms_median": 1e3 * statistics.median(q.ttft_s for q in qs),
                        "second_token_ms_median": 1e3 * statistics.median(q.second_token_s for q in qs),
                        "per_user_tps_median": statistics.median(wtps) if wtps else None, **wc.summary()}
            else:
                sys_tps = [system_tps(run) for run in t.runs]
                row["system_tps_median"] = statistics.median(sys_tps) if sys_tps else None
                row["system_tps_vs_none"] = per_round_ratio(t, ref, system_tps)
            rows.append(row)
    return rows


# --- training ----------------------------------------------------------------------------------

_TQDM = re.compile(r"draft train:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+) \[([\d:]+)<")
_PLAIN = re.compile(r"draft train: step (\d+)/(\d+) loss ([\d.]+)")


def _seconds(hms: str) -> float:
    s = 0.0
    for part in hms.split(":"):
        s = s * 60 + float(part)
    return s


def parse_train_log(path: str) -> dict[str, Any]:
    """The progress bar's elapsed time (the sum over segments: a run and its --resume), the last step,
    and the final JSON line of `pdserve draft train` (held-out agreement)."""
    text = Path(path).read_text(errors="replace")
    segments: list[float] = []   # the last elapsed seconds of each bar
    last_elapsed = -1.0
    step = total = None
    for piece in re.split(r"[\r\n]", text):
        m = _TQDM.search(piece)
        if m:
            e = _seconds(m.group(3))
            if e < last_elapsed or not segments:
                segments.append(e)
            segments[-1] = e
            last_elapsed = e
            step, total = int(m.group(1)), int(m.group(2))
            continue
        m = _PLAIN.search(piece)
        if m:
            step, total = int(m.group(1)), int(m.group(2))
    final = None
    for line in text.splitlines():
        if line.startswith('{"out"'):
            final = json.loads(line)
    return {"log": path, "bar_elapsed_s": sum(segments) if segments else None, "segments": len(segments),
            "step": step, "steps": total, "final": final}


def head_dir(eagle_head: str | None) -> tuple[str | None, str | None]:
    """The eagle head measured (given, or the one shipped for the default model), or why none."""
    if eagle_head is not None:
        return eagle_head, None
    from pdserve.model.eagle_config import load_target_vocab, shipped_head_for
    from pdserve.model.loader import resolve_model

    try:
        return str(shipped_head_for(load_target_vocab(resolve_model(None).path).identity)), None
    except (ValueError, FileNotFoundError) as e:
        return None, str(e)


def training_info(eagle_head: str | None, train_time_s: float | None) -> dict[str, Any]:
    """The head's train_stats as the clusters load it (read before they start); the logs and the
    check that the head did not change under the run are added at the end (finish_training_info)."""
    d, why = head_dir(eagle_head)
    info: dict[str, Any] = {"head": d, "head_error": why, "train_stats": None, "config_text": None,
                            "train_time_s_given": train_time_s, "logs": [], "changed_during_run": None}
    if d is not None:
        info["config_text"] = (Path(d) / "config.json").read_text()
        info["train_stats"] = json.loads(info["config_text"]).get("train_stats")
        weights = Path(d) / "model.safetensors"
        info["weights_mb"] = weights.stat().st_size / 2**20 if weights.is_file() else None
    return info


def finish_training_info(info: dict[str, Any], logs: Sequence[str]) -> dict[str, Any]:
    info["logs"] = [parse_train_log(p) for p in logs]
    if info["head"] is not None:   # a training run writing into the head's folder replaces config.json
        info["changed_during_run"] = (Path(info["head"]) / "config.json").read_text() != info["config_text"]
    return info


# --- report ------------------------------------------------------------------------------------

fmt = spec_bench.fmt


def report(rows: list[dict[str, Any]], prompts: list[Prompt], args: argparse.Namespace,
           loadavg: dict[str, list[float]], wall_s: float, mismatches: list[str],
           train: dict[str, Any] | None) -> list[str]:
    b = args.batch
    lines = ["# Speculative hidden-state handoff through `pdserve up` (issue 18)", "",
             f"{wall_s:.0f} s (commit, machine and command at the end). Load average (1/5/15 min) at start "
             f"{loadavg['start']}, at end {loadavg['end']} (a shared machine).",
             "",
             f"One cluster per configuration (1 prefill + 1 decode + router, shm, default model, "
             f"{args.threads_per_node} thread(s) per node, {args.num_blocks} blocks, prefix cache "
             f"{'on' if args.prefix_cache else 'off'}), all up at once; greedy, EOS ignored, {args.max_tokens} output "
             f"tokens; {args.rounds_run} rounds of --rounds {args.rounds} (--budget-s {args.budget_s:.0f}), "
             "configurations alternating in a rotating order. TTFT and time to the second token: the client's, "
             "from send to the chunk carrying the token; per-user TPS: (tokens - 1) / (last - first token); "
             f"batch {b}: system TPS = tokens / (first send -> last finish). x none: the median over rounds of the "
             "per-round ratio. Acceptance from the decode node's counters: rate = accepted / draft tokens; length "
             "= 1 + accepted / drafts; first-step tokens = tokens of each request's first decode step after the "
             "transfer.", "",
             "Prompts: " + ", ".join(f"{p.name} ({p.workload}, {len(p.token_ids)} tokens)" for p in prompts), "",
             "Greedy outputs equal none's, token for token, in every run: "
             + ("yes" if not mismatches else f"NO: {len(mismatches)} mismatches (below)"), ""]
    for batch in (1, b):
        lines += [f"## Batch {batch}", "",
                  "| config | TTFT ms med / p90 | x none | 2nd token ms med / p90 | x none | server TTFT ms | "
                  "per-user TPS med / p10 | " + ("pooled TPS x none" if batch == 1 else "system TPS | x none") +
                  " | accept rate | accept len | per position | first-step tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if batch == 1 else "---:|---:|") +
                  "---:|---:|---|---:|"]
        for r in (r for r in rows if r["batch"] == batch):
            tp = (f"{fmt(r['pooled_tps_vs_none'], '.2f', 'x')}" if batch == 1 else
                  f"{fmt(r['system_tps_median'], '.1f')} | {fmt(r['system_tps_vs_none'], '.2f', 'x')}")
            lines.append(
                f"| {r['label']} | {fmt(r['ttft_ms']['median'], '.0f')} / {fmt(r['ttft_ms']['p90'], '.0f')} | "
                f"{fmt(r['ttft_vs_none'], '.2f', 'x')} | {fmt(r['second_token_ms']['median'], '.0f')} / "
                f"{fmt(r['second_token_ms']['p90'], '.0f')} | {fmt(r['second_token_vs_none'], '.2f', 'x')} | "
                f"{fmt(r['server_ttft_ms_median'], '.0f')} | {fmt(r['per_user_tps']['median'], '.1f')} / "
                f"{fmt(r['per_user_tps']['p10'], '.1f')} | {tp} | {fmt(r['acceptance_rate'])} | "
                f"{fmt(r['mean_acceptance_length'])} | {' '.join(f'{x:.2f}' for x in r['per_pos']) or '-'} | "
                f"{fmt(r['first_step_tokens'])} |")
        lines.append("")
    wls = list(dict.fromkeys(p.workload for p in prompts))
    lines += ["## Batch 1 by workload", "",
              "| config | " + " | ".join(f"{w}: TTFT / 2nd token ms, TPS, accept len, first-step tokens" for w in wls)
              + " |", "|---|" + "---|" * len(wls)]
    for r in (r for r in rows if r["batch"] == 1):
        cells = []
        for w in wls:
            x = r["workloads"].get(w)
            cells.append("-" if x is None else
                         f"{fmt(x['ttft_ms_median'], '.0f')} / {fmt(x['second_token_ms_median'], '.0f')}, "
                         f"{fmt(x['per_user_tps_median'], '.1f')}, {fmt(x['mean_acceptance_length'])}, "
                         f"{fmt(x['first_step_tokens'])}")
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    if train is None:
        return lines + ([""] + ["## MISMATCHES", ""] + [f"- {m}" for m in mismatches] if mismatches else [])
    lines += ["", "## Training of the eagle head (`pdserve draft train`)", ""]
    if train["head"] is None:
        lines.append(f"No head: {train['head_error']}")
    else:
        st = train["train_stats"] or {}
        lines.append(f"Head {train['head']} ({fmt(train.get('weights_mb'), '.1f')} MB of weights). train_stats "
                     "at the start of the run: " + (", ".join(f"{k} {v}" for k, v in st.items()) if st else "none")
                     + ".")
        if train["changed_during_run"]:
            lines.append("WARNING: the head's config.json changed during the run (a training run writing there?): "
                         "the clusters measured the head as it was at their start, the stats above.")
    if train["train_time_s_given"] is not None:
        lines.append(f"Training wall time as given on the command line (--train-time-s): "
                     f"{train['train_time_s_given']:.0f} s.")
    for log in train["logs"]:
        fin = log["final"] or {}
        lines.append(f"- log {log['log']}: progress bar {fmt(log['bar_elapsed_s'], '.0f', ' s')} over "
                     f"{log['segments']} segment(s), step {log['step']}/{log['steps']}"
                     + (f"; final: {json.dumps(fin)}" if fin else "; no final line (still running or stopped)"))
    if mismatches:
        lines += ["", "## MISMATCHES", ""] + [f"- {m}" for m in mismatches]
    return lines


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="none,ngram,draft,eagle,eagle-nohist",
                   help="comma list of none, ngram, draft, eagle, eagle-nohist (none always runs)")
    p.add_argument("--eagle-head", default=None,
                   help="a head directory (pdserve draft train); default: the shipped one")
    p.add_argument("--train-log", action="append", default=[], help="a `pdserve draft train` log (repeatable)")
    p.add_argument("--train-time-s", type=float, default=None,
                   help="the training's wall time when neither train_stats nor the log has it (reported as given)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=1200.0,
                   help="no round starts that would (by the last round's time) end the run after this")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests of the batch phase")
    p.add_argument("--threads-per-node", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per node")
    p.add_argument("--prefix-cache", action="store_true", help="keep the nodes' prefix cache on (default off)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--model", default=None, help="the target checkpoint (default: pdserve's default model; "
                                                 "the prompts need its tokenizer)")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--update", action="store_true", help="write eagle_handoff.md/.json into --results-dir")
    add_results_args(p, "spec")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 2 or args.batch < 2:
        p.error(f"need --rounds >= 1, --max-tokens >= 2, --batch >= 2 (got {args.rounds}, {args.max_tokens}, "
                f"{args.batch})")
    if args.eagle_head is not None and not (Path(args.eagle_head) / "config.json").is_file():
        p.error(f"--eagle-head {args.eagle_head!r}: no config.json there")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    loadavg = {"start": [round(x, 2) for x in os.getloadavg()]}
    t_start = time.perf_counter()
    known = all_configs(args.eagle_head)
    want = {"none", *(s.strip() for s in args.configs.split(",") if s.strip())}
    unknown = sorted(want - {c.name for c in known})
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(c.name for c in known)}")
    configs = [c for c in known if c.name in want]
    prompts = build_prompts(args.model)
    # read before the clusters start: what they load (a training run may rewrite the head meanwhile)
    heads = want & {"eagle", "eagle-nohist"}
    train = training_info(args.eagle_head, args.train_time_s) if heads or args.train_log else None
    if heads and train is not None and train["head"] is None:
        raise SystemExit(f"config eagle: {train['head_error']} (or pass --eagle-head DIR)")
    engine_args = () if args.prefix_cache else ("--no-prefix-cache",)
    clusters: dict[str, Cluster] = {}
    with contextlib.ExitStack() as stack:
        for c in configs:
            t = time.perf_counter()
            cl = Cluster(prefill=1, decode=1, port=0, provider="shm", threads_per_node=args.threads_per_node,
                         model=args.model, num_blocks=args.num_blocks, engine_args=engine_args + c.engine_args,
                         speculative_config=c.spec,
                         startup_timeout_s=args.startup_timeout_s)
            stack.enter_context(cl)
            clusters[c.name] = cl
            print(f"cluster {c.name} up in {time.perf_counter() - t:.0f} s ({cl.url}, logs {cl.log_dir})", flush=True)
        tallies, mismatches = asyncio.run(measure(clusters, configs, prompts, args, t_start))
    rows = summarize(configs, (1, args.batch), tallies)
    if train is not None:
        train = finish_training_info(train, args.train_log)
    loadavg["end"] = [round(x, 2) for x in os.getloadavg()]
    lines = report(rows, prompts, args, loadavg, time.perf_counter() - t_start, mismatches, train)
    print("\n" + "\n".join(lines), flush=True)
    if mismatches:
        print(f"\n!!! {len(mismatches)} MISMATCHES between speculative and plain greedy output !!!", flush=True)
    if args.update:
        payload = {"load_average": loadavg, "config": {k: v for k, v in vars(args).items() if k != "results_dir"},
                   "configs": [asdict(c) for c in configs],
                   "prompts": [{"name": p.name, "workload": p.workload, "prompt_tokens": len(p.token_ids)}
                               for p in prompts],
                   "rows": rows, "mismatches": mismatches,
                   "training": None if train is None else {k: v for k, v in train.items() if k != "config_text"}}
        write_results(args.results_dir, "eagle_handoff", payload=payload, lines=lines,
                      argv=None if argv is None else list(argv))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
