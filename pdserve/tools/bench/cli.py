"""`pdserve bench {serve,sweep,compare}`: the harness's command line.

    pdserve bench serve --url 127.0.0.1:50051 --dataset random --input-len 512:2048 --output-len 128:256 \\
        --num-prompts 100 --request-rate 0.5 --goodput ttft:5000 tpot:200 --result-json out.json --plot-dir plots/
    pdserve bench sweep --url ... --request-rates 0.1,0.2,0.4 --output-prefix bench/results/serving/sweep
    pdserve bench compare --input-len 512:2048 --output-len 128:256 --request-rate 0.05 --duration 180 \\
        --output-prefix bench/results/serving/compare

`add_parser(subparsers)` adds `bench` to a parent parser (pdserve.tools.cli); `python -m pdserve.tools.bench`
runs the same sub-commands on their own. Exit status: 0 done, 1 the run failed (no request
completed, a cluster did not start, a warm-up failed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import functools
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve.serving.channels import add_security_args, security_from_args
from pdserve.tools.bench.backends import BACKENDS, SendOptions
from pdserve.tools.bench.datasets import DATASETS, DatasetSpec, LengthRange
from pdserve.tools.bench.metrics import Slo
from pdserve.tools.bench.runner import RunConfig

DEFAULT_URLS = {"grpc": "127.0.0.1:50051", "openai": "http://127.0.0.1:8000"}


def _length(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _token_range(text: str) -> tuple[int, int]:
    r = _length(text)
    return r.low, r.high  # type: ignore[return-value]


def _add_workload_args(p: argparse.ArgumentParser, *, compare: bool = False) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", choices=DATASETS,
                   help="random: token-id prompts with lengths drawn from --input-len/--output-len ranges; fixed: "
                        "single lengths; prompts: the prompt set shipped with pdserve; jsonl: --dataset-path")
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help='JSONL file, one {"prompt": text or token ids, "max_tokens": N (optional)} per line')
    g.add_argument("--input-len", type=_length, default=LengthRange(512, 2048) if compare else None, metavar="N|LO:HI",
                   help="prompt tokens (random/fixed; default %(default)s, else 1024)" if compare else
                        "prompt tokens (random/fixed; default 1024)")
    g.add_argument("--output-len", type=_length, default=LengthRange(128, 256) if compare else None,
                   metavar="N|LO:HI", help="max tokens asked per request (random/fixed default 128; prompts/jsonl "
                                           "default: each line's max_tokens)")
    g.add_argument("--num-prompts", type=int, default=40 if compare else 100, help="requests to send (at most)")
    g.add_argument("--token-range", type=_token_range, default=(17, 49152), metavar="LO:HI",
                   help="token ids random prompts are drawn from (default: SmolLM2's non-special tokens)")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=0.05 if compare else math.inf, metavar="R",
                   help="requests per second, Poisson (burstiness 1) or gamma arrivals; inf: all at once "
                        "(default %(default)s)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier, > 1 more regular")
    a.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="cap on requests in flight")
    a.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop sending new requests after S seconds (those in flight finish)")
    a.add_argument("--num-warmups", type=int, default=4 if compare else 0, metavar="N",
                   help="short requests sent one by one before the clock starts, not recorded (default "
                        "%(default)s" + (": enough to reach every node of either cluster)" if compare else ")"))
    s = p.add_argument_group("requests")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max tokens (default; --no-ignore-eos stops at EOS)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="S", help="give up on a request after S s")
    s.add_argument("--model", default="", help="model name sent with each request (default: the server's)")
    s.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, KEY one of ttft, tpot, e2el (e.g. --goodput ttft:5000 tpot:200)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="grpc", choices=BACKENDS, help="gRPC (default) or the OpenAI HTTP API")
    p.add_argument("--url", default=None,
                   help=f"server address (default: {DEFAULT_URLS['grpc']} for grpc, "
                        f"{DEFAULT_URLS['openai']} for openai)")
    p.add_argument("--metrics-url", default=None, metavar="URL",
                   help="a server's Prometheus /metrics: its TTFT/ITL/E2E histograms over the run go into the result, "
                        "and a speculating node's acceptance rate and length into the output")
    p.add_argument("--spec-metrics-url", action="append", default=[], metavar="URL",
                   help="another /metrics whose speculative-decoding counters are added to --metrics-url's (e.g. "
                        "each decode node's, when --metrics-url is the router's); repeatable")
    add_security_args(p)   # a cluster with mTLS / a token (gRPC backend)


def dataset_from_args(args: argparse.Namespace) -> DatasetSpec:
    input_len, output_len = args.input_len, args.output_len
    if args.dataset in ("random", "fixed"):
        input_len = input_len or LengthRange(1024)
        output_len = output_len or LengthRange(128)
    return DatasetSpec(args.dataset, args.num_prompts, input_len, output_len, args.dataset_path, args.seed,
                       args.token_range)


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    send = SendOptions(temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.request_timeout,
                       model=args.model)
    return RunConfig(request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                     duration_s=args.duration, seed=args.seed, num_warmups=args.num_warmups, send=send)


def _serve_settings(args: argparse.Namespace):
    from pdserve.tools.bench.serve import ServeSettings

    return ServeSettings(args.backend, args.url or DEFAULT_URLS[args.backend], dataset_from_args(args),
                         run_config_from_args(args), Slo.parse(args.goodput), args.metrics_url,
                         security_from_args(args), tuple(args.spec_metrics_url))


def _failures_exit_1(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A run that cannot go on (a warm-up failed, a cluster did not start) prints why and exits 1;
    bad arguments (ValueError) are left to the caller (exit 2)."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return run


@_failures_exit_1
def _cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.tools.bench.plots import latency_cdfs
    from pdserve.tools.bench.report import format_table, spec_decode_rows, write_json
    from pdserve.tools.bench.serve import run_serve

    settings = _serve_settings(args)
    result = run_serve(settings, progress=not args.no_progress)
    header = [("Backend / URL", f"{settings.backend} {settings.url}"),
              ("Request rate (req/s) / burstiness / max concurrency",
               f"{settings.run.request_rate:g} / {settings.run.burstiness:g} / {settings.run.max_concurrency or '-'}")]
    if result.outcome.not_sent:
        header.append(("Not sent (duration cap)", str(result.outcome.not_sent)))
    print(format_table(result.metrics, "pdserve bench serve", header, spec_decode_rows(result.server_spec_decode)))
    if result.server_histograms_error:
        print(f"warning: {result.server_histograms_error}", file=sys.stderr)
    if args.result_json:
        print(f"result: {write_json(args.result_json, result.to_json())}")
    if args.plot_dir:
        for path in latency_cdfs({"run": result.outcome.records}, args.plot_dir, args.plot_stem):
            print(f"plot: {path}")
    return 0 if result.metrics.completed else 1


@_failures_exit_1
def _cmd_sweep(args: argparse.Namespace) -> int:
    from pdserve.tools.bench.sweep import parse_rates, run_sweep, write_sweep

    rates = parse_rates(args.request_rates)
    sweep = run_sweep(_serve_settings(args), rates, progress=not args.no_progress)
    for path in write_sweep(sweep, args.output_prefix):
        print(f"wrote {path}")
    return 0 if all(r.metrics.completed for r in sweep.results) else 1


@_failures_exit_1
def _cmd_compare(args: argparse.Namespace) -> int:
    from pdserve.tools.bench.compare import CompareSettings, comparison_rows, format_comparison, run_compare
    from pdserve.tools.bench.plots import latency_cdfs
    from pdserve.tools.bench.report import format_table, spec_decode_rows, write_json

    settings = CompareSettings(
        dataset=dataset_from_args(args), run=run_config_from_args(args), slo=Slo.parse(args.goodput),
        backend=args.backend, prefill=args.prefill, decode=args.decode, threads_per_node=args.threads_per_node,
        pin_cores=args.pin_cores, num_blocks=args.num_blocks, engine_args=tuple(shlex.split(args.engine_args)),
        provider=args.provider, startup_timeout_s=args.startup_timeout)
    prefix = Path(args.output_prefix) if args.output_prefix else None

    def keep(setup: str, res) -> None:  # a ServeResult; saved at once: the next setup may fail
        if prefix is not None:
            print(f"{setup} result: {write_json(f'{prefix}_{setup}.json', res.to_json())}", flush=True)

    result = run_compare(settings, progress=not args.no_progress, on_result=keep)  # ClusterStartError: exit 1
    for name, res in result.results.items():
        modules = ", ".join(c.split(" -m ")[1].split()[0] for c in result.clusters[name])
        print(format_table(res.metrics, f"{name} ({modules})", footer=spec_decode_rows(res.server_spec_decode)))
    rows = comparison_rows(result.results["colocated"].metrics, result.results["disaggregated"].metrics)
    table = format_comparison(rows, result.targets)
    print(table)
    if prefix is not None:
        print(f"result: {write_json(f'{prefix}.json', result.to_json())}")
        md = Path(f"{prefix}.md")
        md.write_text(compare_markdown(result, table, _command_line()))
        print(f"summary: {md}")
        runs = {name: res.outcome.records for name, res in result.results.items()}
        for path in latency_cdfs(runs, prefix.parent, prefix.name):
            print(f"plot: {path}")
    return 0 if all(r.metrics.completed for r in result.results.values()) else 1


def _command_line() -> str:
    prog = "python -m pdserve.tools.bench" if sys.argv[0].endswith("__main__.py") else "pdserve bench"
    return f"{prog} {shlex.join(sys.argv[1:])}"


def compare_markdown(result, table: str, command: str) -> str:  # a CompareResult
    """The comparison as Markdown: command, workload, clusters, load, the side-by-side table."""
    s = result.settings
    d, r = s.dataset, s.run
    lines = ["# Colocated vs disaggregated (pdserve bench compare)", "", f"Command: `{command}`", "",
             f"Workload: {d.num_prompts} requests at most, dataset {d.kind}, prompts {d.input_len} tokens, outputs "
             f"{d.output_len} tokens (EOS {'ignored' if r.send.ignore_eos else 'honoured'}), seed {d.seed}; "
             f"arrivals at {r.request_rate:g} req/s (burstiness {r.burstiness:g}), sending capped at "
             f"{r.duration_s if r.duration_s is not None else '-'} s, max concurrency {r.max_concurrency or '-'}, "
             f"{r.num_warmups} warm-up request(s) per cluster; backend {s.backend}.",
             f"Clusters: colocated {s.prefill + s.decode} nodes vs disaggregated {s.prefill} prefill + {s.decode} "
             f"decode, {s.threads_per_node} torch thread(s) per node, "
             f"{'each node pinned to its own cores' if s.pin_cores else 'unpinned'}, "
             f"{s.num_blocks} KV blocks per node, engine flags {list(s.engine_args) or 'default'}, "
             "router unpinned.", ""]
    for name, res in result.results.items():
        before, after = res.machine_before, res.machine_after
        lines.append(f"- {name}: load average (1, 5, 15 min) {before['load_average']} before, "
                     f"{after['load_average']} after; {before['nproc']} cores ({before['cpu']}), commit "
                     f"{before['commit']}, {before['date']}")
        lines += [f"  - `{c}`" for c in result.clusters[name]]
    lines += ["", "```", table, "```", ""]
    return "\n".join(lines)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test a running server (gRPC or OpenAI HTTP)")
    _add_target_args(p)
    _add_workload_args(p)
    p.add_argument("--result-json", default=None, metavar="FILE", help="write every metric and per-request record")
    p.add_argument("--plot-dir", default=None, metavar="DIR", help="write the TTFT and ITL CDFs as PNG here")
    p.add_argument("--plot-stem", default="serve", help="file name stem of the plots (default serve)")
    p.set_defaults(func=_cmd_serve)


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="the same workload at several request rates; one result per rate, and a plot")
    _add_target_args(p)
    _add_workload_args(p)
    p.add_argument("--request-rates", required=True, metavar="R1,R2,...", help="offered request rates (req/s)")
    p.add_argument("--output-prefix", default="bench/results/sweep", metavar="PREFIX",
                   help="PREFIX_rateR.json per rate, PREFIX.json (summary), PREFIX.png (default %(default)s)")
    p.set_defaults(func=_cmd_sweep)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="colocated vs disaggregated clusters on the same cores and workload")
    p.add_argument("--backend", default="grpc", choices=BACKENDS, help="gRPC (default) or the OpenAI HTTP API")
    c = p.add_argument_group("clusters")
    c.add_argument("--prefill", type=int, default=1, help="prefill nodes of the disaggregated cluster (default 1)")
    c.add_argument("--decode", type=int, default=1, help="decode nodes of the disaggregated cluster (default 1); "
                                                         "the colocated cluster gets prefill + decode nodes")
    c.add_argument("--threads-per-node", type=int, default=1, help="torch threads and pinned cores per node")
    c.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                   help="pin every node to its own cores (default on)")
    c.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per node (default %(default)s)")
    c.add_argument("--engine-args", default="", metavar="'FLAGS'", help="more engine flags for every node")
    c.add_argument("--provider", default="shm", help="libfabric provider of the disaggregated cluster")
    c.add_argument("--startup-timeout", type=float, default=300.0, metavar="S")
    _add_workload_args(p, compare=True)
    p.add_argument("--output-prefix", default=None, metavar="PREFIX",
                   help="write PREFIX.json (both runs, side by side, targets), PREFIX.md, PREFIX_{ttft,itl}_cdf.png, "
                        "and PREFIX_<setup>.json as soon as each setup has run")
    p.set_defaults(func=_cmd_compare)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` with its sub-commands to a parent parser's sub-parsers; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="load-test harness: serve, sweep, compare")
    _add_subcommands(bench)
    return bench


def _add_subcommands(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_serve(sub)
    _add_sweep(sub)
    _add_compare(sub)


def build_parser() -> argparse.ArgumentParser:
    """The stand-alone parser of `python -m pdserve.tools.bench`."""
    p = argparse.ArgumentParser(prog="python -m pdserve.tools.bench", description="pdserve's load-test harness.")
    p.add_argument("--log-level", default="WARNING")
    _add_subcommands(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from pdserve.tools.cli import run_command

    return run_command(build_parser().parse_args(argv), (ValueError,))
