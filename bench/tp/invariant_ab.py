"""What the TP-invariant blocked fold costs TP 1: paired passes in one engine, the fold switched per pass.

    python -m bench.tp.invariant_ab [--rounds 8 --prefill-tokens 256 --batch 16 --ctx 64 --steps 3]

One engine (default model, float32, --threads torch threads, the default config: at TP 1 its
row-parallel layers sum in one block, which the bench checks first). Each round, in an order
rotated every round, runs in each mode
- "plain": every row-parallel layer's fold block its whole input (one block: the kernel's unblocked
  sum, as before the TP-invariant reductions; what TP 1 runs by default, tp_invariant auto),
- "blocked": o_proj and down_proj summed in their fold blocks (pdserve/model/tp.py; --tp-invariant),
  the torch path taking every block's product from one torch.bmm (pdserve/kernels/ops/linear.py),
- "loop" (--loop): the same blocks, the torch path one F.linear per block (the previous form,
  swapped in for this mode only, to measure what the one bmm saves),
a prefill pass of one fresh --prefill-tokens prompt (torch's matmul path) and --steps decode steps
of --batch requests (the C ops path), then reports medians and paired differences against plain.
Switching rebinds the C layer ops (their fold blocks are bound with the weights). Same process,
same weights, same memory: only the fold differs. Greedy tokens are compared with plain's (they
may differ where two logits are within float32 rounding; blocked and loop must agree exactly).
--results-dir also writes tp_invariant_ab.md there. Nothing waits but the engine's own steps.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import pdserve.kernels.ops.linear as linear_mod
from bench.common.paired import rounds_in_order
from bench.common.passes import add_pass_args, decode_steps, prefill_pass, synthetic_prompt
from bench.common.results import write_results
from pdserve import LLM
from pdserve.model.tp import mlp_fold_block, o_proj_fold_heads

BMM_PARTS = linear_mod._torch_block_parts


def _loop_parts(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:  # [nb, M, N]
    """The previous torch path: one F.linear per block."""
    return torch.stack([F.linear(x[:, k0 : k0 + block], weight[:, k0 : k0 + block])
                        for k0 in range(0, x.shape[1], block)])


def _set_mode(model: object, mode: str, folds: dict) -> None:
    for layer in model.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            lin.fold_block = lin.weight.shape[1] if mode == "plain" else folds[id(lin)]
    linear_mod._torch_block_parts = _loop_parts if mode == "loop" else BMM_PARTS
    model._c_ops = None  # rebind: the C layer ops hold each layer's fold blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    add_pass_args(p, prefill_tokens=256, batch=16, ctx=64, steps=3, threads=2)
    p.add_argument("--results-dir", type=Path, default=None, help="also write tp_invariant_ab.md there")
    p.add_argument("--loop", action="store_true", help="also the per-block F.linear torch path")
    args = p.parse_args()
    modes = ("plain", "blocked", "loop") if args.loop else ("plain", "blocked")
    blocks = 2 * args.batch * (args.ctx // 16 + 4) + args.prefill_tokens // 16 + 16
    llm = LLM(num_blocks=blocks, max_batch_tokens=max(args.prefill_tokens, args.batch),
              max_requests_per_batch=args.batch, num_threads=args.threads, allow_block_sharing=False,
              model=args.model)
    eng, model = llm.engine, llm.engine.model
    a = eng.arch
    plain_default = all(lin.fold_block == lin.weight.shape[1] for layer in model.layers
                        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj))
    print(f"TP 1 default config: tp_invariant={eng.config.tp_invariant!r} -> active "
          f"{eng.config.tp_invariant_active}; every row-parallel layer one block: {plain_default}")
    if not plain_default:
        raise SystemExit("the default TP 1 engine does not sum in one block; 'plain' would not be the default")
    o_block, d_block = o_proj_fold_heads(a.num_heads, a.num_kv_heads) * a.head_dim, mlp_fold_block(a.intermediate_size)
    folds = {id(lin): blk for layer in model.layers
             for lin, blk in ((layer.self_attn.o_proj, o_block), (layer.mlp.down_proj, d_block))}
    vocab = eng.arch.vocab_size
    res: dict[str, list[float]] = {f"{m}_{k}": [] for m in modes for k in ("prefill", "decode")}
    agree = {f"{m}_{k}": 0 for m in modes[1:] for k in ("prefill", "decode")}
    blocked_loop_same = 0
    n = 0
    for r, order in rounds_in_order(args.rounds, modes):
        prompt = synthetic_prompt(vocab, args.prefill_tokens, 7, 101 * r)
        dprompts = [synthetic_prompt(vocab, args.ctx, 13, 31 * j + r) for j in range(args.batch)]
        toks = {}
        for mode in order:
            _set_mode(model, mode, folds)
            n += 1
            seconds, prefill_tokens = prefill_pass(eng, prompt, f"p{n}")
            res[f"{mode}_prefill"].append(seconds)
            step, decode_tokens = decode_steps(eng, dprompts, args.steps, f"d{n}")
            res[f"{mode}_decode"].append(step)
            toks[mode] = (prefill_tokens, decode_tokens)
        for m in modes[1:]:
            agree[f"{m}_prefill"] += toks[m][0] == toks["plain"][0]
            agree[f"{m}_decode"] += toks[m][1] == toks["plain"][1]
        blocked_loop_same += "loop" not in toks or toks["loop"] == toks["blocked"]
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in res.items()), flush=True)
    _set_mode(model, "plain", folds)
    lines = [f"rounds {args.rounds}, threads {args.threads}, prefill {args.prefill_tokens} tokens, decode batch "
          f"{args.batch} x ctx {args.ctx}, {args.steps} steps; blocked == loop tokens in {blocked_loop_same}/"
          f"{args.rounds} rounds"]
    for k in ("prefill", "decode"):
        pl = res[f"plain_{k}"]
        for m in modes[1:]:
            b = res[f"{m}_{k}"]
            diffs = sorted((x - y) * 1e3 for x, y in zip(b, pl, strict=True))
            lines.append(f"{k}: {m} {statistics.median(b) * 1e3:.1f} ms, plain {statistics.median(pl) * 1e3:.1f} ms, "
                         f"paired {m} - plain median {statistics.median(diffs):+.1f} ms (min {diffs[0]:+.1f}, max "
                         f"{diffs[-1]:+.1f}); same greedy tokens as plain in {agree[f'{m}_{k}']}/{args.rounds} rounds")
        if "loop" in modes:
            b, lo = res[f"blocked_{k}"], res[f"loop_{k}"]
            diffs = sorted((x - y) * 1e3 for x, y in zip(b, lo, strict=True))
            lines.append(f"{k}: paired blocked (bmm) - loop median {statistics.median(diffs):+.1f} ms "
                         f"(min {diffs[0]:+.1f}, max {diffs[-1]:+.1f})")
    print("\n".join(lines), flush=True)
    if args.results_dir is not None:
        write_results(args.results_dir, "tp_invariant_ab",
                      lines=["# The TP-invariant blocked fold at TP 1, paired in one engine", "", *lines])


if __name__ == "__main__":
    main()
