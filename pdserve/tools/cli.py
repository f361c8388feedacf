"""The `pdserve` command line.

    pdserve generate [--model PATH | --url HOST:PORT] [--max-tokens N] [--temperature T] [--json] [--chat] PROMPT...
    pdserve up [--prefill N] [--decode M | --colocated M] [--port P]
    pdserve simulate --output-lengths 5,50,8,12,40,3,30,7 --slots 4 [--json]
    pdserve topology [--tp N] [--provider PROVIDER] [--sys ROOT]   (NUMA nodes, NICs, KV shard placement)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from pdserve.serving.engine_args import add_engine_args, engine_options


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.url:
        from pdserve.tools.client import cmd_generate_remote

        return cmd_generate_remote(args)
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    engine = LLMEngine(EngineConfig.from_options(model=args.model, **engine_options(args)))
    prompts: list[str | list[int]] = []
    for p in args.prompts:
        if args.chat:
            messages = [{"role": "user", "content": p}]
            prompts.append(list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False)))
        else:
            prompts.append(p)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    # All prompts run in one batch; text is streamed for the first unfinished prompt in order,
    # the others are buffered and flushed when their turn comes.
    buffers: dict[str, list[str]] = {i: [] for i in ids}
    done: dict[str, object] = {}
    focus = 0
    while focus < len(ids):
        for out in engine.step():
            if out.error:
                print(f"error: {out.error}", file=sys.stderr)
                return 1
            buffers[out.request_id].append(out.delta_text)
            if out.finished:
                done[out.request_id] = out.completion
        while focus < len(ids):
            rid = ids[focus]
            if not args.json:
                sys.stdout.write("".join(buffers[rid]))
                sys.stdout.flush()
                buffers[rid].clear()
            if rid not in done:
                break
            c = done[rid]
            if args.json:
                record: dict[str, object] = {"text": c.text, "token_ids": list(c.token_ids),
                                             "finish_reason": c.finish_reason}
                if args.logprobs is not None:
                    # The remote path's shape: the engine's SampleLogprobs has the same fields.
                    from pdserve.tools.client import logprobs_json

                    record["logprobs"] = [logprobs_json(lp) for lp in (c.logprobs or ())]
                print(json.dumps(record))
            else:
                sys.stdout.write("\n")
            focus += 1
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.tools.simulate import simulate

    try:
        lengths = [int(x) for x in args.output_lengths.split(",") if x.strip()]
    except ValueError:
        print(f"error: --output-lengths must be comma-separated integers, got {args.output_lengths!r}", file=sys.stderr)
        return 2
    static = simulate(lengths, args.slots, static=True)
    cont = simulate(lengths, args.slots, static=False)
    if args.json:
        print(json.dumps({
            "static": {"steps": static.steps, "slot_utilization": round(static.slot_utilization, 2)},
            "continuous": {"steps": cont.steps, "slot_utilization": round(cont.slot_utilization, 2)},
        }))
    else:
        print(f"output lengths {lengths}, {args.slots} slots")
        print(f"static batching:     {static.steps:4d} decode steps, {static.slot_utilization:.0%} slot utilisation")
        print(f"continuous batching: {cont.steps:4d} decode steps, {cont.slot_utilization:.0%} slot utilisation")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions, streaming to stdout: on this machine, "
                                        "or on a cluster with --url")
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template as a user turn")
    g.add_argument("--json", action="store_true",
                   help='print one JSON object per prompt: {"text", "token_ids" (generated only), "finish_reason"}')
    add_engine_args(g)
    from pdserve.tools.client import add_remote_args

    add_remote_args(g)
    g.set_defaults(func=_cmd_generate)

    from pdserve.tools.launcher import add_up_args, cmd_up

    u = sub.add_parser("up", help="start a local cluster (router, prefill and decode nodes) and serve until Ctrl-C")
    add_up_args(u)
    u.set_defaults(func=cmd_up)

    from pdserve.tools.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    from pdserve.tools.deploy import add_deploy_parser

    add_deploy_parser(sub)

    from pdserve.tools.topology import add_topology_parser

    add_topology_parser(sub)

    from pdserve.tools.draft_train import add_draft_parser

    add_draft_parser(sub)

    s = sub.add_parser("simulate", help="run the real scheduler without a model: static vs continuous batching")
    s.add_argument("--output-lengths", default="5,50,8,12,40,3,30,7", help="comma-separated output lengths")
    s.add_argument("--slots", type=int, default=4, help="sequences per batch")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_simulate)
    return parser


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run_command(args: argparse.Namespace, errors: tuple[type[Exception], ...]) -> int:
    """Log at args.log_level and run args.func; one of `errors` is printed as `error: ...`, exit status 2
    (`pdserve` and `python -m pdserve.tools.bench` alike)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        return args.func(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv), (ValueError, FileNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
