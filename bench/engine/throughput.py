"""Benchmark: pdserve vs transformers (continuous batching and static generate), CPU, one process.

What is measured
----------------
One workload runs through up to three systems, one after the other, in the same process and with
the same torch thread count (`torch.set_num_threads(--threads)`; pdserve gets `num_threads`):

- ``pdserve``:  ``LLM(...).generate(token_id_lists, SamplingParams(temperature=0, max_tokens=N,
  ignore_eos=True))``, chunked prefill + continuous batching over the paged KV cache.
- ``hf-cb``:    transformers' own continuous batching, ``model.generate_batch(...)`` on the same
  checkpoint (``AutoModelForCausalLM.from_pretrained(path, dtype=...)``, attention "sdpa", which
  continuous batching runs over its paged cache on CPU). EOS is ignored with
  ``GenerationConfig(eos_token_id=-1)``: a request's EOS set keeps only ids >= 0, so it is empty.
  Its continuous-batching config gets pdserve's token budget and request cap and a KV cache sized
  for the whole workload (its default sizes the cache from free memory, which takes minutes).
- ``hf-static``: ``model.generate`` in batches of 16 prompts (workload order), left padding with
  the attention mask, ``min_new_tokens = max_new_tokens = N`` so every row generates N tokens.

Workload: --num-requests prompts of random non-special token ids, lengths uniform in
[--min-prompt, --max-prompt] (``random.Random(--seed)``), identical for every system; greedy,
exactly --output-len tokens each (checked). Each system first runs a small untimed warm-up; the
timed region is the generate call only (no model loading, no cache allocation). Throughput is
output tokens / wall seconds.

When pdserve runs, the script also times one decode step at batch --decode-batch (32): that many
requests with prompts of the workload's mean length are prefilled, then --decode-steps
``engine.step()`` calls in which every chunk is a 1-token decode are timed (median). Beside it,
the step's matrix multiplications alone: the same linear calls (``pdserve.kernels.ops.linear.linear``)
(per layer qkv_proj, o_proj, gate_up_proj, down_proj at 32 rows, then lm_head on 32 rows) in a loop, one pass after each
timed step so both see the same machine load (median); and the attention backend's time inside
the step. "other" = step - matmuls - attention (norms, RoPE, KV writes, sampling, Python).
The step-over-matmul target is judged on the median of the per-step ratios (each step over the
matmul pass right after it): on a shared VM the machine's speed drifts by 20-30% within seconds,
and a ratio of two medians taken over different moments carries that drift; the ratio of the
medians and of the minima are printed beside it.

Targets (from the issue; defined for float32, same run): pdserve >= 5x hf-cb and >= 2x hf-static
output tokens/s, and the batch-32 decode step <= 1.5x its matmul time. bfloat16 (``--dtype
bfloat16``) is reported separately: its results file gets the tag "bfloat16" unless --tag is given.

Results: ``<results-dir>/engine_throughput[-tag].json`` (all numbers, config, the stamp) and
``.md`` (tables, then the stamp: commit, date, machine, command); default bench/results/engine/.

Run (takes a while; run it on an otherwise idle machine), from the repository root:
    python -m bench.engine.throughput
    python -m bench.engine.throughput --dtype bfloat16
Smoke run (tests/bench/test_engine_smoke.py runs one like it on a tiny checkpoint):
    python -m bench.engine.throughput --num-requests 4 --output-len 8 --min-prompt 16 \\
        --max-prompt 32 --tag smoke --results-dir /tmp/benchsmoke
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bench.common.results import add_results_args, write_results
from pdserve import LLM, SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels.ops.linear import linear
from pdserve.model.loader import ModelSource, resolve_model

SYSTEMS = ("pdserve", "hf-cb", "hf-static")
STATIC_BATCH = 16
TARGET_VS_CB = 5.0
TARGET_VS_STATIC = 2.0
TARGET_STEP_OVER_MATMUL = 1.5
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --- workload ----------------------------------------------------------------------------------


def make_prompts(n: int, min_len: int, max_len: int, seed: int, token_range: tuple[int, int]) -> list[list[int]]:
    """n prompts of random token ids in [lo, hi), lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    lo, hi = token_range
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randrange(lo, hi) for _ in range(length)])
    return prompts


