"""Teacher-forced top-1 agreement of eagle heads with the target on the spec-decode bench's
prompts (bench.spec.decode workloads: text no shipped head was trained on), issue 18.

    python -m bench.spec.eagle_agreement HEAD_DIR [HEAD_DIR ...]

For each prompt, transformers writes up to 64 greedy tokens (stopping at EOS) and gives its
final-norm hidden state at every position; each head then drafts one token from (h_t, x_{t+1})
at every output position, as the engine's proposer drafts (no head history), and the share that
equals the target's x_{t+2} is printed per workload. This is the acceptance of a first greedy
draft token, without an engine in the way. Nothing here waits but its own computation.
"""

from __future__ import annotations

import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

import spec_decode as sd
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine.spec_decode.eagle import EagleHead, load_target_vocab
from pdserve.model.loader import resolve_model


def main(dirs: list[str]) -> None:
    if not dirs:
        raise SystemExit(__doc__)
    torch.set_num_threads(2)
    path = str(resolve_model(None).path)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = load_target_vocab(path)
    heads = {d: EagleHead.load(d, vocab).eval() for d in dirs}
    for wl, prompts in sd.workloads(tok).items():
        tally = {d: [0, 0] for d in heads}
        for p in prompts:
            ids = list(p.token_ids)
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0].tolist()
                hs = hf(torch.tensor([out]), output_hidden_states=True).hidden_states[-1][0]   # [L, H]
            for d, head in heads.items():
                for t in range(len(ids) - 1, len(out) - 2):
                    tally[d][0] += int(head.draft(hs[t], out[t + 1], 1, position=t + 1)[0] == out[t + 2])
                    tally[d][1] += 1
        for d, (a, n) in tally.items():
            print(f"{wl}: {d}: {a}/{n} = {a / n:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
