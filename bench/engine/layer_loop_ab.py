"""Paired A/B of a batch-32 float32 decode step between two source trees (default model).

    python -m bench.engine.layer_loop_ab --old /tmp/tree-before --new . [--rounds 12 --steps 5]

Starts one worker process per tree (each imports pdserve from its own tree, so the trees need
their C modules built in place), gives each engine the same --batch prompts of --ctx token ids,
prefills them, then alternates: `--steps` decode steps of the old tree, `--steps` of the new
tree, `--rounds` times, the order flipped every round (so neither tree always runs first after
the other). Each measured step must be a pure decode step of --batch tokens. Prints per-step
medians, the median of the paired per-round differences (new - old) and whether every
generated token agrees between the trees (greedy decoding: it must). Workers are
bench.common.paired.TreeWorker processes; each answer is awaited at most 900 s (model load and
prefill included). --results-dir also writes layer_loop_ab.md there.

    python -m bench.engine.layer_loop_ab --old /tmp/tree-before --new . --glue [--rounds 12]

measures the layer loop's own cost instead, which a loaded machine's step times hide: a
30-layer float32 Llama with tiny dimensions (hidden 64, so every kernel takes a few
microseconds) and an attention backend that does nothing, one forward pass of --batch tokens
(the C-op path), the minimum of 50 passes per tree per round, alternating as above.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.paired import Paired, TreeWorker, rounds_in_order, serve_commands
from bench.common.results import write_results


def _worker(batch: int, ctx: int, max_tokens: int, threads: int | None, model: str | None) -> None:
    """Runs with a tree's pdserve: {"op": "run", "steps": N} -> step times; {"op": "tokens"} -> the tokens."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    opts: dict[str, Any] = {} if threads is None else {"num_threads": threads}
    if model is not None:
        opts["model"] = model
    engine = LLMEngine(EngineConfig.from_options(max_batch_tokens=512, max_requests_per_batch=batch, **opts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request([100 + (7 * s + 13 * i) % 20000 for i in range(ctx)], params)
                for s in range(batch)]
    while any(not r.output_token_ids for r in requests):  # prefill (chunked) until every request sampled once
        engine.step()

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "tokens":
            return {"tokens": [r.output_token_ids for r in requests]}
        times = []
        for _ in range(cmd["steps"]):
            before = engine.num_forward_tokens
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            if engine.num_forward_tokens - before != batch:
                raise RuntimeError(f"step ran {engine.num_forward_tokens - before} tokens, not a batch-{batch} decode")
        return {"times": times}

    serve_commands(handle)


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

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        times = []
        for _ in range(cmd["steps"]):
            t0 = time.perf_counter()
            model(ids, pos, pools, pools, backend, None, last)
            times.append(time.perf_counter() - t0)
        return {"times": times}

    serve_commands(handle, ready={"checksum": float(logits.double().sum())})


def _workers(args: argparse.Namespace) -> dict[str, TreeWorker]:
    wargs = ["--batch", str(args.batch), "--ctx", str(args.ctx), "--max-tokens", str(args.rounds * args.steps + 64)]
    wargs += (["--glue"] if args.glue else []) + ([] if args.threads is None else ["--threads", str(args.threads)])
    wargs += [] if args.model is None else ["--model", args.model]
    return {"old": TreeWorker(args.old, __spec__.name, wargs), "new": TreeWorker(args.new, __spec__.name, wargs)}


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
    p.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model; not --glue)")
    p.add_argument("--results-dir", type=Path, default=None, help="also write layer_loop_ab.md there")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if args.glue:
            _glue_worker(args.batch)
        else:
            _worker(args.batch, args.ctx, args.max_tokens, args.threads, args.model)
        return 0
    if not args.old or not args.new:
        p.error("--old and --new are required")
    trees = _workers(args)
    lines, same = (_glue_main if args.glue else _steps_main)(args, trees)
    print("\n".join(lines), flush=True)
    if args.results_dir is not None:
        write_results(args.results_dir, "layer_loop_ab", lines=["# Layer loop A/B, two trees paired", "", *lines])
    return 0 if same else 1


def _steps_main(args: argparse.Namespace, trees: dict[str, TreeWorker]) -> tuple[list[str], bool]:
    for name, tree in trees.items():  # one at a time: loading both at once would skew nothing, but halves the cores
        tree.ask()
        print(f"{name}: {tree.tree} ready", flush=True)
    steps: dict[str, list[float]] = {"old": [], "new": []}
    medians: dict[str, list[float]] = {"old": [], "new": []}
    for r, order in rounds_in_order(args.rounds, ("old", "new")):
        for name in order:
            times = trees[name].ask({"op": "run", "steps": args.steps})["times"]
            steps[name] += times
            medians[name].append(statistics.median(times))
        print(f"round {r:2d} ({order[0]} first): old {1e3 * medians['old'][-1]:7.2f} ms  "
              f"new {1e3 * medians['new'][-1]:7.2f} ms", flush=True)
    tokens = {name: tree.ask({"op": "tokens"})["tokens"] for name, tree in trees.items()}
    for tree in trees.values():
        tree.close()
    paired = Paired.of("old", "new", medians["old"], medians["new"])
    old_med, new_med = statistics.median(steps["old"]), statistics.median(steps["new"])
    same = tokens["old"] == tokens["new"]
    return [f"batch-{args.batch} decode step, {args.threads or 'default'} threads, "
            f"{args.rounds} rounds x {args.steps} steps per tree, "
            f"context about {args.ctx}..{args.ctx + 16 + args.rounds * args.steps}:",
            f"  median step: old {1e3 * old_med:.2f} ms, new {1e3 * new_med:.2f} ms "
            f"({100 * (new_med / old_med - 1):+.1f}%)",
            f"  median paired difference (new - old, per round): {1e3 * paired.median_diff_s:+.2f} ms; "
            f"new faster in {paired.b_faster_rounds} of {paired.rounds} rounds",
            f"  generated tokens identical: {same} ({sum(len(t) for t in tokens['new'])} tokens)"], same


def _glue_main(args: argparse.Namespace, trees: dict[str, TreeWorker]) -> tuple[list[str], bool]:
    sums = {name: tree.ask()["checksum"] for name, tree in trees.items()}
    mins: dict[str, list[float]] = {"old": [], "new": []}
    for r, order in rounds_in_order(args.rounds, ("old", "new")):
        for name in order:
            mins[name].append(min(trees[name].ask({"op": "run", "steps": 50})["times"]))
        print(f"round {r:2d} ({order[0]} first): old {1e3 * mins['old'][-1]:6.3f} ms  "
              f"new {1e3 * mins['new'][-1]:6.3f} ms", flush=True)
    for tree in trees.values():
        tree.close()
    paired = Paired.of("old", "new", mins["old"], mins["new"])
    return [f"30-layer layer loop, {args.batch} tokens, no-op attention, min of 50 passes per tree per round, "
            f"{args.rounds} rounds:",
            f"  median of the round minima: old {1e3 * paired.a_median_s:.3f} ms, new {1e3 * paired.b_median_s:.3f} ms",
            f"  median paired difference (new - old): {1e3 * paired.median_diff_s:+.3f} ms; "
            f"new faster in {paired.b_faster_rounds} of {paired.rounds} rounds",
            f"  logits checksum identical: {sums['old'] == sums['new']} ({sums['new']!r})"], sums["old"] == sums["new"]


if __name__ == "__main__":
    sys.exit(main())
