"""Paired A/B of the engine's prefill and decode passes between two source trees, alternating.

    python -m bench.engine.passes_ab --old /tmp/tree-before --new . [--rounds 10]

One worker process per tree (bench.common.paired.TreeWorker) imports pdserve from that tree (its
C modules built in place with `python setup.py build_ext --inplace`; only the public API,
`pdserve.LLM` and `SamplingParams`, so any two commits work). Each round, in an order flipped
every round, each tree runs:
- prefill: one request of --prefill-tokens prompt tokens (a new prompt each round, so no prefix
  cache hit; the same sequence of prompts in both trees), max_tokens=1, as one pass
  (max_batch_tokens = the prompt), timed from add_request to its finished output;
- decode: --batch requests of --ctx prompt tokens, prefilled untimed, then --steps timed decode
  steps (median).
Prints each tree's median per measure and the median of the per-round paired differences
(new - old), and checks that both trees generate the same greedy tokens; with --results-dir also
writes passes_ab.md there. Each answer is awaited at most 900 s (a model load included).

The worker started first (--old) was favoured on the prefill pass whichever tree it ran
(bench/results/ab/restructure_ab.md), so run it both ways round (--old A --new B, then --old B --new A)
and read the two together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench.common.paired import Paired, TreeWorker, rounds_in_order, serve_commands
from bench.common.passes import add_pass_args
from bench.common.results import write_results


def _worker(args: argparse.Namespace) -> None:
    """Runs with a tree's pdserve: answers {"op": "prefill" | "decode"} with {"s": seconds, "tokens": ...}."""
    import torch

    from bench.common.passes import decode_steps, prefill_pass, synthetic_prompt
    from pdserve import LLM

    torch.manual_seed(0)
    llm = LLM(model=args.model, num_blocks=args.batch * (args.ctx // 16 + 4) + args.prefill_tokens // 16 + 8,
              max_batch_tokens=max(args.prefill_tokens, args.batch), max_requests_per_batch=args.batch,
              num_threads=args.threads)
    eng = llm.engine
    vocab = eng.arch.vocab_size
    decode_prompts = [synthetic_prompt(vocab, args.ctx, 13, 31 * j) for j in range(args.batch)]
    n = 0

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        nonlocal n
        n += 1
        if cmd["op"] == "prefill":
            # a fresh prompt each round (the same sequence in both trees): no prefix-cache hit
            seconds, tokens = prefill_pass(eng, synthetic_prompt(vocab, args.prefill_tokens, 7, 101 * n), f"p{n}")
            return {"s": seconds, "tokens": tokens}
        if cmd["op"] != "decode":
            raise ValueError(f"unknown command {cmd!r}")
        seconds, all_tokens = decode_steps(eng, decode_prompts, args.steps, f"d{n}")
        return {"s": seconds, "tokens": all_tokens}

    serve_commands(handle)


def _worker_args(args: argparse.Namespace) -> list[str]:
    out = ["--batch", str(args.batch), "--ctx", str(args.ctx), "--steps", str(args.steps),
           "--prefill-tokens", str(args.prefill_tokens), "--threads", str(args.threads)]
    return out + ([] if args.model is None else ["--model", args.model])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="source tree before the change")
    p.add_argument("--new", help="source tree with the change")
    p.add_argument("--rounds", type=int, default=10)
    add_pass_args(p, prefill_tokens=512, batch=32, ctx=320, steps=5, threads=2)
    p.add_argument("--results-dir", type=Path, default=None, help="also write passes_ab.md there (default: print)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    if not (args.old and args.new):
        p.error("--old and --new are required")
    trees = {"old": TreeWorker(args.old, __spec__.name, _worker_args(args)),
             "new": TreeWorker(args.new, __spec__.name, _worker_args(args))}
    results: dict[str, dict[str, list[float]]] = {op: {"old": [], "new": []} for op in ("prefill", "decode")}
    same = True
    try:
        for tree in trees.values():
            tree.ask()   # the ready line: the model is loaded
        for _, order in rounds_in_order(args.rounds, ("old", "new")):
            for op in ("prefill", "decode"):
                answers = {}
                for name in order:
                    answers[name] = trees[name].ask({"op": op})
                    results[op][name].append(answers[name]["s"])
                same &= answers["old"]["tokens"] == answers["new"]["tokens"]
    finally:
        for tree in trees.values():
            tree.close()
    lines = [f"old {args.old}", f"new {args.new}", "",
             f"{args.rounds} rounds, threads {args.threads}, prefill {args.prefill_tokens} tokens, decode batch "
             f"{args.batch} at {args.ctx} tokens (median of {args.steps} steps per round)", "",
             "| pass | old median ms | new median ms | median paired new - old ms | new faster in |",
             "|---|---:|---:|---:|---:|"]
    lines += [Paired.of("old", "new", res["old"], res["new"]).row(op) for op, res in results.items()]
    lines += ["", f"greedy tokens identical in every round: {same}"]
    print("\n".join(lines), flush=True)
    if args.results_dir is not None:
        write_results(args.results_dir, "passes_ab", lines=["# Engine passes, two trees paired", "", *lines])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
