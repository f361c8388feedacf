"""Prefix cache (E12) on the default model: requests that share a long prefix, with and without
block sharing. Reports prefill wall time, prompt tokens computed and the engine's hit rate.

    python -m bench.engine.prefix_cache [--prefix-tokens 1024] [--requests 8] [--threads 2]

Each request is the same prefix plus its own 32-token suffix and generates one token, so the
time is almost all prefill. The first request always computes the prefix; with sharing on, the
others compute only their suffix (plus the page their last token is in). Prints the report as
JSON; --results-dir also writes it there as prefix_cache.json (stamped). Nothing waits but the
engine's own steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common.results import write_results
from pdserve import LLM, SamplingParams


def run(sharing: bool, prefix: list[int], suffixes: list[list[int]], threads: int, model: str | None) -> dict:
    llm = LLM(model=model, num_blocks=1024, page_size=16, max_batch_tokens=512, num_threads=threads,
              allow_block_sharing=sharing)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prefix + suffixes[0]], params)             # the first one fills the cache
    computed0 = eng.num_prompt_tokens_computed
    t0 = time.perf_counter()
    outs = [llm.generate([prefix + s], params)[0].token_ids for s in suffixes[1:]]
    seconds = time.perf_counter() - t0
    m = eng.metrics()
    return {"allow_block_sharing": sharing, "seconds": round(seconds, 3),
            "prompt_tokens_computed": eng.num_prompt_tokens_computed - computed0,
            "hit_rate": round(m.prefix_cache_hit_rate, 3), "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")
    ap.add_argument("--results-dir", type=Path, default=None, help="also write prefix_cache.json there")
    args = ap.parse_args()
    prefix = [(i * 131) % 40000 + 100 for i in range(args.prefix_tokens)]
    suffixes = [[(i * 7 + j * 13) % 40000 + 100 for j in range(32)] for i in range(args.requests)]
    results = [run(s, prefix, suffixes, args.threads, args.model) for s in (False, True)]
    if results[0]["outputs"] != results[1]["outputs"]:
        raise SystemExit("outputs differ between sharing on and off")
    for r in results:
        del r["outputs"]
    report = {"load_avg_1m": os.getloadavg()[0], "prefix_tokens": args.prefix_tokens,
              "requests_timed": args.requests - 1, "runs": results}
    print(json.dumps(report, indent=1))
    if args.results_dir is not None:
        write_results(args.results_dir, "prefix_cache", payload=report)


if __name__ == "__main__":
    main()
