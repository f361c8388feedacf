"""Write bandwidth and latency of TransferEngine next to C and memcpy.

    python -m fabric.bench [--providers shm,tcp;ofi_rxm] [--bytes N] [--record]

For each provider and write size (16 KiB, 64 KiB, 256 KiB, 1 MiB) it runs
the C reference bench/fabric/fi_bench.c (built here with cc; windowed
fi_writedata between two processes) and the same pattern through
TransferEngine (imm_mode "every", the same window), and prints Python as %
of C, plus plain memcpy (numpy) bandwidth of the same sizes. --record writes
bench/results/fabric.md and fabric.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

logger = logging.getLogger(__name__)

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20)
POOL = 64 << 20
WINDOW = 64
BATCH = 256
LAT_ITERS = 200
TAG = 7
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C_SOURCE = os.path.join(REPO, "bench", "fabric", "fi_bench.c")
RESULTS = os.path.join(REPO, "bench", "results")


@dataclass
class Row:
    provider: str
    size: int
    c_gbps: float
    py_gbps: float
    c_lat_us: float
    py_lat_us: float
    memcpy_gbps: float

    @property
    def pct(self) -> float:
        return 100.0 * self.py_gbps / self.c_gbps if self.c_gbps else 0.0


def machine() -> dict:
    model = "unknown"
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    from fabric._libfabric import lib

    v = lib.fi_version()
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "loadavg_before": round(os.getloadavg()[0], 2),
        "libfabric": f"{v >> 16}.{v & 0xFFFF}",
        "thp": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
        else "n/a",
    }



def build_c(tmp: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    exe = os.path.join(tmp, "fi_bench")
    subprocess.run([cc, "-O2", "-o", exe, C_SOURCE, "-lfabric"], check=True)
    return exe


def run_c(exe: str, provider: str, size: int, total: int, huge: bool) -> dict:
    out = subprocess.run(
        [exe, provider, "127.0.0.1", str(size), str(total), str(WINDOW), str(LAT_ITERS), "1" if huge else "0"],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _receiver(conn, provider: str, huge: bool) -> None:
    from fabric import FabricConfig, TransferEngine, alloc_buffer

    engine = TransferEngine(FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every"))
    pool = alloc_buffer(POOL, huge_pages=huge)
    np.frombuffer(pool, dtype=np.uint8)[:] = 0x5A  # fault the pages in, as the C side does
    region = engine.register(pool)
    conn.send(region.descriptor)
    conn.recv()  # until told to stop
    engine.close()


def run_python(provider: str, size: int, total: int, huge: bool) -> tuple[float, float]:
    from fabric import FabricConfig, TransferEngine, alloc_buffer

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, provider, huge), daemon=True)
    proc.start()
    engine = TransferEngine(FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every", tx_depth=WINDOW))
    try:
        if not parent.poll(60):
            raise TimeoutError("receiver did not start")
        dst = parent.recv()
        src_buf = alloc_buffer(POOL, huge_pages=huge)
        np.frombuffer(src_buf, dtype=np.uint8)[:] = 0x5A
        src = engine.register(src_buf)
        engine.connect(dst.peer)
        n = total // size
        slots = POOL // size
        offsets = (np.arange(n, dtype=np.uint64) % slots) * size
        lengths = np.full(BATCH, size, dtype=np.uint64)
        nbatches = (n + BATCH - 1) // BATCH
        done = threading.Semaphore(0)
        errors: list[Exception] = []

        def on_error(err: Exception) -> None:
            errors.append(err)
            done.release()

        t0 = time.perf_counter()
        for b in range(nbatches):
            part = offsets[b * BATCH : (b + 1) * BATCH]
            engine.write_pages(src, part, dst, part, lengths[: part.size], TAG, done.release, on_error)
        for _ in range(nbatches):
            if not done.acquire(timeout=300):
                raise TimeoutError("bandwidth run did not complete")
        seconds = time.perf_counter() - t0
        if errors:
            raise errors[0]
        one = threading.Event()
        lat = 0.0
        for _ in range(LAT_ITERS):
            one.clear()
            t = time.perf_counter()
            engine.write_pages(src, [0], dst, [0], [size], TAG + 1, one.set, on_error)
            if not one.wait(30):
                raise TimeoutError("latency write did not complete")
            lat += time.perf_counter() - t
        return n * size / seconds / 1e9, lat / LAT_ITERS * 1e6
    finally:
        engine.close()
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def memcpy_gbps(size: int, total: int) -> float:
    src = np.full(POOL, 0x5A, dtype=np.uint8)
    dst = np.zeros(POOL, dtype=np.uint8)
    slots = POOL // size
    n = total // size
    t0 = time.perf_counter()
    for i in range(n):
        off = (i % slots) * size
        np.copyto(dst[off : off + size], src[off : off + size])
    return n * size / (time.perf_counter() - t0) / 1e9


def available(provider: str) -> bool:
    from fabric import FabricConfig, FabricError, TransferEngine

    try:
        TransferEngine(FabricConfig(provider=provider, node="127.0.0.1")).close()
    except FabricError as exc:
        logger.warning("provider %s unavailable: %s", provider, exc)
        return False
    return True


def render(info: dict, rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        "# fabric benchmark",
        "",
        f"Command: `python -m fabric.bench --bytes {args.bytes}{'' if args.huge else ' --no-huge'}`",
        "",
        f"Machine: {info['nproc']} cores, {info['cpu']}, kernel {info['kernel']}, libfabric "
        f"{info['libfabric']}, THP `{info['thp']}`; {info['date']}. Load average (1 min) "
        f"{info['loadavg_before']} before, {info.get('loadavg_after', '?')} after the run.",
        "",
        "A load average above the core count means other work shared the cores: C and Python "
        "rows then compete with it unevenly (the C receiver busy-polls, the engine's progress "
        "thread yields), so compare rows of one run only and re-run on a quiet machine.",
        "",
        f"Each row moves {args.bytes >> 20} MiB with writes of the given size, window {WINDOW} "
        f"writes in flight, every write carrying immediate data, between two processes on one host "
        f"(huge pages: {'yes' if args.huge else 'no'}). Latency: one write at a time, post to local "
        f"completion, mean of {LAT_ITERS}. memcpy: numpy copyto of the same sizes.",
        "",
        "| provider | size | C GB/s | Python GB/s | Python % of C | C lat us | Python lat us | memcpy GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.provider} | {r.size >> 10} KiB | {r.c_gbps:.2f} | {r.py_gbps:.2f} | {r.pct:.0f}% | "
            f"{r.c_lat_us:.1f} | {r.py_lat_us:.1f} | {r.memcpy_gbps:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", default="shm,tcp;ofi_rxm")
    parser.add_argument("--bytes", type=int, default=512 << 20, help="bytes moved per row")
    parser.add_argument("--no-huge", dest="huge", action="store_false", help="normal pages only")
    parser.add_argument("--record", action="store_true", help="write bench/results/fabric.md and .json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    info = machine()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp:
        exe = build_c(tmp)
        for provider in args.providers.split(","):
            if not available(provider):
                continue
            for size in SIZES:
                c = run_c(exe, provider, size, args.bytes, args.huge)
                py_gbps, py_lat = run_python(provider, size, args.bytes, args.huge)
                row = Row(provider, size, c["gbps"], py_gbps, c["lat_us"], py_lat, memcpy_gbps(size, args.bytes))
                rows.append(row)
                print(
                    f"{provider:12s} {size >> 10:5d} KiB  C {row.c_gbps:6.2f} GB/s  Python {row.py_gbps:6.2f} GB/s "
                    f"({row.pct:3.0f}% of C)  lat C {row.c_lat_us:8.1f} us  Python {row.py_lat_us:8.1f} us  "
                    f"memcpy {row.memcpy_gbps:6.2f} GB/s",
                    flush=True,
                )
    info["loadavg_after"] = round(os.getloadavg()[0], 2)
    text = render(info, rows, args)
    print(text)
    if args.record:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "fabric.md"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(RESULTS, "fabric.json"), "w", encoding="utf-8") as f:
            json.dump({"machine": info, "rows": [asdict(r) | {"pct_of_c": r.pct} for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
