"""Teacher-forced top-1 agreement of eagle heads with the target on the spec-decode bench's
prompts (bench.spec.decode workloads: text no shipped head was trained on), issue 18.

    python -m bench.spec.eagle_agreement HEAD_DIR [HEAD_DIR ...] [--max-new-tokens 64] [--prompts N]

For each prompt, transformers writes up to 64 greedy tokens (stopping at EOS) and gives its
final-norm hidden state at every position; each head then drafts one token from (h_t, x_{t+1})
at every output position, as the engine's proposer drafts (no head history), and the share that
equals the target's x_{t+2} is printed per workload. This is the acceptance of a first greedy
draft token, without an engine in the way. Nothing here waits but its own computation.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common.results import write_results
from bench.spec import decode as sd
from pdserve.model.eagle_config import load_target_vocab
from pdserve.model.eagle_head import EagleHead
from pdserve.model.loader import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="eagle head folders (pdserve draft train --out)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens transformers writes per prompt")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts of each workload (default: all)")
    ap.add_argument("--results-dir", type=pathlib.Path, default=None,
                    help="also write eagle_agreement.md/.json there (default: print only)")
    args = ap.parse_args()
    dirs = args.heads
    torch.set_num_threads(2)
    path = str(resolve_model(None).path)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = load_target_vocab(path)
    heads = {d: EagleHead.load(d, vocab).eval() for d in dirs}
    rows = []
    for wl, prompts in sd.workloads(tok).items():
        tally = {d: [0, 0] for d in heads}
        for p in prompts[:args.prompts]:
            ids = list(p.token_ids)
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                  do_sample=False)[0].tolist()
                hs = hf(torch.tensor([out]), output_hidden_states=True).hidden_states[-1][0]   # [L, H]
            for d, head in heads.items():
                for t in range(len(ids) - 1, len(out) - 2):
                    tally[d][0] += int(head.draft(hs[t], out[t + 1], 1, position=t + 1)[0] == out[t + 2])
                    tally[d][1] += 1
        for d, (a, n) in tally.items():
            print(f"{wl}: {d}: {a}/{n} = {a / n:.3f}")
            rows.append({"workload": wl, "head": d, "agreed": a, "positions": n, "agreement": a / n if n else None})
    if args.results_dir is not None:
        lines = ["# Eagle heads' teacher-forced first-token agreement", "",
                 "| workload | head | agreed / positions | agreement |", "|---|---|---:|---:|"]
        lines += [f"| {r['workload']} | {r['head']} | {r['agreed']}/{r['positions']} | {r['agreement']:.3f} |"
                  for r in rows]
        write_results(args.results_dir, "eagle_agreement", payload={"args": vars(args), "rows": rows}, lines=lines)


if __name__ == "__main__":
    main()
