"""Page-shard checksum speed (S7): kv_messenger.checksum's CRC32C (SSE4.2, interleaved and one chain;
slicing-by-8 table) against zlib.crc32, on one 1 MiB buffer and on that buffer cut into page-shard
runs (crc32c_runs, one value per run, as the sender and receiver hash what the shard plan writes).

    python -m bench.fabric.checksum [--repeat 200] [--run-bytes 12288] [--record]

Median of `--repeat` timed calls after a warm-up, single thread, process CPU clock. Seconds-long.
--record writes checksum.md into --results-dir (default bench/results/fabric/). Nothing waits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib

import numpy as np

from bench.common.results import add_results_args, write_results
from kv_messenger import checksum

MIB = 1 << 20


def median_s(fn, repeat: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.process_time_ns()
        fn()
        times.append((time.process_time_ns() - t0) / 1e9)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--run-bytes", type=int, default=12288,
                    help="bytes of one page-shard run (default: 3 KV heads x 16 tokens x 64 x float32)")
    ap.add_argument("--record", action="store_true", help="write checksum.md into --results-dir")
    add_results_args(ap, "fabric")
    args = ap.parse_args()
    buf = np.random.default_rng(0).integers(0, 256, size=MIB, dtype=np.uint8)   # [bytes]
    raw = buf.tobytes()
    n_runs = MIB // args.run_bytes
    offsets = np.arange(n_runs, dtype=np.uint64) * np.uint64(args.run_bytes)
    lengths = np.full(n_runs, args.run_bytes, dtype=np.uint64)
    impls = (["hw", "hw_serial"] if checksum.hardware() else []) + ["table"]
    rows = [("zlib.crc32 (CRC-32, not CRC32C)", "1 MiB buffer", median_s(lambda: zlib.crc32(raw), args.repeat))]
    for impl in impls:
        rows.append((f"crc32c {impl}", "1 MiB buffer",
                     median_s(lambda impl=impl: checksum.crc32c(buf, impl=impl), args.repeat)))
        rows.append((f"crc32c_runs {impl}", f"{n_runs} runs of {args.run_bytes} B",
                     median_s(lambda impl=impl: checksum.crc32c_runs(buf, offsets, lengths, impl=impl), args.repeat)))
    load = os.getloadavg()[0]
    lines = [
        "# Page-shard checksum: CRC32C (kv_messenger.checksum) vs zlib.crc32",
        "",
        f"SSE4.2: {checksum.hardware()}, one thread, median of {args.repeat} calls (process CPU time); "
        "commit, machine and command at the end.",
        "",
        "| what | input | µs | GB/s | vs zlib.crc32 |",
        "|---|---|---:|---:|---:|",
    ]
    base = rows[0][2]
    for name, what, s in rows:
        lines.append(f"| {name} | {what} | {s * 1e6:.1f} | {MIB / s / 1e9:.2f} | {base / s:.2f}x |")
    lines += ["", f"Load average (1 min) at the end: {load:.2f}."]
    print("\n".join(lines))
    if args.record:
        write_results(args.results_dir, "checksum", lines=lines)


if __name__ == "__main__":
    main()
