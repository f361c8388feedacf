"""Page-shard checksum speed (S7): kv_messenger.checksum's CRC32C (SSE4.2, interleaved and one chain;
slicing-by-8 table) against zlib.crc32, on one 1 MiB buffer and on that buffer cut into page-shard
runs (crc32c_runs, one value per run, as the sender and receiver hash what the shard plan writes).

    python -m bench.fabric.checksum [--repeat 200] [--run-bytes 12288] [--out bench/results/fabric/checksum.md]

Median of `--repeat` timed calls after a warm-up, single thread, process CPU clock. Seconds-long.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import zlib
from pathlib import Path

import numpy as np

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


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--run-bytes", type=int, default=12288,
                    help="bytes of one page-shard run (default: 3 KV heads x 16 tokens x 64 x float32)")
    ap.add_argument("--out", default="")
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
        f"`python -m bench.fabric.checksum --repeat {args.repeat} --run-bytes {args.run_bytes}`, "
        f"{time.strftime('%Y-%m-%d')}, {machine()}, SSE4.2: {checksum.hardware()}, one thread, median of "
        f"{args.repeat} calls (process CPU time).",
        "",
        "| what | input | µs | GB/s | vs zlib.crc32 |",
        "|---|---|---:|---:|---:|",
    ]
    base = rows[0][2]
    for name, what, s in rows:
        lines.append(f"| {name} | {what} | {s * 1e6:.1f} | {MIB / s / 1e9:.2f} | {base / s:.2f}x |")
    lines += ["", f"Load average (1 min) at the end: {load:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