def regular_token_range(source: ModelSource) -> tuple[int, int]:
    """[lo, hi): the widest id range above every special / added token of the tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
    vocab = AutoConfig.from_pretrained(str(source.path), local_files_only=True).vocab_size
    special = set(tokenizer.all_special_ids) | {int(i) for i in tokenizer.added_tokens_decoder}
    below = [i for i in special if i < vocab // 2]
    lo = max(below) + 1 if below else 0
    above = [i for i in special if i >= vocab // 2]
    hi = min(min(above), vocab) if above else vocab
    return lo, hi


# --- results of one system ---------------------------------------------------------------------


@dataclass
class SystemResult:
    system: str
    wall_s: float
    output_tokens: int
    tokens_per_request: list[int]
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def check_counts(system: str, counts: Sequence[int], num_requests: int, output_len: int) -> None:
    total = sum(counts)
    print(f"[{system}] {len(counts)} requests, {total} output tokens "
          f"(expected {num_requests} x {output_len} = {num_requests * output_len})", flush=True)
    assert len(counts) == num_requests, f"{system}: {len(counts)} outputs for {num_requests} requests"
    bad = [c for c in counts if c != output_len]
    assert not bad, f"{system}: {len(bad)} requests did not produce {output_len} tokens, e.g. {bad[:5]}"


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# --- pdserve -----------------------------------------------------------------------------------


def make_llm(args: argparse.Namespace) -> LLM:
    # kv_prefault: the pool is faulted in before anything is timed, as a long-running server's pool
    # is; otherwise every block's first use takes a page fault (on this VM ~5 ms per 2 MiB huge
    # page the hypervisor backs for the first time) and the timings measure the kernel's memory
    # provisioning instead of the engine.
    return LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, num_threads=args.threads,
               max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=args.max_requests_per_batch,
               kv_prefault=True)


def run_pdserve(llm: LLM, prompts: list[list[int]], warmup: list[list[int]], output_len: int) -> SystemResult:
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps0 = llm.engine.num_steps
    outs, wall = timed(lambda: llm.generate(prompts, params))
    counts = [len(o.token_ids) for o in outs]
    notes = {"engine_steps": llm.engine.num_steps - steps0,
             "attention_backend": llm.engine.runner.backend.name,
             "kv_blocks": llm.engine.pool.num_blocks, "kv_prefault": llm.engine.config.cache.kv_prefault}
    return SystemResult("pdserve", wall, sum(counts), counts, notes)


# --- transformers ------------------------------------------------------------------------------


def load_hf_model(path: str, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    return model.eval()


def run_hf_cb(args: argparse.Namespace, path: str, prompts: list[list[int]],
              warmup: list[list[int]]) -> SystemResult:
    """model.generate_batch with a persistent manager: the warm-up call builds it, the timed call reuses it."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf_model(path, _DTYPES[args.dtype], args.hf_attn)
    page_size = ContinuousBatchingConfig().page_size
    per_request = -(-(args.max_prompt + args.output_len) // page_size)
    cb_config = ContinuousBatchingConfig(
        num_blocks=len(prompts) * per_request + 2,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests_per_batch,
        allow_block_sharing=False,   # random prompts share no prefix
        seed=args.seed,
    )
    gen_config = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1)
    with torch.inference_mode():
        model.generate_batch(inputs=warmup, generation_config=gen_config, continuous_batching_config=cb_config,
                             progress_bar=False, persistent_manager=True, max_new_tokens=4)
        outs, wall = timed(lambda: model.generate_batch(
            inputs=prompts, generation_config=gen_config, continuous_batching_config=cb_config,
            progress_bar=False, persistent_manager=False))
    results = list(outs.values())
    errors = [r.error for r in results if r.error is not None]
    assert not errors, f"hf-cb: {len(errors)} requests failed, e.g. {errors[0]}"
    counts = [len(r.generated_tokens) for r in results]
    notes = {"attn_implementation": args.hf_attn, "page_size": page_size, "num_blocks": cb_config.num_blocks,
             "max_batch_tokens": cb_config.max_batch_tokens,
             "max_requests_per_batch": cb_config.max_requests_per_batch, "eos_token_id": -1}
    return SystemResult("hf-cb", wall, sum(counts), counts, notes)


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, L] and attention_mask [B, L], padded on the left."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def static_generate(model: torch.nn.Module, prompts: list[list[int]], n: int, pad_id: int) -> list[int]:
    """Generated-token counts per prompt, batches of STATIC_BATCH in workload order."""
    counts: list[int] = []
    for start in range(0, len(prompts), STATIC_BATCH):
        ids, mask = left_pad(prompts[start:start + STATIC_BATCH], pad_id)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad_id)
        counts.extend([out.shape[1] - ids.shape[1]] * ids.shape[0])
    return counts


