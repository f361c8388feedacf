"""Benchmark: the few-row float32 decode step against this machine's memory bandwidth (issue 31 item 1).

    python -m bench.engine.decode_bandwidth [--batches 1,2,4,8] [--threads 2] [--steps 16] [--tag T]

In one run, on --threads threads:

- the streaming bandwidth: bench/engine/stream_read.c (compiled here with the flags the C ops get,
  loaded with ctypes) sums a --array-mb float32 array (a read loop: 4 bytes per element) and runs
  STREAM's triad a = b + s c (12 bytes per element) on arrays of that size, each split in equal
  parts over the threads; best of --bw-repeats passes, measured before every batch size's steps
  and once at the end (the machine is shared: its speed drifts within minutes);
- for every batch size B: B requests of --ctx prompt tokens are prefilled, then --steps engine
  steps of B one-token decodes are timed (each checked to be one), each followed by one pass over
  the step's linear layers alone (the same `pdserve.kernels.ops.linear.linear` calls on the
  model's weights, bench.engine.throughput's linear loop), so both see the same load;
- where a step's time goes (median over the steps), timed inside the step by wrapping: the whole
  `engine.step()`; the runner's `execute` (of which `build_batches`: the step's index tensors, and
  the model's forward: embedding, layer loop, final norm, lm_head); the attention backend's calls
  (their KV writes included, also given alone); the sampler; and the C ops' calls by kind (the
  few-row matmul kernel; add+RMSNorm, rotary, SiLU-mul), through a stand-in for the ops module
  (TimedOps). "forward other" is forward - matmuls - attention - small ops (the Python layer
  loop, embedding, rotary tables); "engine other" is step - execute - sampler (scheduling,
  updating the requests, outputs).

Effective weight stream = bytes of weights one step reads (every linear layer's weight and bias,
lm_head included, and the norm weights) / step time; its fraction of the read bandwidth measured
just before that batch size is the issue's target (>= 85%). The matmul kernel calls' own stream
(bytes / their time in the step) and the linear loop alone's time are given beside it.

Results: <results-dir>/decode_bandwidth[-tag].json and .md (default bench/results/engine/).
Smoke run: tests/bench/test_engine_smoke.py (tiny checkpoint, one batch size). Nothing waits but
the compiler (bounded: 120 s) and the engine's own steps.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import runpy
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common.results import add_results_args, write_results
from bench.engine.throughput import linear_calls, make_prompts, matmul_pass, regular_token_range
from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels.ops.native import lib as ops_lib
from pdserve.model.loader import resolve_model

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TARGET_FRACTION = 0.85
_CC_TIMEOUT_S = 120


# --- bandwidth ---------------------------------------------------------------------------------


class Stream:
    """bench/engine/stream_read.c built in a temporary folder and loaded; arrays allocated once."""

    def __init__(self, array_mb: int, threads: int) -> None:
        native_build = runpy.run_path(str(REPO / "native_build.py"))
        compile_args, link_args = native_build["cflags"](openmp=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-stream-")
        so = os.path.join(self._tmp.name, "stream_read.so")
        cmd = [native_build["compiler"](), *compile_args, "-shared", "-fPIC", str(HERE / "stream_read.c"),
               "-o", so, *link_args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=_CC_TIMEOUT_S)
        self.lib = ctypes.CDLL(so)
        self.lib.sb_read.restype = ctypes.c_double
        self.lib.sb_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self.lib.sb_triad.restype = None
        self.lib.sb_triad.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                      ctypes.c_int64, ctypes.c_int]
        self.n = array_mb * (1 << 20) // 4
        self.threads = threads
        self.a, self.b, self.c = (torch.full((self.n,), v, dtype=torch.float32) for v in (1.0, 2.0, 0.5))  # [n]
        self.flags = " ".join(compile_args)

    def measure(self, repeats: int) -> dict[str, float]:
        """Best-of-`repeats` GB/s (1e9 bytes / s) of the read loop and of the triad."""
        read, triad = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            total = self.lib.sb_read(self.a.data_ptr(), self.n, self.threads)
            read.append(time.perf_counter() - t0)
            if total != float(self.n):
                raise RuntimeError(f"the read loop summed {total}, expected {self.n}")
            t0 = time.perf_counter()
            self.lib.sb_triad(self.a.data_ptr(), self.b.data_ptr(), self.c.data_ptr(), 2.0, self.n, self.threads)
            triad.append(time.perf_counter() - t0)
            self.a.fill_(1.0)   # a = 2 + 2 * 0.5 = 3 after the triad; the read loop expects ones
        return {"read_gbs": 4 * self.n / min(read) / 1e9, "triad_gbs": 12 * self.n / min(triad) / 1e9}


# --- the decode step ---------------------------------------------------------------------------


class PhaseTimer:
    """Wraps instance methods so that each call's seconds add to `seconds[name]`; remove() undoes it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._wrapped: list[tuple[object, str]] = []

    def wrap(self, obj: object, method: str, name: str) -> None:
        inner = getattr(obj, method)
        self.seconds[name] = 0.0

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        setattr(obj, method, timed)
        self._wrapped.append((obj, method))

    def reset(self) -> None:
        for name in self.seconds:
            self.seconds[name] = 0.0

    def remove(self) -> None:
        for obj, method in self._wrapped:
            delattr(obj, method)   # the instance attribute goes; the class's method shows again


