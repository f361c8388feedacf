"""The draft head's prompt history on a decode node (issue 18): what each way of getting it costs.

    python -m bench.spec.context_history [--repeats 200] [--update]

A decode node's eagle head needs its own rows (K/V of one layer) for the prompt's last
EAGLE_HISTORY_ROWS positions. Two ways:
- A, built (kv_messenger.context, `--context-history-rows 128`): the prefill node hands over the
  target's final-norm hidden states of those positions in the context record ([128, hidden]
  float32 more per record), and the decode node computes the head's rows from them
  (EagleDrafts.seed_history: EagleHead.history_kv, then a write into its pool) before the first
  draft. Prefill nodes need no head: any head on the decode side works with the same fleet.
- B, not built: the prefill node runs the head's history_kv itself and ships the rows it yields
  ([128, 2, kv_heads, head_dim] float32), which the decode node copies into its pool. It moves
  the same compute to the prefill side (on the critical path there too: after the last layer,
  before the record is written) and ships fewer bytes, but every prefill node must hold the head
  its decode nodes draft with.

Both put the same work on the path to the first token except for the size of the record (and
where the head's compute runs: the decode node's engine thread in A), so the difference in TTFT
between them is the extra bytes' cost: encoding and checking a bigger record (measured
here, with a record of B's size as the stand-in, history rows of equal bytes) and writing it over
the fabric (bench/results/fabric/fabric.md's bandwidth at that size). The head's compute, measured here
too, is what both pay once. TTFT through clusters with and without the history:
bench/results/spec/eagle_handoff.md (eagle vs eagle-nohist).

One process, the default model's sizes (hidden 576, top-k 32) and its shipped head, float32,
`torch.set_num_threads(1)` (a node's thread), medians over --repeats.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from bench.common.results import add_results_args, write_results
from kv_messenger.context import ContextCodec, ExpectedRecord, TransferIdentity
from pdserve.engine.spec_decode.config import EAGLE_HISTORY_ROWS
from pdserve.model.eagle_config import load_target_vocab, shipped_head_for
from pdserve.model.eagle_head import EagleHead
from pdserve.model.loader import resolve_model

TOP_K = 32


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--update", action="store_true", help="write context_history.md into --results-dir")
    add_results_args(p, "spec")
    args = p.parse_args()
    torch.set_num_threads(1)
    vocab = load_target_vocab(str(resolve_model(None).path))
    head = EagleHead.load(shipped_head_for(vocab.identity), vocab).eval()
    c = head.config
    H, W = c.hidden_size, EAGLE_HISTORY_ROWS
    kv_bytes = W * 2 * c.num_kv_heads * c.head_dim * 4               # B's rows
    b_rows = math.ceil(kv_bytes / (H * 4))                           # history rows of the same bytes
    ident = TransferIdentity("req", "e" * 32, 0, 1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab.identity.vocab_size, generator=g)
    rows_out = []
    for name, n in (("none (v2 body)", 0), (f"B's size ({kv_bytes // 1024} KiB of head K/V)", b_rows),
                    (f"A: {W} hidden states", W)):
        codec = ContextCodec(H, TOP_K, history_rows=n)
        hidden = torch.randn(n + 1, H, generator=g)
        raw = codec.encode(hidden, logits, ident, 500)
        expect = ExpectedRecord(ident, 500)
        enc = median_ms(lambda codec=codec, hidden=hidden: codec.encode(hidden, logits, ident, 500), args.repeats)
        dec = median_ms(lambda codec=codec, raw=raw, expect=expect: codec.decode_bytes(raw, expect), args.repeats)
        rows_out.append((name, codec.slot_nbytes, enc, dec))
    toks = torch.randint(vocab.identity.vocab_size, (W,), generator=g)
    hid = torch.randn(W, H, generator=g)
    pos = torch.arange(400, 400 + W)
    compute = median_ms(lambda: head.history_kv(toks, hid, pos), args.repeats)
    pool = torch.zeros(2, 64, c.num_kv_heads, 16, c.head_dim)          # [K/V, pages, kv_heads, page, head_dim]
    k, v = head.history_kv(toks, hid, pos)
    pages, offs = (pos // 16) % 64, pos % 16

    def write() -> None:
        pool[0][pages, :, offs] = k
        pool[1][pages, :, offs] = v

    copy = median_ms(write, args.repeats)
    extra = rows_out[2][1] - rows_out[1][1]
    lines = [
        "# A decode node's draft-head history: hidden states handed over (A) vs head K/V shipped (B)",
        "",
        f"1 thread, medians of {args.repeats} (commit, machine and command at the end).",
        "",
        "| context record | slot bytes | encode ms | decode + check ms |",
        "|---|---:|---:|---:|",
        *(f"| {n} | {b:,} | {e:.3f} | {d:.3f} |" for n, b, e, d in rows_out),
        "",
        f"The head's rows for {W} positions (both ways pay it once, A on the decode side, B on the prefill "
        f"side): history_kv {compute:.3f} ms, writing them into the pool {copy:.3f} ms.",
        "",
        f"A's record is {extra:,} bytes larger than B's would be: over shm at 256 KiB writes (normal pages, "
        f"~3.9 GB/s, bench/results/fabric/fabric.md) ~{extra / 3.9e9 * 1e6:.0f} us, over tcp;ofi_rxm (~2.5 GB/s) "
        f"~{extra / 2.5e9 * 1e6:.0f} us, plus the encode/decode difference above; against a TTFT of "
        "~100-500 ms at batch 1 (bench/results/spec/eagle_handoff.md): B would save well under a millisecond "
        "of a first token. Where the head's compute runs differs: in A on the decode node's engine thread, "
        f"which stalls every decoding sequence's next step for those {compute:.1f} ms once per arriving "
        "request; in B on the prefill node, after a prefill that takes far longer. Kept: A, so prefill nodes "
        "hold no head and serve decode nodes of any head (or none); B is the move if decode nodes' engine "
        "time at high arrival rates matters more than that.",
    ]
    print("\n".join(lines))
    if args.update:
        write_results(args.results_dir, "context_history", lines=lines)


if __name__ == "__main__":
    main()
