"""What the TP-invariant blocked fold costs TP 1: paired passes in one engine, the fold switched per pass.

    .venv/bin/python bench/tp_invariant_ab.py [--rounds 8 --prefill-tokens 256 --batch 16 --ctx 64 --steps 3]

One engine (default model, float32, --threads torch threads). Each round, in an order flipped
every round, runs in both modes
- "blocked": o_proj and down_proj summed in their fold blocks (pdserve/model/tp.py; the default),
- "plain": every row-parallel layer's fold block set to its whole input (one block: the kernel's
  unblocked sum, as before the TP-invariant reductions),
a prefill pass of one fresh --prefill-tokens prompt (torch's matmul path) and --steps decode steps
of --batch requests (the C ops path), then reports medians and paired differences. Switching
rebinds the C layer ops (their fold blocks are bound with the weights). Same process, same
weights, same memory: only the fold differs. Greedy tokens of the two modes are compared too
(they may differ where two logits are within float32 rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve import LLM, SamplingParams


def _set_mode(model: object, blocked: bool, folds: dict) -> None:
    for layer in model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.fold_block = folds[id(lin)] if blocked else lin.weight.shape[1]
    model._c_ops = None  # rebind: the C layer ops hold each layer's fold blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    blocks = 2 * args.batch * (args.ctx // 16 + 4) + args.prefill_tokens // 16 + 16
    llm = LLM(num_blocks=blocks, max_batch_tokens=max(args.prefill_tokens, args.batch),
              max_requests_per_batch=args.batch, num_threads=args.threads, allow_block_sharing=False)
    eng, model = llm.engine, llm.engine.model
    folds = {id(lin): lin.fold_block for layer in model.layers for lin in (layer.self_attn.o_proj, layer.mlp.down_proj)}
    vocab = eng.arch.vocab_size
    res: dict[str, list[float]] = {f"{m}_{k}": [] for m in ("blocked", "plain") for k in ("prefill", "decode")}
    agree = {"prefill": 0, "decode": 0}
    n = 0
    for r in range(args.rounds):
        prompt = [(7 * i + 101 * r) % (vocab - 100) + 50 for i in range(args.prefill_tokens)]
        dprompts = [[(13 * i + 31 * j + r) % (vocab - 100) + 50 for i in range(args.ctx)] for j in range(args.batch)]
        toks = {}
        for mode in (("blocked", "plain") if r % 2 == 0 else ("plain", "blocked")):
            _set_mode(model, mode == "blocked", folds)
            n += 1
            t0 = time.perf_counter()
            eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), request_id=f"p{n}")
            out = []
            while eng.has_unfinished_requests():
                out += [o for o in eng.step() if o.finished]
            res[f"{mode}_prefill"].append(time.perf_counter() - t0)
            params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
            reqs = [eng.add_request(q, params, request_id=f"d{n}-{j}") for j, q in enumerate(dprompts)]
            while any(not q.output_token_ids for q in reqs):
                eng.step()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            while eng.has_unfinished_requests():
                eng.step()
            res[f"{mode}_decode"].append(statistics.median(times))
            toks[mode] = (list(out[0].completion.token_ids), [list(q.output_token_ids) for q in reqs])
        agree["prefill"] += toks["blocked"][0] == toks["plain"][0]
        agree["decode"] += toks["blocked"][1] == toks["plain"][1]
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in res.items()), flush=True)
    _set_mode(model, True, folds)
    print(f"rounds {args.rounds}, threads {args.threads}, prefill {args.prefill_tokens} tokens, decode batch "
          f"{args.batch} x ctx {args.ctx}, {args.steps} steps")
    for k in ("prefill", "decode"):
        b, pl = res[f"blocked_{k}"], res[f"plain_{k}"]
        diffs = sorted((x - y) * 1e3 for x, y in zip(b, pl, strict=True))
        print(f"{k}: blocked {statistics.median(b) * 1e3:.1f} ms, plain {statistics.median(pl) * 1e3:.1f} ms, paired "
              f"blocked - plain median {statistics.median(diffs):+.1f} ms (min {diffs[0]:+.1f}, max {diffs[-1]:+.1f}); "
              f"same greedy tokens in {agree[k]}/{args.rounds} rounds")


if __name__ == "__main__":
    main()