# The C ops' entry points a step calls, by what they do (the rest pass through untimed).
OPS_KINDS = {"sl_linear_addr": "kernel_matmul", "sl_linear_blocked_addr": "kernel_matmul",
             "op_add_rms_norm_addr": "small_ops", "op_rope_qk_addr": "small_ops", "op_silu_mul_addr": "small_ops",
             "op_write_kv_addr": "kv_write"}
# The modules that call them through a module-global `_lib` (looked up at each call or pass).
OPS_USERS = ("pdserve.model.layer_ops", "pdserve.kernels.ops.linear", "pdserve.kernels.ops.norm_act",
             "pdserve.kernels.ops.rope_kv")


class TimedOps:
    """Stands in for the C ops module (`_lib`) in OPS_USERS: the entry points of OPS_KINDS add
    their seconds to `timer.seconds[kind]`, so a step's own kernel time is measured inside it
    (a Python wrapper per call: ~0.3 us, ~250 calls a step)."""

    def __init__(self, lib: Any, timer: PhaseTimer) -> None:
        self._lib, self._timer = lib, timer
        for kind in set(OPS_KINDS.values()):
            timer.seconds[kind] = 0.0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        kind = OPS_KINDS.get(name)
        if kind is None:
            return fn
        seconds = self._timer.seconds

        def timed(*a: Any) -> Any:
            t0 = time.perf_counter()
            rc = fn(*a)
            seconds[kind] += time.perf_counter() - t0
            return rc

        return timed


def _install_ops(timer: PhaseTimer) -> Callable[[], None]:
    """TimedOps into every OPS_USERS module; returns the undo."""
    import importlib

    modules = [importlib.import_module(name) for name in OPS_USERS]
    proxy = TimedOps(ops_lib, timer)
    for m in modules:
        m._lib = proxy

    def undo() -> None:
        for m in modules:
            m._lib = ops_lib

    return undo


def weight_bytes(engine: LLMEngine, calls: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> int:
    """Bytes of the weights one decode step reads: every linear's weight and bias (lm_head's
    included) and every 1-D parameter (the norms)."""
    total = sum(w.numel() * w.element_size() + (0 if b is None else b.numel() * b.element_size())
                for _, w, b in calls)
    return total + sum(p.numel() * p.element_size() for p in engine.model.parameters() if p.dim() == 1)


def _phase_timer(engine: LLMEngine) -> PhaseTimer:
    timer = PhaseTimer()
    runner = engine.runner
    timer.wrap(runner, "execute", "execute")
    timer.wrap(runner, "build_batches", "build_batches")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.backend, "forward", "attention")
    timer.wrap(engine.sampler, "sample", "sample")
    return timer