def run_hf_static(args: argparse.Namespace, path: str, prompts: list[list[int]],
                  warmup: list[list[int]]) -> SystemResult:
    model = load_hf_model(path, _DTYPES[args.dtype], args.hf_attn)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        eos = model.generation_config.eos_token_id
        pad_id = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    with torch.inference_mode():
        static_generate(model, warmup, 4, pad_id)
        counts, wall = timed(lambda: static_generate(model, prompts, args.output_len, pad_id))
    notes = {"batch_size": STATIC_BATCH, "attn_implementation": args.hf_attn, "pad_token_id": pad_id,
             "eos": "min_new_tokens = max_new_tokens"}
    return SystemResult("hf-static", wall, sum(counts), counts, notes)


# --- the batch-32 decode step ------------------------------------------------------------------


class AttentionTimer:
    """Wraps the engine's attention backend `forward` and sums the seconds spent in it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.backend = engine.runner.backend
        self.inner = self.backend.forward
        self.seconds = 0.0
        self.backend.forward = self._forward  # type: ignore[method-assign]

    def _forward(self, *a: Any, **kw: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner(*a, **kw)
        self.seconds += time.perf_counter() - t0
        return out

    def remove(self) -> None:
        del self.backend.forward  # the instance attribute; the class method shows again


def linear_calls(engine: LLMEngine, rows: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(input [rows, in], weight, bias) for every linear a decode step of `rows` tokens makes."""
    model = engine.model
    dtype = model.embed_tokens.weight.dtype
    gen = torch.Generator().manual_seed(0)
    calls = []
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            x = torch.randn(rows, lin.weight.shape[1], generator=gen).to(dtype)
            calls.append((x, lin.weight, lin.bias))
    x = torch.randn(rows, model.lm_head_weight.shape[1], generator=gen).to(dtype)
    calls.append((x, model.lm_head_weight, None))
    return calls


