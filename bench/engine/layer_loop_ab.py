"""Paired A/B of a batch-32 float32 decode step between two source trees (default model).

    python -m bench.engine.layer_loop_ab --old /tmp/tree-before --new . [--rounds 12 --steps 5]

Starts one worker process per tree (each imports pdserve from its own tree, so the trees need
their C modules built in place), gives each engine the same --batch prompts of --ctx token ids,
prefills them, then alternates: `--steps` decode steps of the old tree, `--steps` of the new
tree, `--rounds` times, the order flipped every round (so neither tree always runs first after
the other). Each measured step must be a pure decode step of --batch tokens. Prints per-step
medians, the median of the paired per-round differences (new - old) and whether every
generated token agrees between the trees (greedy decoding: it must).

    python -m bench.engine.layer_loop_ab --old /tmp/tree-before --new . --glue [--rounds 12]

measures the layer loop's own cost instead, which a loaded machine's step times hide: a
30-layer float32 Llama with tiny dimensions (hidden 64, so every kernel takes a few
microseconds) and an attention backend that does nothing, one forward pass of --batch tokens
(the C-op path), the minimum of 50 passes per tree per round, alternating as above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_BOUND_S = 900  # the longest a worker may take to answer one command (model load + prefill included)


def _worker(batch: int, ctx: int, max_tokens: int, threads: int | None) -> None:
    """Runs in a tree's directory: reads commands on stdin, answers one JSON line each."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    threads_opt = {} if threads is None else {"num_threads": threads}
    engine = LLMEngine(EngineConfig.from_options(max_batch_tokens=512, max_requests_per_batch=batch, **threads_opt))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request([100 + (7 * s + 13 * i) % 20000 for i in range(ctx)], params)
                for s in range(batch)]
    while any(not r.output_token_ids for r in requests):  # prefill (chunked) until every request sampled once
        engine.step()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            times = []
            for _ in range(int(cmd[1])):
                before = engine.num_forward_tokens
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
                if engine.num_forward_tokens - before != batch:
                    raise RuntimeError(f"step ran {engine.num_forward_tokens - before} tokens, "
                                       f"not a batch-{batch} decode")
            print(json.dumps({"times": times}), flush=True)
        elif cmd[0] == "tokens":
            print(json.dumps({"tokens": [r.output_token_ids for r in requests]}), flush=True)
            return


def _glue_worker(batch: int) -> None:
    """--glue: the layer loop of a tiny 30-layer model around a no-op attention backend."""
    import torch
    from transformers import LlamaConfig

    from pdserve.model.arch import ModelArch
    from pdserve.model.registry import build_model

    class NoAttention:  # returns q as the attention output: contiguous float32 [T, Hq, D]
        def forward(self, q, k, v, k_pool, v_pool, plan, scale):
            return q

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = build_model(ModelArch.from_hf_config(cfg), cfg, torch.float32, 256)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    ids = torch.arange(batch) % 1000                                   # [T]
    pos = torch.arange(batch) + 100                                    # [T]
    pools = [torch.empty(0)] * 30
    last = torch.arange(batch)
    backend = NoAttention()
    logits, _ = model(ids, pos, pools, pools, backend, None, last)
    print(json.dumps({"ready": True, "checksum": float(logits.double().sum())}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] != "run":
            return
        times = []
        for _ in range(int(cmd[1])):
            t0 = time.perf_counter()
            model(ids, pos, pools, pools, backend, None, last)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times}), flush=True)


