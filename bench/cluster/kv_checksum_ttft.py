"""What --kv-checksum (S7) costs on the TTFT tail: the same prompts, in the same order, through a
1 prefill + 1 decode cluster started without and with the decode node's --kv-checksum.

    python -m bench.cluster.kv_checksum_ttft [--lengths 512,2048] [--repeats 10] [--rounds 2]

Paired: every round starts the cluster off, then on (rounds alternate the order: off/on, on/off,
...), and sends the identical prompts (random token ids, seeded per round and length) one at a
time, 2 tokens each. Per request the decode node's server TTFT (Timings.time_to_first_token_s)
and the client's (through the router); per length and mode the median, p90 and max over every
round, and the median of the paired differences (on - off, same prompt). Results go to
bench/results/cluster/kv_checksum.{md,json}. Not a test: numbers depend on the machine and its load.
Also, in this process, what the hashing alone costs per request (one side; each side hashes the
same bytes once): checksum.kv_runs + crc32c_runs_at over a pool of the default model's geometry
(30 layers, 3 KV heads x 64, float32, 16-token pages), median of 20.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np

from bench.common.cluster import add_cluster_args, one_by_one, percentile, stream_timed
from bench.common.results import add_results_args, write_results
from kv_messenger import checksum
from kv_messenger.plan import KvLayout
from pdserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def hash_ms(n_tokens: int) -> tuple[float, float]:
    """(median ms, MB hashed) for one request of n_tokens prompt tokens, one side."""
    layout = KvLayout(num_layers=30, num_pages=1024, kv_heads=3, page_size=16, head_dim=64, dtype="float32")
    pool = np.random.default_rng(0).integers(0, 256, layout.nbytes, dtype=np.uint8)
    pages = np.random.default_rng(1).permutation(layout.num_pages)[: -(-(n_tokens - 1) // layout.page_size)]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        off, ln = checksum.kv_runs(layout, pages)
        checksum.crc32c_runs(pool, off, ln)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), int(ln.sum()) / 1e6


def run_mode(args, checksum: bool, prompts: dict[int, list[list[int]]]) -> dict[int, list[tuple[float, float]]]:
    """(server TTFT, client TTFT) per prompt, per length."""
    out: dict[int, list[tuple[float, float]]] = {}
    with one_by_one(args, kv_checksum=checksum) as (_, client):
        client.complete(list(range(100, 164)), PARAMS)   # warm-up
        for n, batch in prompts.items():
            rows = out.setdefault(n, [])
            for ids in batch:
                streamed = stream_timed(client, ids, PARAMS)
                rows.append((streamed.last.timings.time_to_first_token_s, streamed.client_ttft_s))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    add_cluster_args(ap)
    add_results_args(ap, "cluster")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    data: dict[bool, dict[int, list[tuple[float, float]]]] = {False: {}, True: {}}
    for rnd in range(args.rounds):
        rng = random.Random(rnd)
        prompts = {n: [[rng.randrange(17, 49152) for _ in range(n)] for _ in range(args.repeats)] for n in lengths}
        for mode in ((False, True) if rnd % 2 == 0 else (True, False)):
            got = run_mode(args, mode, prompts)
            for n, rows in got.items():
                data[mode].setdefault(n, []).extend(rows)
            print(f"round {rnd} checksum={'on' if mode else 'off'}: done", flush=True)
    rows = []
    for n in lengths:
        off, on = data[False][n], data[True][n]
        r = {"prompt_tokens": n, "samples": len(off)}
        for name, xs in (("off", off), ("on", on)):
            srv = [s for s, _ in xs]
            cli = [c for _, c in xs]
            r[name] = {"server_p50_ms": 1e3 * statistics.median(srv), "server_p90_ms": 1e3 * percentile(srv, 0.9),
                       "server_max_ms": 1e3 * max(srv), "client_p50_ms": 1e3 * statistics.median(cli),
                       "client_p90_ms": 1e3 * percentile(cli, 0.9)}
        r["paired_server_delta_p50_ms"] = 1e3 * statistics.median(b[0] - a[0] for a, b in zip(off, on, strict=True))
        r["hash_ms"], r["hash_mb"] = hash_ms(n)
        rows.append(r)
        print(f"{n:5d} tokens: server TTFT p50/p90 off {r['off']['server_p50_ms']:.1f}/{r['off']['server_p90_ms']:.1f} "
              f"ms, on {r['on']['server_p50_ms']:.1f}/{r['on']['server_p90_ms']:.1f} ms; paired delta p50 "
              f"{r['paired_server_delta_p50_ms']:+.1f} ms", flush=True)
    lines = ["# --kv-checksum (S7): TTFT without and with", "",
             f"Cluster: 1 prefill + 1 decode + router, {args.provider}, "
             f"{args.threads_per_node} thread(s) per node, default model, --max-batch-tokens {args.max_batch_tokens}; "
             f"{args.rounds} round(s) x {args.repeats} prompts per length, one request at a time, 2 tokens each.", "",
             "| prompt tokens | n | server TTFT p50 off / on ms | p90 off / on ms | max off / on ms "
             "| client TTFT p50 off / on ms | paired delta p50 ms | hashing alone, one side |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["off"], r["on"]
        lines.append(f"| {r['prompt_tokens']} | {r['samples']} | {a['server_p50_ms']:.1f} / {b['server_p50_ms']:.1f} "
                     f"| {a['server_p90_ms']:.1f} / {b['server_p90_ms']:.1f} "
                     f"| {a['server_max_ms']:.1f} / {b['server_max_ms']:.1f} "
                     f"| {a['client_p50_ms']:.1f} / {b['client_p50_ms']:.1f} "
                     f"| {r['paired_server_delta_p50_ms']:+.1f} | {r['hash_ms']:.2f} ms ({r['hash_mb']:.1f} MB) |")
    write_results(args.results_dir, "kv_checksum", payload={"args": vars(args), "rows": rows}, lines=lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
