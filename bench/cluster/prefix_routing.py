"""Prefix-aware vs least-loaded routing (R3) on a workload of request families sharing long prefixes.

    python -m bench.cluster.prefix_routing [--families 8] [--rounds 4] [--concurrency 4] [--seeds 0,1]

Why colocated nodes: a prefix-cache hit happens in the engine that runs the prefill. In a colocated
cluster that is the decode node the router chose, so the router's policy decides the hit rate
directly. In a disaggregated cluster it is the prefill node the decode node chose (by load), and
with one prefill node every policy would hit the same cache; so the comparison runs on two
colocated nodes (D18), the same hardware and workload for both policies.

Workload: `families` long shared prefixes (about `prefix_words` words each, a system prompt or a
document), each asked `rounds` different short questions; the requests go out round by round in a
shuffled order (seeded), `concurrency` at a time, greedy, `max_tokens` each. For each policy a
fresh cluster (2 colocated nodes, empty caches) is started, warmed with one unrelated request per
node, and served by an in-process router whose NodePool runs that policy. Measured: TTFT at the
client (through the router), and the prefix-cache hit rate = prompt tokens the engines found in
their prefix caches / prompt tokens looked up, from the nodes' own /metrics counters
(pdserve:prefix_cache_hits_total, pdserve:prefix_cache_queries_total) before and after the run.
The first round is all misses under either policy (no node has seen any family), so TTFT is also
reported over the later rounds alone ("warm"), where only the routing differs. Each seed is a
different workload; the policies run one after the other per seed, and the summary pools the seeds.

Results: bench/results/cluster/prefix_routing.json (stamped with commit and machine) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.common.results import add_results_args, write_results
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, Client
from pdserve.tools.launcher import Cluster
from router.config import RouterConfig
from router.policy import RoutingConfig, make_policy
from router.server import RouterServer

WORDS = ("river stone market lantern harbor violet engine garden copper meadow signal archive winter "
         "orchard compass thunder ribbon canyon velvet beacon quarry saddle mirror prairie anchor "
         "glacier timber falcon harvest spindle tapestry ember lagoon summit cobalt thistle").split()


def workload(families: int, rounds: int, prefix_words: int, seed: int) -> list[tuple[int, str]]:
    """(family, prompt) in sending order: every family once per round, shuffled within the round."""
    rng = random.Random(seed)
    prefixes = [f"Document {f}. " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) for f in range(families)]
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        fams = list(range(families))
        rng.shuffle(fams)
        for f in fams:
            order.append((f, f"{prefixes[f]}\nQuestion {r}: which word comes after the {r + 3}th {WORDS[r]}?"))
    return order


def scrape(url: str) -> dict[str, float]:
    """Every sample of a node's /metrics summed over its labels, by sample name."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def warm(cluster: Cluster) -> None:
    """One unrelated request straight to each node (not through the router: its index stays empty)."""
    for address in cluster.addresses("colocated"):
        with Client(address, timeout=300) as client:
            client.complete("Warm-up: count to three.", SamplingParams(temperature=0, max_tokens=2))


