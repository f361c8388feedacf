"""TP 2 against TP 1 on this machine, paired and alternating in one process (default model, float32).

    python -m bench.tp.ab [--rounds 6 --prefill-tokens 512 --batch 16 --ctx 128 --steps 5]

Builds two engines in one process: `LLM(tensor_parallel_size=1, num_threads=--threads)` and
`LLM(tensor_parallel_size=2)` (its worker rank pinned to its own core where there are two).
Each round, in an order flipped every round, each engine runs
- prefill: one fresh prompt of --prefill-tokens tokens as one pass (max_tokens=1), timed from
  add_request to its output;
- decode: --batch requests of --ctx tokens prefilled untimed, then --steps timed decode steps
  (median).
torch's thread count is set per engine before each pass (TP 1: --threads; TP 2's leader: the
thread count its group chose). For TP 2 it also records the leader's time inside the row-parallel
folds' collectives (send / recv / broadcast), the all-reduce share of the pass. Prints medians
and checks that the two engines generate the same greedy tokens (they must: bit-identical).
--results-dir also writes tp_ab.md there. Nothing waits but the engines' own steps (and TP 2's
collectives inside them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.common.paired import Paired, rounds_in_order
from bench.common.passes import add_pass_args, decode_steps, prefill_pass, synthetic_prompt
from bench.common.results import write_results
from pdserve import LLM


class _TimedComm:
    """Wraps the leader's GlooComm and sums the seconds spent in its collectives."""

    def __init__(self, comm: object) -> None:
        self.inner, self.rank, self.size, self.seconds = comm, comm.rank, comm.size, 0.0

    def _timed(self, name: str, *args: object) -> None:
        t0 = time.perf_counter()
        getattr(self.inner, name)(*args)
        self.seconds += time.perf_counter() - t0

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._timed("send", t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._timed("recv", t, src)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        self._timed("broadcast", t, src)


def _decode(llm: LLM, prompts: list[list[int]], steps: int, tag: str,
            timed: _TimedComm) -> tuple[float, list[list[int]], float]:
    """(median step seconds, tokens, the leader's mean seconds in collectives per timed step)."""
    comm = [0.0]

    def reset() -> None:
        timed.seconds = 0.0

    def read() -> None:
        comm[0] = timed.seconds / steps

    step, tokens = decode_steps(llm.engine, prompts, steps, tag, before=reset, after=read)
    return step, tokens, comm[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    add_pass_args(p, prefill_tokens=512, batch=16, ctx=128, steps=5, threads=2)
    p.add_argument("--results-dir", type=Path, default=None, help="also write tp_ab.md there (default: print)")
    args = p.parse_args()
    blocks = max(args.batch * (args.ctx // 16 + 4) + args.prefill_tokens // 16 + 8, 512 // 16 + 8)  # max_model_len 512
    opts = dict(num_blocks=blocks, max_batch_tokens=max(args.prefill_tokens, args.batch),
                max_requests_per_batch=args.batch, max_model_len=512, model=args.model)
    tp2 = LLM(tensor_parallel_size=2, **opts)
    tp2_threads = torch.get_num_threads()
    timed = _TimedComm(tp2.engine.tp.comm)
    tp2.engine.model.set_tp_comm(timed)
    tp1 = LLM(num_threads=args.threads, **opts)
    engines = {"tp1": (tp1, args.threads), "tp2": (tp2, tp2_threads)}
    vocab = tp1.engine.arch.vocab_size
    res: dict[str, list[float]] = {k: [] for k in ("tp1_prefill", "tp2_prefill", "tp1_decode", "tp2_decode",
                                                   "tp2_prefill_comm", "tp2_decode_comm")}
    same = True
    for r, order in rounds_in_order(args.rounds, ("tp1", "tp2")):
        prompt = synthetic_prompt(vocab, args.prefill_tokens, 7, 101 * r)
        dprompts = [synthetic_prompt(vocab, args.ctx, 13, 31 * j + r) for j in range(args.batch)]
        toks: dict[str, object] = {}
        for name in order:
            llm, threads = engines[name]
            torch.set_num_threads(threads)
            timed.seconds = 0.0
            s, t_pre = prefill_pass(llm.engine, prompt, f"p{r}")
            res[f"{name}_prefill"].append(s)
            if name == "tp2":
                res["tp2_prefill_comm"].append(timed.seconds)
            d, t_dec, comm = _decode(llm, dprompts, args.steps, f"d{r}", timed)
            res[f"{name}_decode"].append(d)
            if name == "tp2":
                res["tp2_decode_comm"].append(comm)   # mean per timed step
            toks[name] = (t_pre, t_dec)
        same = same and toks["tp1"] == toks["tp2"]
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    lines = [f"rounds {args.rounds}, prefill {args.prefill_tokens} tokens, decode batch {args.batch} x ctx {args.ctx}, "
          f"TP 1 threads {args.threads}, TP 2 leader threads {tp2_threads}, cores {tp2.engine.tp.cpus}"]
    for k in ("prefill", "decode"):   # bench.tp.pairs parses these two lines
        paired = Paired.of("tp1", "tp2", res[f"tp1_{k}"], res[f"tp2_{k}"])
        lines.append(f"{k}: TP1 {med[f'tp1_{k}']:.1f} ms, TP2 {med[f'tp2_{k}']:.1f} ms (paired median TP2 - TP1 "
                     f"{paired.median_diff_s * 1e3:+.1f} ms), TP2 leader in collectives "
                     f"{med[f'tp2_{k}_comm']:.1f} ms")
    lines.append(f"greedy tokens identical: {same}")
    print("\n".join(lines), flush=True)
    tp2.close()
    if args.results_dir is not None:
        write_results(args.results_dir, "tp_ab", lines=["# TP 2 against TP 1, paired in one process", "", *lines])


if __name__ == "__main__":
    main()