def matmul_pass(calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], fn=linear) -> float:
    """Seconds of one pass over the step's linear layers (same order, same weights). `fn` defaults
    to the dispatch the model uses (`pdserve.kernels.ops.linear.linear`: the C kernel up to its row limit,
    MKL above); F.linear gives torch's (MKL) time for the same products, for reference."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        for x, w, b in calls:
            fn(x, w, b)
        return time.perf_counter() - t0


def decode_step_bench(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int,
                      token_range: tuple[int, int]) -> dict[str, Any]:
    """Prefill `batch` requests, then time `steps` pure-decode engine steps (median)."""
    prompts = make_prompts(batch, prompt_len, prompt_len, seed + 1, token_range)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    prefill_steps = 0
    while any(not r.output_token_ids for r in requests):
        engine.step()
        prefill_steps += 1
    seen: list[tuple[int, int]] = []   # (chunks, tokens) of each timed step's pass
    schedule = engine.scheduler.schedule

    def recording_schedule(*args: Any, **kwargs: Any):  # the scheduler's own method (whatever it takes),
        s = schedule(*args, **kwargs)                   # noting what each pass runs
        seen.append((len(s.chunks), s.num_batched_tokens))
        return s

    engine.scheduler.schedule = recording_schedule
    timer = AttentionTimer(engine)
    calls = linear_calls(engine, batch)
    step_times, attn_times, matmul_times, torch_times = [], [], [], []
    try:
        # Steps and matmul passes alternate, so all see the same machine load.
        for i in range(steps + 2):
            timer.seconds = 0.0
            _, wall = timed(engine.step)
            matmul = matmul_pass(calls)
            torch_matmul = matmul_pass(calls, torch.nn.functional.linear)
            if i >= 2:
                step_times.append(wall)
                attn_times.append(timer.seconds)
                matmul_times.append(matmul)
                torch_times.append(torch_matmul)
    finally:
        timer.remove()
        del engine.scheduler.schedule   # back to the class's method
        for r in requests:
            engine.abort_request(r.request_id)
    assert all(s == (batch, batch) for s in seen), f"not every timed step was {batch} 1-token decodes: {seen}"
    step, attn, matmul, torch_matmul = (statistics.median(t) for t in (step_times, attn_times, matmul_times,
                                                                        torch_times))
    return {"batch": batch, "prompt_len": prompt_len, "prefill_steps": prefill_steps, "timed_steps": steps,
            "step_s": step, "step_min_s": min(step_times), "matmul_s": matmul, "matmul_min_s": min(matmul_times),
            "torch_matmul_s": torch_matmul, "step_over_torch_matmul": step / torch_matmul,
            "attention_s": attn, "other_s": step - matmul - attn, "step_over_matmul": step / matmul,
            "step_over_matmul_min": min(step_times) / min(matmul_times),
            "step_over_matmul_paired": statistics.median(s / m for s, m in zip(step_times, matmul_times, strict=True))}


# --- report ------------------------------------------------------------------------------------


def target_lines(results: dict[str, SystemResult], step: dict[str, Any] | None, dtype: str,
                 kv_cache_dtype: str = "auto") -> list[dict[str, Any]]:
    """Each target: name, measured value, goal, PASS / MISS / n/a, margin."""
    out = []
    pd = results.get("pdserve")

    def ratio_target(name: str, other: str, goal: float) -> None:
        if pd is None or other not in results:
            out.append({"target": name, "value": None, "goal": goal, "verdict": "n/a", "margin": None})
            return
        value = pd.tokens_per_s / results[other].tokens_per_s
        out.append({"target": name, "value": value, "goal": goal,
                    "verdict": "PASS" if value >= goal else "MISS", "margin": value / goal})

    ratio_target(f"pdserve tok/s >= {TARGET_VS_CB:g}x hf-cb", "hf-cb", TARGET_VS_CB)
    ratio_target(f"pdserve tok/s >= {TARGET_VS_STATIC:g}x hf-static", "hf-static", TARGET_VS_STATIC)
    name = f"decode step (batch {step['batch'] if step else 32}) <= {TARGET_STEP_OVER_MATMUL:g}x its matmuls"
    if step is None:
        out.append({"target": name, "value": None, "goal": TARGET_STEP_OVER_MATMUL, "verdict": "n/a", "margin": None})
    else:
        value = step["step_over_matmul_paired"]
        out.append({"target": name, "value": value, "goal": TARGET_STEP_OVER_MATMUL,
                    "verdict": "PASS" if value <= TARGET_STEP_OVER_MATMUL else "MISS",
                    "margin": TARGET_STEP_OVER_MATMUL / value})
    if dtype != "float32" or kv_cache_dtype not in ("auto", "float32"):
        for t in out:
            t["target"] += " (targets are defined for float32)"
    return out


def report_lines(args: argparse.Namespace, results: dict[str, SystemResult], step: dict[str, Any] | None,
                 targets: list[dict[str, Any]]) -> list[str]:
    pd = results.get("pdserve")
    kv = "" if args.kv_cache_dtype in ("auto", args.dtype) else f", pdserve KV cache {args.kv_cache_dtype}"
    lines = [f"# Engine throughput: pdserve vs transformers ({args.dtype}{kv}, {args.threads} threads)", ""]
    lines.append(f"Workload: {args.num_requests} requests, prompts uniform in [{args.min_prompt}, "
                 f"{args.max_prompt}] tokens (seed {args.seed}), {args.output_len} output tokens each, greedy, "
                 f"EOS ignored. pdserve: max_batch_tokens={args.max_batch_tokens}, "
                 f"max_requests_per_batch={args.max_requests_per_batch}.")
    lines += ["", "| system | wall s | output tokens | output tok/s | pdserve speed-up over it |",
              "|---|---|---|---|---|"]
    for r in results.values():
        ratio = f"{pd.tokens_per_s / r.tokens_per_s:.2f}x" if pd is not None else "n/a"
        lines.append(f"| {r.system} | {r.wall_s:.2f} | {r.output_tokens} | {r.tokens_per_s:.1f} | {ratio} |")
    lines.append("")
    for r in results.values():
        lines.append(f"- {r.system}: " + ", ".join(f"{k}={v}" for k, v in r.notes.items()))
    if step is not None:
        lines += ["", f"Decode step at batch {step['batch']} (prompts of {step['prompt_len']} tokens, median of "
                  f"{step['timed_steps']} steps):", "",
                  "| part | ms | share of step |", "|---|---|---|"]
        for key, label in (("step_s", "whole engine.step()"), ("matmul_s", "matmuls alone (linear loop)"),
                           ("attention_s", "attention backend inside the step"),
                           ("other_s", "other (step - matmuls - attention)")):
            lines.append(f"| {label} | {step[key] * 1e3:.2f} | {100 * step[key] / step['step_s']:.0f}% |")
        lines.append(f"| step / matmuls, median of the per-step ratios (the target's measure) | "
                     f"{step['step_over_matmul_paired']:.2f}x | |")
        lines.append(f"| step / matmuls, ratio of the medians above (of the minima) | "
                     f"{step['step_over_matmul']:.2f}x ({step['step_over_matmul_min']:.2f}x) | |")
        if "torch_matmul_s" in step:
            lines.append(f"| for reference: the same matmuls with torch F.linear (MKL) | "
                         f"{step['torch_matmul_s'] * 1e3:.2f} | step / these: {step['step_over_torch_matmul']:.2f}x |")
    lines += ["", "Targets:", "", "| target | measured | verdict | margin |", "|---|---|---|---|"]
    for t in targets:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}x"
        margin = "n/a" if t["margin"] is None else f"{t['margin']:.2f}x the goal" if t["verdict"] == "PASS" \
            else f"short by {1 / t['margin']:.2f}x"
        lines.append(f"| {t['target']} | {value} | {t['verdict']} | {margin} |")
    return lines


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="pdserve's KV cache storage (auto = --dtype); transformers keeps --dtype")
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: pdserve's default model)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="pdserve and hf-cb token budget per pass")
    p.add_argument("--max-requests-per-batch", type=int, default=64, help="pdserve and hf-cb request cap")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation (sdpa or eager)")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=30)
    add_results_args(p, "engine")
    p.add_argument("--tag", default=None, help="results file suffix (default: the dtype when not float32, "
                                                "then kv-<dtype> when --kv-cache-dtype is set)")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        p.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in systems]
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error("need 1 <= --min-prompt <= --max-prompt")
    if args.tag is None:
        parts = ([args.dtype] if args.dtype != "float32" else []) + (
            [f"kv-{args.kv_cache_dtype}"] if args.kv_cache_dtype not in ("auto", args.dtype) else [])
        args.tag = "-".join(parts) or None
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    token_range = regular_token_range(source)
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, args.seed, token_range)
    warmup = make_prompts(2, 8, 16, args.seed + 2, token_range)
    print(f"model {source.name} ({source.path}), dtype {args.dtype}, threads {args.threads}, "
          f"prompt tokens {sum(map(len, prompts))} (mean {sum(map(len, prompts)) / len(prompts):.0f}), "
          f"token ids in [{token_range[0]}, {token_range[1]})", flush=True)

    results: dict[str, SystemResult] = {}
    step: dict[str, Any] | None = None
    for system in args.systems:
        print(f"[{system}] running ...", flush=True)
        llm = make_llm(args) if system == "pdserve" else None
        if llm is not None:
            results[system] = run_pdserve(llm, prompts, warmup, args.output_len)
        elif system == "hf-cb":
            results[system] = run_hf_cb(args, str(source.path), prompts, warmup)
        else:
            results[system] = run_hf_static(args, str(source.path), prompts, warmup)
        r = results[system]
        check_counts(system, r.tokens_per_request, args.num_requests, args.output_len)
        print(f"[{system}] {r.wall_s:.2f} s, {r.tokens_per_s:.1f} output tok/s", flush=True)
        if llm is not None:
            print(f"[decode-step] batch {args.decode_batch} ...", flush=True)
            step = decode_step_bench(llm.engine, args.decode_batch, (args.min_prompt + args.max_prompt) // 2,
                                     args.decode_steps, args.seed, token_range)
            print(f"[decode-step] {step['step_s'] * 1e3:.2f} ms per step, matmuls {step['matmul_s'] * 1e3:.2f} ms "
                  f"({step['step_over_matmul_paired']:.2f}x, median of per-step ratios)", flush=True)
        del llm
        gc.collect()  # the system's model and KV cache go before the next one loads

    targets = target_lines(results, step, args.dtype, args.kv_cache_dtype)
    lines = report_lines(args, results, step, targets)
    print("\n" + "\n".join(lines), flush=True)
    import transformers

    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    payload = {"config": config, "model": {"name": source.name, "path": str(source.path)},
               "systems": {name: {**asdict(r), "tokens_per_s": r.tokens_per_s} for name, r in results.items()},
               "decode_step": step, "targets": targets, "transformers": transformers.__version__}
    stem = "engine_throughput" + (f"-{args.tag}" if args.tag else "")
    write_results(args.results_dir, stem, payload=payload, lines=lines, argv=None if argv is None else list(argv))


if __name__ == "__main__":
    main()
