"""Benchmark: one decode step's linear layers, torch F.linear (MKL) vs pdserve's small-row kernel.

For each row count M (the sequences in a decode step), runs every linear layer of SmolLM2-135M
once (30 layers x q|k|v, o, gate|up, down, plus the tied 49152-row lm_head) with both
implementations and prints the step total in ms and the weight-read bandwidth it implies. The
weights (~540 MB float32) are far larger than L3, as in a real step, so each layer's weights
come from memory.

Run (quiet machine; the result depends on what else runs), from the repository root:
    python -m bench.engine.linear_kernels [--threads 1] [--rows 1,2,4,8,16,32] [--record [--tag 2threads]]
--record writes linear_kernels[-TAG].md into --results-dir (default bench/results/engine/). Nothing
waits but the kernels' own work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.common.results import add_results_args, write_results
from pdserve.kernels.ops import linear as ops_linear

HIDDEN, INTER, LAYERS, VOCAB, Q_HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 30, 49152, 9, 3, 64


def _weights(layers: int = LAYERS) -> list[torch.Tensor]:
    """Every weight matrix of one SmolLM2-135M forward (its first `layers` layers), in call order
    (random values)."""
    qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    per_layer = [(qkv, HIDDEN), (HIDDEN, Q_HEADS * HEAD_DIM), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    mats = [torch.randn(n, k) * 0.02 for _ in range(layers) for n, k in per_layer]  # [N, K] each
    mats.append(torch.randn(VOCAB, HIDDEN) * 0.02)                                  # lm_head
    return mats


def _step_ms(fn, mats: list[torch.Tensor], inputs: dict[int, torch.Tensor], repeats: int, clock) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = clock()
        for w in mats:
            fn(inputs[w.shape[1]], w)
        times.append((clock() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch / kernel threads (default 1)")
    parser.add_argument("--rows", default="1,2,3,4,8,12,16,24,32", help="row counts M to measure")
    parser.add_argument("--repeats", type=int, default=7, help="steps per measurement (median reported)")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread",
                        help="thread: this thread's CPU time (default; robust to other processes "
                             "taking turns on the cores, single-threaded runs only); wall: elapsed time")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers' weights (default: all 30)")
    parser.add_argument("--record", action="store_true", help="also write the table: linear_kernels[-TAG].md")
    parser.add_argument("--tag", default=None, help="results file suffix, e.g. 2threads")
    add_results_args(parser, "engine")
    args = parser.parse_args()
    if not ops_linear.available():
        sys.exit(f"kernel not built: {ops_linear.unavailable_reason()}")
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures one thread: use it with --threads 1 (or --clock wall)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    mats = _weights(args.layers)
    weight_bytes = sum(w.numel() * 4 for w in mats)
    load_before = os.getloadavg()[0]
    lines = [
        f"# Linear layers of one SmolLM2-135M decode step ({weight_bytes / 1e6:.0f} MB float32 weights)",
        "",
        f"{args.layers} layers, threads {args.threads}, median of {args.repeats} steps, {args.clock} clock "
        "(commit, machine and command at the end).",
        "",
        "| rows M | F.linear (MKL) ms | small kernel ms | speed-up | kernel GB/s of weights | kernel ms / M=1 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines[:3]))
    print(f"{'M':>4} {'F.linear ms':>12} {'kernel ms':>10} {'x':>6} {'GB/s':>6} {'vs M=1':>7}")
    base = None
    for m in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(m, k) for k in {w.shape[1] for w in mats}}  # [M, K]
        mkl = statistics.median(_step_ms(F.linear, mats, inputs, args.repeats, clock))
        ours = statistics.median(_step_ms(ops_linear.small_linear, mats, inputs, args.repeats, clock))
        base = base or ours
        gbs = weight_bytes / ours / 1e6
        print(f"{m:>4} {mkl:>12.1f} {ours:>10.1f} {mkl / ours:>6.2f} {gbs:>6.1f} {ours / base:>7.2f}")
        lines.append(f"| {m} | {mkl:.1f} | {ours:.1f} | {mkl / ours:.2f}x | {gbs:.1f} | {ours / base:.2f} |")
    load_after = os.getloadavg()[0]
    tail = f"Load average (1 min) before {load_before:.2f}, after {load_after:.2f}."
    print(tail)
    if args.record:
        stem = "linear_kernels" + (f"-{args.tag}" if args.tag else "")
        write_results(args.results_dir, stem, lines=[*lines, "", tail])


if __name__ == "__main__":
    main()
