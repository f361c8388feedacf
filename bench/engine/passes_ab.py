"""Paired A/B of the engine's prefill and decode passes between two source trees, alternating.

    python -m bench.engine.passes_ab --old /tmp/tree-before --new . [--rounds 10]

One worker process per tree imports pdserve from that tree (its C modules built in place with
`python setup.py build_ext --inplace`; only the public API, `pdserve.LLM` and `SamplingParams`,
so any two commits work). Each round, in an order flipped every round, each tree runs:
- prefill: one request of --prefill-tokens prompt tokens (a new prompt each round, so no prefix
  cache hit; the same sequence of prompts in both trees), max_tokens=1, as one pass
  (max_batch_tokens = the prompt), timed from add_request to its finished output;
- decode: --batch requests of --ctx prompt tokens, prefilled untimed, then --steps timed decode
  steps (median).
Prints each tree's median per measure and the median of the per-round paired differences
(new - old), and checks that both trees generate the same greedy tokens.

The worker started first (--old) was favoured on the prefill pass whichever tree it ran
(bench/results/ab/restructure_ab.md), so run it both ways round (--old A --new B, then --old B --new A)
and read the two together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_BOUND_S = 900  # the longest a worker may take to answer one command (model load included)


def _worker(args: argparse.Namespace) -> None:
    """Runs with a tree first on sys.path: reads commands on stdin, answers one JSON line each."""
    import torch

    from pdserve import LLM, SamplingParams

    torch.manual_seed(0)
    llm = LLM(num_blocks=args.batch * (args.ctx // 16 + 4) + args.prefill_tokens // 16 + 8,
              max_batch_tokens=max(args.prefill_tokens, args.batch), max_requests_per_batch=args.batch,
              num_threads=args.threads)
    eng = llm.engine
    vocab = eng.arch.vocab_size
    decode_prompts = [[(13 * i + 31 * j) % (vocab - 100) + 50 for i in range(args.ctx)] for j in range(args.batch)]
    n = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        n += 1
        if cmd["op"] == "prefill":
            # a fresh prompt each round (the same sequence in both trees): no prefix-cache hit
            prompt = [(7 * i + 101 * n) % (vocab - 100) + 50 for i in range(args.prefill_tokens)]
            t0 = time.perf_counter()
            eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), request_id=f"p{n}")
            out = []
            while eng.has_unfinished_requests():
                out += [o for o in eng.step() if o.finished]
            dt = time.perf_counter() - t0
            print(json.dumps({"s": dt, "tokens": list(out[0].completion.token_ids)}), flush=True)
        elif cmd["op"] == "decode":
            params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
            reqs = [eng.add_request(p, params, request_id=f"d{n}-{j}") for j, p in enumerate(decode_prompts)]
            while any(not r.output_token_ids for r in reqs):
                eng.step()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            while eng.has_unfinished_requests():
                eng.step()
            print(json.dumps({"s": statistics.median(times), "tokens": [list(r.output_token_ids) for r in reqs]}),
                  flush=True)


class _Tree:
    def __init__(self, path: str, args: argparse.Namespace) -> None:
        path = os.path.abspath(path)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.path.join(path, "proto")]))
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(args.batch), "--ctx",
                str(args.ctx), "--steps", str(args.steps), "--prefill-tokens", str(args.prefill_tokens)]
        if args.threads is not None:
            argv += ["--threads", str(args.threads)]
        self.path = path
        self.proc = subprocess.Popen(argv, cwd=path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker of {self.path} exited with {self.proc.wait(_BOUND_S)}")
        return json.loads(line)

    def run(self, op: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(_BOUND_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="source tree before the change")
    p.add_argument("--new", help="source tree with the change")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=320, help="prompt tokens of each decode request")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per round")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each engine")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    if not (args.old and args.new):
        p.error("--old and --new are required")
    old, new = _Tree(args.old, args), _Tree(args.new, args)
    results: dict[str, dict[str, list[float]]] = {op: {"old": [], "new": []} for op in ("prefill", "decode")}
    same = True
    try:
        for r in range(args.rounds):
            order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
            for op in ("prefill", "decode"):
                answers = {}
                for name, tree in order:
                    answers[name] = tree.run(op)
                    results[op][name].append(answers[name]["s"])
                same &= answers["old"]["tokens"] == answers["new"]["tokens"]
    finally:
        old.close()
        new.close()
    print(f"old {args.old}\nnew {args.new}\n{args.rounds} rounds, threads {args.threads}, "
          f"prefill {args.prefill_tokens} tokens, decode batch {args.batch} at {args.ctx} tokens "
          f"(median of {args.steps} steps per round)\n")
    print("| pass | old median ms | new median ms | median paired new - old ms | new faster in |")
    print("|---|---:|---:|---:|---:|")
    for op, res in results.items():
        diffs = [n - o for n, o in zip(res["new"], res["old"], strict=True)]
        print(f"| {op} | {statistics.median(res['old']) * 1e3:.2f} | {statistics.median(res['new']) * 1e3:.2f} | "
              f"{statistics.median(diffs) * 1e3:+.2f} | {sum(d < 0 for d in diffs)} of {len(diffs)} rounds |")
    print(f"\ngreedy tokens identical in every round: {same}")


if __name__ == "__main__":
    main()
