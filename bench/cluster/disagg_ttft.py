"""TTFT of a disaggregated cluster split into its parts, for prompts of 128, 512 and 2048 tokens.

    python -m bench.cluster.disagg_ttft [--lengths 128,512,2048] [--repeats 3] [--provider shm]

Starts `pdserve up`'s cluster (router + 1 prefill + 1 decode node), then sends one request at a
time (so queueing is only admission) and reads the decode node's server timings:
- queue: received by the decode node until its Prefill call started (admission, page allocation);
- prefill compute: the prefill node's time from receiving the call to its last layer done;
- transfer tail: from then until the decode node's immediate-data count completed (what the
  client waits for beyond the prefill compute itself);
- first decode step: count complete until the first token was ready.
Client TTFT (through the router) is reported too. Results go to bench/results/cluster/disagg_ttft.{md,json}.
Target (issue): transfer tail <= 5% of TTFT at 512 tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from bench.common.cluster import add_cluster_args, one_by_one, stream_timed
from bench.common.results import add_results_args, write_results
from pdserve.engine.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    add_cluster_args(ap)
    add_results_args(ap, "cluster")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(0)
    rows = []
    with one_by_one(args) as (_, client):
        client.complete([rng.randrange(17, 49152) for _ in range(64)], SamplingParams(temperature=0, max_tokens=2))
        for n in lengths:
            samples = []
            for _ in range(args.repeats):
                ids = [rng.randrange(17, 49152) for _ in range(n)]
                streamed = stream_timed(client, ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
                tm = streamed.last.timings
                compute = tm.prefill_time_s - tm.kv_transfer_time_s
                samples.append({
                    "client_ttft_s": streamed.client_ttft_s, "server_ttft_s": tm.time_to_first_token_s,
                    "queue_s": tm.queue_time_s, "prefill_compute_s": compute, "transfer_tail_s": tm.kv_transfer_time_s,
                    "first_decode_step_s": tm.time_to_first_token_s - tm.queue_time_s - tm.prefill_time_s,
                })
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            med["tail_pct_of_ttft"] = 100 * med["transfer_tail_s"] / med["server_ttft_s"]
            rows.append({"prompt_tokens": n, **med, "samples": samples})
            print(f"{n:5d} tokens: TTFT {med['server_ttft_s']*1e3:8.1f} ms = queue {med['queue_s']*1e3:6.1f} + prefill "
                  f"{med['prefill_compute_s']*1e3:8.1f} + transfer tail {med['transfer_tail_s']*1e3:6.1f} "
                  f"({med['tail_pct_of_ttft']:.1f}%) + first decode {med['first_decode_step_s']*1e3:6.1f} ms; "
                  f"client TTFT {med['client_ttft_s']*1e3:8.1f} ms", flush=True)
    lines = ["# Disaggregated TTFT split", "",
             f"Cluster: 1 prefill + 1 decode, provider {args.provider}, "
             f"{args.threads_per_node} thread(s) per node, medians of {args.repeats} sequential requests", "",
             "| prompt tokens | server TTFT ms | queue ms | prefill compute ms | transfer tail ms | tail % of TTFT "
             "| first decode step ms | client TTFT ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['server_ttft_s']*1e3:.1f} | {r['queue_s']*1e3:.1f} "
                     f"| {r['prefill_compute_s']*1e3:.1f} | {r['transfer_tail_s']*1e3:.1f} "
                     f"| {r['tail_pct_of_ttft']:.1f} | {r['first_decode_step_s']*1e3:.1f} "
                     f"| {r['client_ttft_s']*1e3:.1f} |")
    r512 = next((r for r in rows if r["prompt_tokens"] == 512), None)
    if r512:
        ok = r512["tail_pct_of_ttft"] <= 5.0
        lines += ["", f"Target: transfer tail <= 5% of TTFT at 512 tokens: {r512['tail_pct_of_ttft']:.1f}% "
                      f"-> {'MET' if ok else 'MISSED'}"]
    print("\n".join(lines))
    write_results(args.results_dir, "disagg_ttft", payload={"args": vars(args), "rows": rows}, lines=lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