async def drive(url: str, order: list[tuple[int, str]], concurrency: int, max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(url, timeout=600) as client:
        async def one(i: int, family: int, prompt: str) -> dict:
            async with gate:
                t0 = time.monotonic()
                first = None
                node = ""
                usage = None
                async for chunk in client.generate(prompt, params, request_id=f"bench-{i}"):
                    if first is None and chunk.token_ids:
                        first = time.monotonic()
                    if chunk.finish_reason:
                        if chunk.finish_reason != "length":
                            raise RuntimeError(f"request {i} ended with {chunk.finish_reason}: {chunk.error}")
                        node = chunk.timings.decode_node if chunk.timings else ""
                        usage = chunk.usage
                return {"family": family, "node": node, "ttft_s": (first or time.monotonic()) - t0,
                        "e2e_s": time.monotonic() - t0, "prompt_tokens": usage.prompt_tokens if usage else 0,
                        "cached_prompt_tokens": getattr(usage, "cached_prompt_tokens", 0) if usage else 0}

        return await asyncio.gather(*(one(i, f, p) for i, (f, p) in enumerate(order)))


async def serve_policy(cluster: Cluster, policy: str, order, args) -> dict:
    config = RouterConfig(port=0, decode_nodes=tuple(cluster.addresses("colocated")), health_interval_s=0.5)
    router = RouterServer(config)
    router.pool.policy = make_policy(RoutingConfig(policy=policy))
    port = await router.start()
    try:
        t0 = time.monotonic()
        rows = await drive(f"127.0.0.1:{port}", order, args.concurrency, args.max_tokens)
        wall = time.monotonic() - t0
    finally:
        await router.stop(grace=1.0)
    return {"rows": rows, "wall_s": wall}


def run_policy(policy: str, order, args, seed: int) -> dict:
    engine = ("--max-batch-tokens", str(args.max_batch_tokens), *args.engine_args.split())
    with Cluster(colocated=2, port=0, http_port=None, node_metrics=True, num_blocks=args.num_blocks, model=args.model,
                 threads_per_node=args.threads_per_node, engine_args=engine, startup_timeout_s=300,
                 router_health_interval_s=0.5) as cluster:
        warm(cluster)
        nodes = {n: u for n, u in cluster.metrics_urls.items() if n != "router"}
        before = {n: scrape(u) for n, u in nodes.items()}
        result = asyncio.run(serve_policy(cluster, policy, order, args))
        time.sleep(1.5)  # the engines' counters are snapshots taken at least once a second
        after = {n: scrape(u) for n, u in nodes.items()}

    def delta(name: str) -> float:
        return sum(after[n].get(name, 0.0) - before[n].get(name, 0.0) for n in nodes)

    rows = result["rows"]
    for i, r in enumerate(rows):
        r["round"] = i // args.families
    ttfts = sorted(r["ttft_s"] for r in rows)
    warm_ttfts = [r["ttft_s"] for r in rows if r["round"] > 0]
    hits, queries = delta("pdserve:prefix_cache_hits_total"), delta("pdserve:prefix_cache_queries_total")
    by_node: dict[str, int] = {}
    families_on: dict[str, set[int]] = {}
    for r in rows:
        by_node[r["node"]] = by_node.get(r["node"], 0) + 1
        families_on.setdefault(r["node"], set()).add(r["family"])
    return {
        "policy": policy,
        "seed": seed,
        "requests": len(rows),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_queries_tokens": queries,
        "prompt_tokens_computed": delta("pdserve:prompt_tokens_total"),
        "mean_ttft_s": statistics.fmean(ttfts),
        "mean_ttft_warm_rounds_s": statistics.fmean(warm_ttfts) if warm_ttfts else float("nan"),
        "p50_ttft_s": ttfts[len(ttfts) // 2],
        "p90_ttft_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "mean_e2e_s": statistics.fmean(r["e2e_s"] for r in rows),
        "wall_s": result["wall_s"],
        "requests_per_node": by_node,
        "families_per_node": {n: sorted(f) for n, f in families_on.items()},
        "cached_prompt_tokens_reported": sum(r["cached_prompt_tokens"] for r in rows),
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=160, help="words per shared prefix (~1.3 tokens each)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks per node")
    ap.add_argument("--threads-per-node", type=int, default=1)
    ap.add_argument("--max-batch-tokens", type=int, default=256)
    ap.add_argument("--engine-args", default="", help="more engine flags for both nodes, one string")
    ap.add_argument("--policies", default="least-loaded,prefix")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")
    ap.add_argument("--seeds", default="0,1", help="one workload per seed (comma-separated)")
    add_results_args(ap, "cluster")
    args = ap.parse_args()
    load_start = os.getloadavg()
    results = []
    for seed in (int(x) for x in args.seeds.split(",")):
        order = workload(args.families, args.rounds, args.prefix_words, seed)
        for policy in args.policies.split(","):
            print(f"seed {seed}: running {policy} ({len(order)} requests) ...", flush=True)
            results.append(run_policy(policy, order, args, seed))
    summary = [pooled(policy, [r for r in results if r["policy"] == policy]) for policy in args.policies.split(",")]
    header = (f"{'policy':<14} {'seed':>5} {'hit rate':>8} {'mean TTFT':>10} {'warm TTFT':>10} "
              f"{'p50 TTFT':>9} {'p90 TTFT':>9}")
    print("\n" + header)
    for r in results + summary:
        print(f"{r['policy']:<14} {r['seed']:>5} {r['prefix_cache_hit_rate']:>8.1%} {r['mean_ttft_s']:>9.3f}s "
              f"{r['mean_ttft_warm_rounds_s']:>9.3f}s {r['p50_ttft_s']:>8.3f}s {r['p90_ttft_s']:>8.3f}s")
    write_results(args.results_dir, "prefix_routing", payload={
        "load_average_start": load_start, "args": vars(args), "summary": summary, "results": results})
    return 0


def pooled(policy: str, runs: list[dict]) -> dict:
    """Every seed's requests of one policy together (hit rate over all tokens, TTFT over all requests)."""
    rows = [row for r in runs for row in r["rows"]]
    ttfts = sorted(row["ttft_s"] for row in rows)
    warm = [row["ttft_s"] for row in rows if row["round"] > 0]
    hits = sum(r["prefix_cache_hits_tokens"] for r in runs)
    queries = sum(r["prefix_cache_queries_tokens"] for r in runs)
    return {"policy": policy, "seed": "all", "requests": len(rows),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "mean_ttft_s": statistics.fmean(ttfts), "mean_ttft_warm_rounds_s": statistics.fmean(warm),
            "p50_ttft_s": ttfts[len(ttfts) // 2], "p90_ttft_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


if __name__ == "__main__":
    sys.exit(main())
