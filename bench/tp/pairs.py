"""Issue 16's benchmark: disaggregated tensor-parallel pairs (prefill TP A -> decode TP B).

    python -m bench.tp.pairs [--parts a,b,c] [--pairs 1:1,2:1,1:2,2:2] [--lengths 512,2048]
                             [--repeats 512:4,2048:2 | 3] [--max-tokens 4] [--tp-ab-threads 1,2]

(a) TTFT and the KV transfer tail per pair. One cluster per pair (`Cluster(prefill_tp=A, decode_tp=B)`:
    router + 1 prefill + 1 decode node, shm, default model, greedy), all started up front and kept
    up, so the requests interleave: each round sends the same prompt (random ids, seeded per round
    and length) to every pair, one request at a time, in a pair order rotated (and reversed every
    other round) per round, so drift on this shared host spreads over the pairs evenly. Per request:
    the decode node's server TTFT and transfer tail (`ServerTimings.time_to_first_token_s`,
    `.kv_transfer_time_s`: the wait for KV writes after the prefill node's Prefill call returned),
    and the delta of each node's `pdserve:kv_transfer_seconds` histogram sum around the request
    (decode side: Prefill dispatch to last write landed; prefill side: first write posted to last
    completed; each node is idle between requests, so the delta is this request's). Median and p90
    per pair and length. A pair whose cluster does not start, or whose request fails, is reported
    failed with the error (its later requests are not sent) and the run goes on. Every cluster gets
    `--tp-invariant` (the pairs with a TP 2 node get it anyway, see pdserve/tools/launcher.py), so
    the P1->D1 cluster runs the same kernels and every pair must give the same greedy tokens.
(b) RDMA writes per request, HND (this project's layout) against NHD, for the default model's
    geometry: pure arithmetic, no cluster. HND: `kv_messenger.plan.expected_writes` (the shard
    plan's count: pages x layers x (K, V) x runs per page, + 1 context write), cross-checked against
    `plan_transfer`'s runs. NHD pages are `[page_size, kv_heads, head_dim]`: a run that covers the
    whole page of both its source and destination rank is still one contiguous range (one write a
    page), but a head slice of a page (shard mismatch) is page_size separate ranges, so it needs one
    write per token per run.
(c) TP 2 decode step (and prefill) against TP 1 in one process, with the TP 2 leader's time in the
    row-parallel collectives: runs bench.tp.ab (one process per TP 1 thread count in
    --tp-ab-threads) and parses its summary lines.

Results go to bench/results/tp/tp_pairs.{md,json}, stamped with commit and machine. Not a test: the numbers depend
on the machine and its load.

Blocking waits: each cluster's start, --startup-timeout-s; each request, --request-timeout-s (the
client's gRPC deadline); each metrics scrape, 10 s; each bench.tp.ab run, --tp-ab-timeout-s.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.common.cluster import percentile
from bench.common.results import BENCH_DIR, add_results_args, write_results
from kv_messenger.plan import ShardingScheme, expected_writes, num_prompt_pages
from kv_messenger.shard_plan import KvLayout, KvShards, plan_transfer
from pdserve.engine.config import CacheConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.arch import ModelArch
from pdserve.model.loader import load_config, resolve_model
from pdserve.tools.bench.prometheus import Histogram, scrape
from pdserve.tools.client import Client
from pdserve.tools.launcher import Cluster

KV_SECONDS = "pdserve:kv_transfer_seconds"
ERROR_CHARS = 600   # of a failure's message kept in the results (a start failure carries a log tail)


@dataclass(frozen=True)
class Pair:
    prefill_tp: int
    decode_tp: int

    @property
    def name(self) -> str:
        return f"P{self.prefill_tp}->D{self.decode_tp}"

    @classmethod
    def parse(cls, text: str) -> Pair:
        a, sep, b = text.partition(":")
        if not sep or not a.isdigit() or not b.isdigit() or int(a) < 1 or int(b) < 1:
            raise ValueError(f"a TP pair is PREFILL_TP:DECODE_TP with both >= 1, got {text!r}")
        return cls(int(a), int(b))


def default_layout(num_pages: int) -> KvLayout:
    """The default model's KV geometry with the engine's default page size (float32 model: float32 KV)."""
    arch = ModelArch.from_hf_config(load_config(resolve_model(None)))
    return KvLayout(num_layers=arch.num_layers, num_pages=num_pages, kv_heads=arch.num_kv_heads,
                    page_size=CacheConfig().page_size, head_dim=arch.head_dim, dtype="float32")


# --- (b) writes per request ----------------------------------------------------------------------

@dataclass(frozen=True)
class WritesRow:
    pair: str
    prompt_tokens: int
    pages: int
    runs_per_page: int            # HND: one write per run, page, layer and side
    hnd_writes: int               # per request, context write included
    hnd_bytes_per_write: float    # mean over the page writes
    nhd_writes: int
    nhd_bytes_per_write: float
    nhd_over_hnd: float


def writes_row(pair: Pair, prompt_tokens: int, layout: KvLayout) -> WritesRow:
    tokens = prompt_tokens - 1                      # every prompt token but the last is prefilled (D17)
    pages = num_prompt_pages(tokens, layout.page_size)
    src, dst = KvShards.of(layout, pair.prefill_tp), KvShards.of(layout, pair.decode_tp)
    plan = plan_transfer(src, dst, random.Random(0))
    hnd = expected_writes(tokens, layout, ShardingScheme(pair.prefill_tp), ShardingScheme(pair.decode_tp))
    sides = layout.num_layers * 2
    if hnd != len(plan.runs) * pages * sides + 1:
        raise AssertionError(f"{pair.name}: expected_writes {hnd} != {len(plan.runs)} runs x {pages} pages x "
                             f"{sides} + 1 from plan_transfer")
    nhd = 1
    nhd_bytes = 0
    token_bytes = layout.head_dim * {"float32": 4, "bfloat16": 2, "float16": 2}[layout.dtype]  # one head, one token
    for run in plan.runs:
        whole = (run.heads == src.scheme.rank_heads[run.src_rank] and run.heads == dst.scheme.rank_heads[run.dst_rank])
        # whole rank page on both sides: contiguous in NHD too; a head slice: one range per token
        nhd += (pages if whole else tokens) * sides
        nhd_bytes += (pages * run.length if whole else tokens * len(run.heads) * token_bytes) * sides
    hnd_bytes = sum(run.length for run in plan.runs) * pages * sides
    return WritesRow(pair.name, prompt_tokens, pages, len(plan.runs), hnd, hnd_bytes / (hnd - 1), nhd,
                     nhd_bytes / (nhd - 1), nhd / hnd)


# --- (a) TTFT and transfer tail per pair ---------------------------------------------------------

@dataclass
class PairRun:
    pair: Pair
    cluster: Cluster | None = None
    client: Client | None = None
    error: str | None = None
    samples: dict[int, list[dict]] = field(default_factory=dict)   # prompt tokens -> per request
    tokens: dict[str, list[int]] = field(default_factory=dict)     # prompt key -> greedy tokens


def _kv_seconds(url: str) -> float:
    return Histogram.from_text(scrape(url), KV_SECONDS, missing_ok=True).total


def _short(e: BaseException) -> str:
    """The error's start (what failed) and its end (a start failure's log tail ends with the cause)."""
    text = f"{type(e).__name__}: {e}"
    head = ERROR_CHARS // 4
    return text if len(text) <= ERROR_CHARS else f"{text[:head]} ... {text[head - ERROR_CHARS:]}"


def start_pair(run: PairRun, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    t0 = time.monotonic()
    try:
        cluster = Cluster(prefill=1, decode=1, port=0, provider=args.provider, threads_per_node=args.threads_per_node,
                          num_blocks=args.num_blocks, prefill_tp=run.pair.prefill_tp, decode_tp=run.pair.decode_tp,
                          engine_args=("--max-batch-tokens", str(args.max_batch_tokens), "--tp-invariant"),
                          startup_timeout_s=args.startup_timeout_s)
        run.cluster = stack.enter_context(cluster)
        run.client = stack.enter_context(Client(cluster.url, timeout=args.request_timeout_s))
        run.client.complete(list(range(100, 100 + args.warmup_tokens)), SamplingParams(temperature=0, max_tokens=2))
        print(f"{run.pair.name}: serving in {time.monotonic() - t0:.0f} s (warm-up included), logs {cluster.log_dir}",
              flush=True)
    except Exception as e:  # the pair is reported failed with its error, the run goes on
        run.error = f"start: {_short(e)}"
        print(f"{run.pair.name}: FAILED to start: {run.error}", flush=True)


def one_request(run: PairRun, ids: list[int], params: SamplingParams, key: str) -> None:
    assert run.cluster is not None and run.client is not None
    urls = run.cluster.metrics_urls
    dec_url, pre_url = urls["decode-0"], urls["prefill-0"]
    try:
        dec0, pre0 = _kv_seconds(dec_url), _kv_seconds(pre_url)
        t0 = time.monotonic()
        first = last = None
        toks: list[int] = []
        for chunk in run.client.generate(ids, params):
            if first is None and chunk.token_ids:
                first = time.monotonic()
            toks += chunk.token_ids
            last = chunk
        if last is None or last.finish_reason in (None, "error") or last.timings is None or first is None:
            raise RuntimeError(f"request ended with finish_reason {getattr(last, 'finish_reason', None)!r}: "
                               f"{getattr(last, 'error', None)}")
        tm = last.timings
        run.samples.setdefault(len(ids), []).append({
            "server_ttft_s": tm.time_to_first_token_s, "client_ttft_s": first - t0,
            "transfer_tail_s": tm.kv_transfer_time_s, "prefill_time_s": tm.prefill_time_s,
            "decode_kv_seconds": _kv_seconds(dec_url) - dec0, "prefill_kv_seconds": _kv_seconds(pre_url) - pre0})
        run.tokens[key] = toks
    except Exception as e:  # recorded as the pair's failure; its later requests are skipped
        run.error = f"request ({len(ids)} tokens): {_short(e)}"
        print(f"{run.pair.name}: request FAILED: {run.error}", flush=True)


def run_pairs(args: argparse.Namespace, pairs: list[Pair], lengths: list[int]) -> list[PairRun]:
    runs = [PairRun(p) for p in pairs]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with contextlib.ExitStack() as stack:
        for run in runs:
            start_pair(run, args, stack)
        for rnd in range(max(args.repeats_at.values())):
            rng = random.Random(1000 + rnd)
            prompts = {n: [rng.randrange(17, 49152) for _ in range(n)] for n in lengths}
            order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
            if rnd % 2:
                order.reverse()
            for n in (lengths if rnd % 2 == 0 else lengths[::-1]):
                if rnd >= args.repeats_at[n]:
                    continue
                for run in order:
                    if run.error is None:
                        one_request(run, prompts[n], params, f"{rnd}/{n}")
            live = [r for r in runs if r.error is None]
            print(f"round {rnd}: " + "; ".join(
                f"{r.pair.name} " + ", ".join(f"{n}: {r.samples[n][-1]['server_ttft_s'] * 1e3:.0f} ms" for n in lengths
                                              if rnd < args.repeats_at[n] and r.samples.get(n)) for r in live),
                  flush=True)
    return runs


def pair_rows(runs: list[PairRun], lengths: list[int]) -> list[dict]:
    rows = []
    reference = next((r.tokens for r in runs if r.error is None and r.tokens), {})
    for run in runs:
        row: dict = {"pair": run.pair.name, "error": run.error, "lengths": {},
                     "tokens_equal_first_ok_pair": all(run.tokens[k] == reference.get(k) for k in run.tokens)}
        for n in lengths:
            xs = run.samples.get(n, [])
            if not xs:
                continue
            stats = {"n": len(xs)}
            for key in xs[0]:
                vals = [x[key] for x in xs]
                stats[key] = {"p50_ms": 1e3 * statistics.median(vals), "p90_ms": 1e3 * percentile(vals, 0.9)}
            stats["tail_pct_of_ttft_p50"] = 100 * stats["transfer_tail_s"]["p50_ms"] / stats["server_ttft_s"]["p50_ms"]
            row["lengths"][n] = stats
        row["samples"] = {n: run.samples.get(n, []) for n in lengths}
        rows.append(row)
    return rows


# --- (c) TP 2 vs TP 1 in one process: bench.tp.ab --------------------------------------------------

_TP_AB_LINE = re.compile(r"^(prefill|decode): TP1 ([\d.]+) ms, TP2 ([\d.]+) ms \(paired median TP2 - TP1 "
                         r"([+-][\d.]+) ms\), TP2 leader in collectives ([\d.]+) ms")


def run_tp_ab(args: argparse.Namespace, threads: int) -> dict:
    cmd = [sys.executable, "-m", "bench.tp.ab", "--threads", str(threads), *args.tp_ab_args.split()]
    try:
        out = subprocess.run(cmd, cwd=BENCH_DIR.parent, capture_output=True, text=True, timeout=args.tp_ab_timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"threads": threads, "command": cmd, "error": f"timed out after {e.timeout:.0f} s"}
    res: dict = {"threads": threads, "command": cmd, "stdout": out.stdout}
    if out.returncode != 0:
        res["error"] = f"exit {out.returncode}: {out.stderr[-ERROR_CHARS:]}"
        return res
    for line in out.stdout.splitlines():
        m = _TP_AB_LINE.match(line)
        if m:
            tp1, tp2, diff, comm = (float(x) for x in m.groups()[1:])
            res[m.group(1)] = {"tp1_ms": tp1, "tp2_ms": tp2, "paired_ms": diff, "tp2_comm_ms": comm,
                               "comm_share_pct": 100 * comm / tp2}
        elif line.startswith("rounds "):
            res["setup"] = line
        elif line.startswith("greedy tokens identical:"):
            res["tokens_identical"] = line.split(":", 1)[1].strip() == "True"
    if "decode" not in res:
        res["error"] = "bench.tp.ab printed no decode summary line"
    return res


# --- the results file ----------------------------------------------------------------------------

def _ms(stats: dict, key: str) -> str:
    return f"{stats[key]['p50_ms']:.1f} / {stats[key]['p90_ms']:.1f}"


def command(args: argparse.Namespace) -> str:
    """The command line with the options that shape the numbers spelled out (defaults change)."""
    opts = ["--parts", args.parts, "--pairs", args.pairs, "--lengths", args.lengths, "--repeats", args.repeats,
            "--max-tokens", str(args.max_tokens), "--threads-per-node", str(args.threads_per_node),
            "--max-batch-tokens", str(args.max_batch_tokens), "--tp-ab-threads", args.tp_ab_threads,
            "--tp-ab-args", args.tp_ab_args]
    return "python -m bench.tp.pairs " + shlex.join(opts)


def write_tp_pairs(args: argparse.Namespace, run_s: float, pairs: list[dict] | None, writes: list[WritesRow] | None,
                  tp_ab: list[dict] | None, layout: KvLayout) -> None:
    data = {"run_s": run_s, "args": vars(args), "pairs": pairs, "writes": [asdict(w) for w in writes or []],
            "tp_ab": tp_ab}
    lines = ["# Disaggregated tensor-parallel pairs (issue 16)", "",
             f"Every option spelled out: `{command(args)}`", "",
             f"The run took {run_s:.0f} s (the host is shared by other sessions' tests).",
             f"Default model geometry: {layout.num_layers} layers, {layout.kv_heads} KV heads x {layout.head_dim}, "
             f"{layout.dtype}, {layout.page_size}-token pages.", ""]
    if pairs is not None:
        lines += ["## (a) TTFT and KV transfer tail per pair", "",
                  f"One cluster per pair (router + 1 prefill + 1 decode, {args.provider}, {args.threads_per_node} "
                  f"thread(s) per node process; a TP 2 node is 2 rank processes, its worker pinned to its own core; "
                  f"--max-batch-tokens {args.max_batch_tokens}, --tp-invariant everywhere), all up at once; "
                  f"rounds per length {', '.join(f'{n}: {k}' for n, k in args.repeats_at.items())}, each sending "
                  f"the same prompt to every pair in a rotated order, one request at a time, "
                  f"greedy, {args.max_tokens} tokens. p50 / p90 in ms over the rounds. Tail = "
                  f"`ServerTimings.kv_transfer_time_s` (the decode node's wait for KV after the Prefill call "
                  f"returned); decode / prefill transfer = the nodes' `{KV_SECONDS}` delta per request.", "",
                  "| pair | prompt tokens | n | server TTFT | client TTFT | transfer tail | tail % of TTFT (p50) "
                  "| decode-side transfer | prefill-side transfer | tokens equal |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in pairs:
            for n, s in row["lengths"].items():
                lines.append(f"| {row['pair']} | {n} | {s['n']} | {_ms(s, 'server_ttft_s')} "
                             f"| {_ms(s, 'client_ttft_s')} "
                             f"| {_ms(s, 'transfer_tail_s')} | {s['tail_pct_of_ttft_p50']:.1f} "
                             f"| {_ms(s, 'decode_kv_seconds')} | {_ms(s, 'prefill_kv_seconds')} "
                             f"| {'yes' if row['tokens_equal_first_ok_pair'] else 'NO'} |")
        failed = [row for row in pairs if row["error"]]
        if failed:
            lines += ["", "Failed pairs (reported, not measured):", ""]
            for row in failed:
                err = " ".join(row["error"].split()).replace("|", "/")
                lines.append(f"- {row['pair']}: {err}")
        lines.append("")
    if writes is not None:
        lines += ["## (b) RDMA writes per request: HND against NHD", "",
                  "Arithmetic only (`kv_messenger.plan.expected_writes`, cross-checked with `plan_transfer`'s runs; "
                  "context write included). NHD: a run covering whole rank pages on both sides is one write a page, "
                  "a head slice is one write per token.", "",
                  "| pair | prompt tokens | pages | runs per page | HND writes | HND bytes / write | NHD writes "
                  "| NHD bytes / write | NHD / HND |", "|---|---|---|---|---|---|---|---|---|"]
        for w in writes:
            lines.append(f"| {w.pair} | {w.prompt_tokens} | {w.pages} | {w.runs_per_page} | {w.hnd_writes} "
                         f"| {w.hnd_bytes_per_write:.0f} | {w.nhd_writes} | {w.nhd_bytes_per_write:.0f} "
                         f"| {w.nhd_over_hnd:.1f}x |")
        lines.append("")
    if tp_ab is not None:
        lines += ["## (c) TP 2 against TP 1 in one process (bench.tp.ab)", "",
                  f"`python -m bench.tp.ab {args.tp_ab_args} --threads T` (TP 1 on T threads; TP 2: leader + "
                  "pinned worker, 1 thread each); medians in ms; collectives = the TP 2 leader's time inside the "
                  "row-parallel folds' send / recv / broadcast (waiting for the other rank included).", "",
                  "| TP 1 threads | phase | TP 1 | TP 2 | paired TP 2 - TP 1 | TP 2 leader in collectives "
                  "| share of TP 2 | tokens identical |", "|---|---|---|---|---|---|---|---|"]
        for r in tp_ab:
            if r.get("error"):
                lines.append(f"| {r['threads']} | failed: {' '.join(r['error'].split())} | | | | | | |")
                continue
            for phase in ("prefill", "decode"):
                p = r.get(phase)
                if p:
                    label = "decode step" if phase == "decode" else phase
                    lines.append(f"| {r['threads']} | {label} | {p['tp1_ms']:.1f} "
                                 f"| {p['tp2_ms']:.1f} | {p['paired_ms']:+.1f} | {p['tp2_comm_ms']:.1f} "
                                 f"| {p['comm_share_pct']:.0f}% | {'yes' if r.get('tokens_identical') else 'NO'} |")
        setups = sorted({r["setup"] for r in tp_ab if r.get("setup")})
        lines += [""] + [f"tp_ab: {s}" for s in setups] + [""]
    write_results(args.results_dir, "tp_pairs", payload=data, lines=lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c", help="which of a (cluster pairs), b (writes), c (tp_ab) to run")
    ap.add_argument("--pairs", default="1:1,2:1,1:2,2:2", help="PREFILL_TP:DECODE_TP,... for (a) and (b)")
    ap.add_argument("--extra-write-pairs", default="3:1,1:3,3:2,2:3,6:1,1:6",
                    help="more pairs for (b) only (arithmetic; the default model's 3 KV heads allow TP 1, 2, 3, 6)")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", default="512:4,2048:2", help="rounds of (a), i.e. requests per pair and length: N, or "
                    "LENGTH:N,... per length")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--warmup-tokens", type=int, default=600, help="warm-up prompt: one full prefill chunk and more")
    ap.add_argument("--provider", default="shm")
    ap.add_argument("--threads-per-node", type=int, default=1)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--num-blocks", type=int, default=192, help="KV pages per node (2048 tokens take 128)")
    ap.add_argument("--startup-timeout-s", type=float, default=300)
    ap.add_argument("--request-timeout-s", type=float, default=180)
    ap.add_argument("--tp-ab-threads", default="1,2", help="TP 1 thread counts, one bench.tp.ab run each")
    ap.add_argument("--tp-ab-args", default="--rounds 3 --prefill-tokens 128 --batch 8 --ctx 32 --steps 3")
    ap.add_argument("--tp-ab-timeout-s", type=float, default=240)
    add_results_args(ap, "tp")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"a", "b", "c"}:
        raise SystemExit(f"--parts takes a, b and c, got {args.parts!r}")
    pairs = [Pair.parse(x) for x in args.pairs.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    if ":" in args.repeats:
        args.repeats_at = {int(a): int(b) for a, b in (x.split(":") for x in args.repeats.split(","))}
    else:
        args.repeats_at = dict.fromkeys(lengths, int(args.repeats))
    if set(args.repeats_at) != set(lengths) or min(args.repeats_at.values()) < 1:
        raise SystemExit(f"--repeats {args.repeats!r} must give every length of {lengths} at least 1 round")
    layout = default_layout(args.num_blocks)
    t0 = time.monotonic()

    writes = None
    if "b" in parts:
        extra = [Pair.parse(x) for x in args.extra_write_pairs.split(",") if x]
        writes = [writes_row(p, n, layout) for p in pairs + extra for n in lengths]
        for w in writes:
            print(f"{w.pair} {w.prompt_tokens} tokens: HND {w.hnd_writes} writes, NHD {w.nhd_writes} "
                  f"({w.nhd_over_hnd:.1f}x)", flush=True)
    tp_ab = None
    if "c" in parts:
        tp_ab = []
        for threads in (int(x) for x in args.tp_ab_threads.split(",")):
            tp_ab.append(run_tp_ab(args, threads))
            print(f"tp_ab --threads {threads}: {tp_ab[-1].get('error') or tp_ab[-1].get('decode')}", flush=True)
    pair_results = None
    if "a" in parts:
        pair_results = pair_rows(run_pairs(args, pairs, lengths), lengths)
    write_tp_pairs(args, round(time.monotonic() - t0), pair_results, writes, tp_ab, layout)
    print(f"done in {time.monotonic() - t0:.0f} s; results in {args.results_dir}/tp_pairs.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
