"""Where a batch-16 step's time goes with and without speculation (issue 17: no system-TPS loss
at batch 16): the engine's phases (proposals, schedule, the pass, the update and its sampling)
timed around the engine's own methods, plain vs n-gram K=2 and K=8 (n=1..4), in one engine,
configurations alternating in a rotating order, the first round a warm-up.

    python -m bench.spec.phases [--workload prose|repetition] [--rounds 4 --tokens 32]

Workloads are bench.spec.decode's. 16 requests added at once, greedy, EOS ignored; with
--steady N, N requests of which 16 are in flight at every step (each finished one replaced at once,
as a serving load of concurrency 16 keeps it). The difference matters: a closed batch of 16 drains,
and its system TPS is bound by its slowest sequence's step count: speculation that speeds the
repetitive sequences up leaves the others decoding in ever smaller passes at the end (a 4-sequence
pass costs about half a 16-sequence one on this CPU), so it can only win when every sequence gains. Prints one
line per configuration: system TPS (output tokens / seconds from first add to last finish), the
steps taken, and each phase's milliseconds (medians over rounds); with --passes, the last round's
passes by query-token count (how many, median ms: where a configuration's pass time goes); with --out, appends them to
that file as a markdown table. Greedy outputs must equal plain's (checked). Nothing waits but the
engine's own steps.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import statistics
import time
from typing import Any, Callable

import torch

from bench.common.results import append_section
from bench.spec import decode as sd
from pdserve import LLM, SamplingParams
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.loader import make_speculator

PHASES = ("drafts", "schedule", "execute", "update")   # `sample` runs inside `update`


def timed(acc: dict[str, float], key: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("prose", "repetition"), default="prose")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")
    ap.add_argument("--batch", type=int, default=16, help="requests added at once (in flight with --steady)")
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to append the table to")
    ap.add_argument("--steady", type=int, default=0, metavar="N",
                    help="N requests in all, 16 in flight at every step (a finished one is replaced at once, as "
                         "a serving load of concurrency 16 does) instead of 16 added at once and drained: a "
                         "closed batch's TPS is bound by its slowest sequence's steps (see the docstring)")
    ap.add_argument("--passes", action="store_true",
                    help="also report each configuration's passes of its last round by query-token count: "
                         "how many, and their median milliseconds")
    args = ap.parse_args()
    if args.steady and args.steady < args.batch:
        ap.error(f"--steady {args.steady}: needs at least the {args.batch} requests in flight (--batch)")
    torch.set_num_threads(2)
    llm = LLM(model=args.model, dtype="float32", num_threads=2, num_blocks=1024, max_batch_tokens=512,
              max_requests_per_batch=args.batch,
              kv_prefault=True)
    e = llm.engine
    acc: dict[str, float] = collections.defaultdict(float)
    e._drafts = timed(acc, "drafts", e._drafts)
    e.scheduler.schedule = timed(acc, "schedule", e.scheduler.schedule)
    passes: list[tuple[int, float]] = []   # (query tokens, seconds) of each pass of the current run
    execute = e.runner.execute

    def logged(sched: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return execute(sched, *a, **k)
        finally:
            passes.append((sum(c.num_tokens for c in sched.chunks), time.perf_counter() - t))

    e.runner.execute = timed(acc, "execute", logged)
    e._update = timed(acc, "update", e._update)
    e.sampler.sample = timed(acc, "sample", e.sampler.sample)
    prompts = sd.workloads(llm.tokenizer)[args.workload]
    cfgs = {"plain": None,
            "ngram K=2 n=1..4": SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                                  prompt_lookup_max=4),
            "ngram K=8 n=1..4": SpeculativeConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_min=1,
                                                  prompt_lookup_max=4)}
    specs = {n: None if c is None else make_speculator(c, e.runner) for n, c in cfgs.items()}
    names = list(specs)
    rows: dict[str, list[tuple[float, int, float, dict[str, float]]]] = {n: [] for n in names}
    last_passes: dict[str, str] = {}   # --passes: "query tokens: passes x median ms, ..." of the last round
    load0 = list(os.getloadavg())
    for rnd in range(args.rounds + 1):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        outs: dict[str, list[list[int]]] = {}
        for n in order:
            e.speculator = specs[n]
            acc.clear()
            passes.clear()
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            total = args.steady or args.batch
            stamp = time.time_ns()

            def add(i: int, params=params, stamp=stamp):
                return e.add_request(list(prompts[i % len(prompts)].token_ids), params, request_id=f"ph-{stamp}-{i}")

            reqs = [add(i) for i in range(args.batch)]
            t0 = time.perf_counter()
            steps = 0
            while e.has_unfinished_requests():
                finished = sum(1 for o in e.step() if o.finished)
                steps += 1
                for _ in range(min(finished, total - len(reqs))):   # --steady: keep --batch in flight
                    reqs.append(add(len(reqs)))
            dt = time.perf_counter() - t0
            outs[n] = [list(r.output_token_ids) for r in reqs]
            if rnd:
                rows[n].append((sum(map(len, outs[n])) / dt, steps, dt, dict(acc)))
                by_size: dict[int, list[float]] = collections.defaultdict(list)
                for tokens, sec in passes:
                    by_size[tokens].append(sec * 1e3)
                last_passes[n] = ", ".join(f"{t}: {len(v)} x {statistics.median(v):.1f}"
                                           for t, v in sorted(by_size.items()))
        for n in names:
            if outs[n] != outs["plain"]:
                raise SystemExit(f"MISMATCH: {n} greedy output differs from plain in round {rnd}")
    lines = ["| config | system TPS | x plain (median of paired rounds) | steps | total ms | "
             + " | ".join(f"{p} ms" for p in (*PHASES, "sample")) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * (len(PHASES) + 1)]
    for n in names:
        rs = rows[n]
        ratio = statistics.median(r[0] / p[0] for r, p in zip(rs, rows["plain"], strict=True))
        ph = {k: statistics.median(r[3].get(k, 0.0) for r in rs) * 1e3 for k in (*PHASES, "sample")}
        line = (f"| {n} | {statistics.median(r[0] for r in rs):.1f} | {ratio:.3f}x | "
                f"{statistics.median(r[1] for r in rs):.0f} | {statistics.median(r[2] for r in rs) * 1e3:.0f} | "
                + " | ".join(f"{ph[k]:.0f}" for k in (*PHASES, "sample")) + " |")
        lines.append(line)
        print(line, flush=True)
    if args.passes:
        lines += ["", "Passes of the last round by query tokens (tokens: passes x median ms):", ""]
        lines += [f"- {n}: {last_passes[n]}" for n in names]
        print("\n".join(lines[-len(names):]), flush=True)
    if args.out:
        mode = f"{args.steady} requests, {args.batch} in flight" if args.steady else f"batch {args.batch}"
        steady = (f" --steady {args.steady}" if args.steady else "") + (" --passes" if args.passes else "")
        head = ["", f"## {args.workload}, {mode}, {args.tokens} tokens, {args.rounds} rounds", "",
                f"`python -m bench.spec.phases --workload {args.workload} --rounds {args.rounds} "
                f"--tokens {args.tokens}{steady}`; load average at start {load0}, at end {list(os.getloadavg())}.", ""]
        append_section(args.out, head + lines)


if __name__ == "__main__":
    main()