def decode_steps(engine: LLMEngine, batch: int, ctx: int, steps: int,
                 token_range: tuple[int, int]) -> dict[str, Any]:
    """Prefill `batch` requests of `ctx` tokens, then time `steps` decode steps with their phases,
    each followed by a linear-loop pass and a small-ops pass; medians (seconds)."""
    prompts = make_prompts(batch, ctx, ctx, 1000 + batch, token_range)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while any(not r.output_token_ids for r in requests):
        engine.step()
    calls = linear_calls(engine, batch)
    timer = _phase_timer(engine)
    undo_ops = _install_ops(timer)
    rows: dict[str, list[float]] = {}
    try:
        for i in range(steps + 2):   # two untimed steps first
            timer.reset()
            before = engine.num_forward_tokens
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            if engine.num_forward_tokens - before != batch:
                raise RuntimeError(f"step ran {engine.num_forward_tokens - before} tokens, not a batch-{batch} decode")
            sample = {"step": wall, **timer.seconds, "matmul": matmul_pass(calls)}
            if i >= 2:
                for key, value in sample.items():
                    rows.setdefault(key, []).append(value)
    finally:
        undo_ops()
        timer.remove()
        for r in requests:
            engine.abort_request(r.request_id)
        while engine.has_unfinished_requests():
            engine.step()
    med = {f"{key}_s": statistics.median(values) for key, values in rows.items()}
    med["forward_other_s"] = (med["forward_s"] - med["kernel_matmul_s"] - med["attention_s"]
                              - med["small_ops_s"])
    med["execute_other_s"] = med["execute_s"] - med["forward_s"] - med["build_batches_s"]
    med["engine_other_s"] = med["step_s"] - med["execute_s"] - med["sample_s"]
    med["outside_matmul_share"] = statistics.median(1 - m / s for m, s in zip(rows["kernel_matmul"], rows["step"],
                                                                                 strict=True))
    return {"batch": batch, "ctx": ctx, "timed_steps": steps, **med, "step_min_s": min(rows["step"])}


# --- report ------------------------------------------------------------------------------------

_PHASES = (
    ("step_s", "whole engine.step()"),
    ("kernel_matmul_s", "matmuls (the few-row kernel's calls inside the step)"),
    ("attention_s", "attention backend (its KV writes included)"),
    ("kv_write_s", "of which KV writes"),
    ("small_ops_s", "add+RMSNorm, rotary, SiLU-mul (C calls inside the step)"),
    ("forward_other_s", "forward other (Python layer loop, embedding, rotary tables, logits copy)"),
    ("build_batches_s", "build_batches (the step's index tensors)"),
    ("execute_other_s", "execute other (rows bookkeeping)"),
    ("sample_s", "sampler"),
    ("engine_other_s", "engine other (schedule, update, outputs)"),
)


def add_stream(point: dict[str, Any], nbytes: int, bw: dict[str, float]) -> dict[str, Any]:
    """The step's and the linear loop's weight stream (GB/s) and their fractions of `bw`'s read
    bandwidth (the measurement just before the batch size's steps)."""
    step_gbs, kernel_gbs = nbytes / point["step_s"] / 1e9, nbytes / point["kernel_matmul_s"] / 1e9
    return {**point, "bandwidth": bw, "weight_stream_gbs": step_gbs, "fraction_of_read": step_gbs / bw["read_gbs"],
            "kernel_stream_gbs": kernel_gbs, "kernel_fraction_of_read": kernel_gbs / bw["read_gbs"],
            "matmul_stream_gbs": nbytes / point["matmul_s"] / 1e9}


