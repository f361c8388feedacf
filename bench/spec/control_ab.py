"""Paired A/B of two speculation controls at batch 16 (issue 17: no system-TPS loss where
speculation does not pay): the engine's control (pdserve/engine/spec_decode/control.py) against
another version of that module given by path, both in one engine, runs alternating.

    git show REV:pdserve/engine/spec_decode/control.py > /tmp/old_control.py
    python -m bench.spec.control_ab --old /tmp/old_control.py [--rounds 4 --tokens 48]

Workload: bench.spec.decode's prose prompts (where drafts are mostly rejected), 16 requests
added at once, greedy, EOS ignored, --tokens each. Configurations: plain, and n-gram K=2 n=1..4 and
the 4-layer self-draft K=2, each with the new and the old control (one speculator per
configuration, kept across rounds so its control learns as a server's does; the first round is
a warm-up and not counted). System TPS = output tokens / seconds from first add to last finish;
printed per round and as the median over rounds of the ratio to plain in the same round. Greedy
outputs must equal plain's (checked). Nothing waits but the engine's own steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time

import torch

from bench.common.paired import rounds_in_order
from bench.common.results import write_results
from bench.spec import decode as sd
from pdserve import LLM, SamplingParams
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.loader import make_speculator


def run(engine, spec, prompts, tokens: int, batch: int) -> tuple[float, list[list[int]]]:
    engine.speculator = spec
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.add_request(list(prompts[i % len(prompts)].token_ids), params, request_id=f"ab-{time.time_ns()}-{i}")
            for i in range(batch)]
    while engine.has_unfinished_requests():
        engine.step()
    dt = time.perf_counter() - t0
    outs = [list(r.output_token_ids) for r in reqs]
    return sum(map(len, outs)) / dt, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="path of the other control.py")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")
    ap.add_argument("--batch", type=int, default=16, help="requests added at once")
    ap.add_argument("--results-dir", type=pathlib.Path, default=None,
                    help="also write spec_control_ab.md there (default: print only)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec_ = importlib.util.spec_from_file_location("old_control", args.old)
    old = importlib.util.module_from_spec(spec_)
    sys.modules["old_control"] = old   # dataclasses look their module up while building
    spec_.loader.exec_module(old)   # type: ignore[union-attr]
    llm = LLM(model=args.model, dtype="float32", num_threads=2, num_blocks=1024, max_batch_tokens=512,
              max_requests_per_batch=args.batch,
              kv_prefault=True)
    e = llm.engine
    prompts = sd.workloads(llm.tokenizer)["prose"]
    cfgs = {"ngram-k2-n1": SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                             prompt_lookup_max=4),
            "self-k4-K2": SpeculativeConfig(method="draft_model", num_speculative_tokens=2, self_draft_layers=4)}
    specs = {"plain": None}
    for name, c in cfgs.items():
        for which in ("new", "old"):
            s = make_speculator(c, e.runner)
            if which == "old":
                s.control = old.SpeculationControl()
            specs[f"{name} {which}"] = s
    names = list(specs)
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for rnd, order in rounds_in_order(args.rounds + 1, names):
        tps: dict[str, float] = {}
        outs: dict[str, list[list[int]]] = {}
        for n in order:
            tps[n], outs[n] = run(e, specs[n], prompts, args.tokens, args.batch)
        for n in names:
            if outs[n] != outs["plain"]:
                print(f"MISMATCH: {n} greedy output differs from plain in round {rnd}", flush=True)
        line = ", ".join(f"{n} {tps[n]:.1f}" for n in names)
        print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: system TPS {line}", flush=True)
        if rnd:
            for n in names:
                ratios[n].append(tps[n] / tps["plain"])
    lines = [f"# Speculation control A/B (system TPS at batch {args.batch}, prose)", "",
             f"{args.rounds} rounds (+1 warm-up), {args.tokens} tokens per request, old control {args.old}.", "",
             "| configuration | median x plain | rounds |", "|---|---:|---|"]
    for n in names:
        print(f"{n}: median x plain {statistics.median(ratios[n]):.3f} (rounds: "
              f"{' '.join(f'{r:.3f}' for r in ratios[n])})")
        lines.append(f"| {n} | {statistics.median(ratios[n]):.3f} | {' '.join(f'{r:.3f}' for r in ratios[n])} |")
    if args.results_dir is not None:
        write_results(args.results_dir, "spec_control_ab", lines=lines)


if __name__ == "__main__":
    main()