class _Tree:
    def __init__(self, path: str, args: argparse.Namespace) -> None:
        self.path = os.path.abspath(path)
        env = dict(os.environ, PYTHONPATH=self.path)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(args.batch), "--ctx",
               str(args.ctx), "--max-tokens", str(args.rounds * args.steps + 64)] + (["--glue"] if args.glue else [])
        cmd += [] if args.threads is None else ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, cwd=self.path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def ask(self, command: str | None = None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=_BOUND_S):
                raise TimeoutError(f"worker of {self.path} gave no answer to {command!r} within {_BOUND_S} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker of {self.path} exited (code {self.proc.wait(timeout=30)})")
        return json.loads(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="source tree before the change")
    p.add_argument("--new", help="source tree with the change")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="decode steps per tree per round")
    p.add_argument("--glue", action="store_true", help="the layer loop's own cost (see above)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of each engine (default: torch's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if args.glue:
            _glue_worker(args.batch)
        else:
            _worker(args.batch, args.ctx, args.max_tokens, args.threads)
        return 0
    if args.glue:
        return _glue_main(args)
    if not args.old or not args.new:
        p.error("--old and --new are required")
    trees = {"old": _Tree(args.old, args), "new": _Tree(args.new, args)}
    for name, tree in trees.items():  # one at a time: loading both at once would skew nothing, but halves the cores
        tree.ask()
        print(f"{name}: {tree.path} ready", flush=True)
    steps: dict[str, list[float]] = {"old": [], "new": []}
    diffs = []
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        medians = {}
        for name in order:
            times = trees[name].ask(f"run {args.steps}")["times"]
            steps[name] += times
            medians[name] = statistics.median(times)
        diffs.append(medians["new"] - medians["old"])
        print(f"round {r:2d} ({order[0]} first): old {1e3 * medians['old']:7.2f} ms  new {1e3 * medians['new']:7.2f} ms"
              f"  new-old {1e3 * diffs[-1]:+6.2f} ms", flush=True)
    tokens = {name: tree.ask("tokens")["tokens"] for name, tree in trees.items()}
    for tree in trees.values():
        tree.proc.wait(timeout=60)
    old_med, new_med = statistics.median(steps["old"]), statistics.median(steps["new"])
    print(f"batch-{args.batch} decode step, {args.threads or 'default'} threads, "
          f"{args.rounds} rounds x {args.steps} steps per tree, "
          f"context about {args.ctx}..{args.ctx + 16 + args.rounds * args.steps}:")
    print(f"  median step: old {1e3 * old_med:.2f} ms, new {1e3 * new_med:.2f} ms "
          f"({100 * (new_med / old_med - 1):+.1f}%)")
    print(f"  median paired difference (new - old, per round): {1e3 * statistics.median(diffs):+.2f} ms; "
          f"new faster in {sum(d < 0 for d in diffs)} of {len(diffs)} rounds")
    same = tokens["old"] == tokens["new"]
    print(f"  generated tokens identical: {same} ({sum(len(t) for t in tokens['new'])} tokens)")
    return 0 if same else 1


def _glue_main(args: argparse.Namespace) -> int:
    trees = {"old": _Tree(args.old, args), "new": _Tree(args.new, args)}
    sums = {name: tree.ask()["checksum"] for name, tree in trees.items()}
    mins: dict[str, list[float]] = {"old": [], "new": []}
    diffs = []
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for name in order:
            mins[name].append(min(trees[name].ask("run 50")["times"]))
        diffs.append(mins["new"][-1] - mins["old"][-1])
        print(f"round {r:2d} ({order[0]} first): old {1e3 * mins['old'][-1]:6.3f} ms  "
              f"new {1e3 * mins['new'][-1]:6.3f} ms"
              f"  new-old {1e3 * diffs[-1]:+6.3f} ms", flush=True)
    for tree in trees.values():
        tree.proc.stdin.close()
        tree.proc.wait(timeout=60)
    print(f"30-layer layer loop, {args.batch} tokens, no-op attention, min of 50 passes per tree per round, "
          f"{args.rounds} rounds:")
    print(f"  median of the round minima: old {1e3 * statistics.median(mins['old']):.3f} ms, "
          f"new {1e3 * statistics.median(mins['new']):.3f} ms")
    print(f"  median paired difference (new - old): {1e3 * statistics.median(diffs):+.3f} ms; "
          f"new faster in {sum(d < 0 for d in diffs)} of {len(diffs)} rounds")
    print(f"  logits checksum identical: {sums['old'] == sums['new']} ({sums['new']!r})")
    return 0 if sums["old"] == sums["new"] else 1


if __name__ == "__main__":
    sys.exit(main())