def report_lines(args: argparse.Namespace, nbytes: int, points: list[dict[str, Any]],
                 bandwidths: list[dict[str, float]], model: str) -> list[str]:
    lines = [
        f"# Few-row float32 decode step vs memory bandwidth ({model}, {args.threads} threads)", "",
        f"Weights one step reads: {nbytes / 1e6:.1f} MB. Read bandwidth (best of {args.bw_repeats} passes over "
        f"{args.array_mb} MB, {args.threads} threads), measured before each batch size and at the end: "
        + ", ".join(f"{b['read_gbs']:.1f}" for b in bandwidths) + " GB/s; triad "
        + ", ".join(f"{b['triad_gbs']:.1f}" for b in bandwidths) + " GB/s. "
        f"Median of {args.steps} steps per batch size, prompts of {args.ctx} tokens. Target: a step's weight "
        f"stream >= {TARGET_FRACTION:.0%} of the read bandwidth.", "",
        "| batch | step ms | tok/s per user | weight stream GB/s | of read bw | matmuls in the step ms | their GB/s | "
        "their fraction | linear loop alone ms | outside matmuls | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|",
    ]
    for p in points:
        verdict = "PASS" if p["fraction_of_read"] >= TARGET_FRACTION else "MISS"
        lines.append(f"| {p['batch']} | {p['step_s'] * 1e3:.2f} | {1 / p['step_s']:.1f} | "
                     f"{p['weight_stream_gbs']:.2f} | {p['fraction_of_read']:.0%} | "
                     f"{p['kernel_matmul_s'] * 1e3:.2f} | {p['kernel_stream_gbs']:.2f} | "
                     f"{p['kernel_fraction_of_read']:.0%} | {p['matmul_s'] * 1e3:.2f} | "
                     f"{p['outside_matmul_share']:.0%} | {verdict} |")
    one = points[0]
    lines += ["", f"## Where a batch-{one['batch']} step goes (medians, ms; shares of the step)", "",
              "| phase | ms | share |", "|:--|---:|---:|"]
    for key, label in _PHASES:
        lines.append(f"| {label} | {one[key] * 1e3:.3f} | {one[key] / one['step_s']:.1%} |")
    lines += ["", f"Outside the matmuls: {one['outside_matmul_share']:.0%} of the step (median of per-step "
              "1 - the kernel calls' time / step).", "", f"C flags of the bandwidth loop: `{args.stream_flags}`."]
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: pdserve's default model)")
    p.add_argument("--batches", default="1,2,4,8", help="decode batch sizes")
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per batch size")
    p.add_argument("--threads", type=int, default=2, help="engine and bandwidth-loop threads")
    p.add_argument("--array-mb", type=int, default=512, help="bandwidth arrays' size (MB each)")
    p.add_argument("--bw-repeats", type=int, default=5, help="bandwidth passes per measurement (best kept)")
    p.add_argument("--tag", default=None, help="results file suffix")
    add_results_args(p, "engine")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if min(args.batches) < 1 or args.steps < 1 or args.threads < 1 or args.array_mb < 1:
        p.error("batches, --steps, --threads and --array-mb must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if ops_lib is None:
        raise SystemExit("the C ops are not built (pdserve.kernels.ops._cpu_ops)")
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    stream = Stream(args.array_mb, args.threads)
    args.stream_flags = stream.flags
    engine = LLMEngine(EngineConfig.from_options(model=source.path, num_threads=args.threads, max_batch_tokens=512,
                                                 max_requests_per_batch=max(args.batches), kv_prefault=True))
    token_range = regular_token_range(source)
    nbytes = weight_bytes(engine, linear_calls(engine, 1))
    load_before = os.getloadavg()[0]
    points, bandwidths = [], []
    with torch.inference_mode():
        for batch in args.batches:
            bw = stream.measure(args.bw_repeats)
            bandwidths.append(bw)
            point = add_stream(decode_steps(engine, batch, args.ctx, args.steps, token_range),
                               nbytes, bw)
            points.append(point)
            print(f"[batch {batch}] step {point['step_s'] * 1e3:.2f} ms, {point['weight_stream_gbs']:.2f} GB/s = "
                  f"{point['fraction_of_read']:.0%} of read {bw['read_gbs']:.1f} GB/s; matmuls "
                  f"{point['kernel_matmul_s'] * 1e3:.2f} ms; outside matmuls {point['outside_matmul_share']:.0%}",
                  flush=True)
        bandwidths.append(stream.measure(args.bw_repeats))
    load = f"Load average (1 min) before {load_before:.2f}, after {os.getloadavg()[0]:.2f}."
    lines = [*report_lines(args, nbytes, points, bandwidths, Path(source.path).name), "", load]
    payload = {"config": {k: v for k, v in vars(args).items() if k != "results_dir"}, "model": source.path,
               "weight_bytes": nbytes, "bandwidth": bandwidths, "points": points,
               "target_fraction": TARGET_FRACTION, "load_average": load}
    stem = "decode_bandwidth" + (f"-{args.tag}" if args.tag else "")
    write_results(args.results_dir, stem, payload=payload, lines=lines)


if __name__ == "__main__":
    main()
