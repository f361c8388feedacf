"""Write bandwidth and latency of TransferEngine next to C and memcpy.

    python -m bench.fabric.transfer [--providers shm,tcp;ofi_rxm] [--pages both|huge|normal]
                                              [--bytes N] [--sizes S,...] [--repeat R] [--record]

For each provider, page kind (transparent huge pages or normal pages, for
both sides' pools) and write size (16 KiB, 64 KiB, 256 KiB, 1 MiB) it runs
the C reference bench/fabric/fi_bench.c (built here with cc; windowed
fi_writedata between two processes, the same page kind) and the same
pattern through TransferEngine (imm_mode "every", coalescing off, the same
window), and prints Python as % of C. It also measures:

- Python coalesced: the same bytes as runs of contiguous pages with
  coalescing on (what the KV messenger does with adjacent pages);
- latency, one write at a time, three ways: "callback" (write_pages, the
  progress thread polls and calls on_done, which wakes the caller: the KV
  messenger's path), "sync" (write_pages_sync: the caller polls its own
  completion, default config, the receiver's progress thread sleeps between
  writes), and "busy" (write_pages_sync with busy_poll=True on both engines,
  like the C program, whose two sides both busy-poll);
- the receiving engine's CPU use while idle (its progress thread sleeps),
  and the same for a busy_poll receiver (what that mode costs);
- copy ceilings on the same page kind: memcpy and process_vm_readv (CMA,
  how shm moves writes above its inject size) of the same block sizes in
  C, and numpy copyto.

With --repeat R every measurement runs R times and the median is kept (all
values go to the JSON). --record writes fabric[-TAG].md and .json into --results-dir (default
bench/results/fabric/), stamped with commit, date and machine.
A short check that it runs: --providers shm --pages huge --sizes 65536 --bytes 8388608.

Pools come from the engine's allocator (pdserve.engine.cache.hostmem, as the KV pool does);
the transport registers their views. Only fabric's public names are used.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from bench.common.results import add_results_args, write_results
from fabric import FabricConfig, FabricError, PageWrites, TransferEngine, environment
from pdserve.engine.cache.hostmem import alloc_buffer, thp_mode

logger = logging.getLogger(__name__)

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20)
POOL = 64 << 20
WINDOW = 64
BATCH = 256
LAT_ITERS = 200
IDLE_S = 2.0
TAG = 7
C_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fi_bench.c")
NIXL = {"shm": 12.5, "tcp;ofi_rxm": 5.6}  # GB/s, NIXL over UCX, 1 MiB, this machine (issue #3)


@dataclass
class Row:
    provider: str
    size: int
    huge: bool
    c_gbps: float
    py_gbps: float
    py_coalesced_gbps: float
    c_lat_us: float
    py_lat_us: float  # callback path (write_pages + on_done), mean
    py_lat_p50_us: float
    py_sync_lat_us: float  # write_pages_sync, default config, mean
    py_sync_lat_p50_us: float
    py_sync_slept_pct: float  # sync calls whose spin budget ran out (they slept)
    py_busy_lat_p50_us: float  # write_pages_sync, busy_poll on both engines
    receiver_idle_cpu_pct: float
    busy_receiver_idle_cpu_pct: float
    memcpy_gbps: float  # numpy copyto
    c_memcpy_gbps: float
    c_cma_gbps: float
    huge_kib: dict = field(default_factory=dict)  # how much of each pool THP really backed
    samples: dict = field(default_factory=dict)  # every repeat of every measurement

    @property
    def pct(self) -> float:
        return 100.0 * self.py_gbps / self.c_gbps if self.c_gbps else 0.0


def fabric_env() -> dict:
    """What the transport's speed depends on beyond the machine (the results writer stamps that)."""
    v = _libfabric_version()
    return {"loadavg_before": round(os.getloadavg()[0], 2), "libfabric": f"{v >> 16}.{v & 0xFFFF}",
            "thp": thp_mode()}


def _libfabric_version() -> int:
    """fi_version() of the system libfabric (the one the engine and fi_bench.c link)."""
    name = ctypes.util.find_library("fabric")
    if name is None:
        raise RuntimeError("libfabric not found (ctypes.util.find_library('fabric'))")
    lib = ctypes.CDLL(name)
    lib.fi_version.restype = ctypes.c_uint32
    return int(lib.fi_version())


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


def _cpu_seconds() -> float:
    with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_copy(exe: str, size: int, total: int, huge: bool) -> dict:
    out = subprocess.run([exe, "copy", str(size), str(total), "1" if huge else "0"],
                         check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _receiver(conn, provider: str, huge: bool, busy_poll: bool = False) -> None:
    engine = TransferEngine(FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every", busy_poll=busy_poll))
    pool = alloc_buffer(POOL, huge_pages=huge, populate=True)  # faulted in, as the C side does
    region = engine.register(pool.view)
    conn.send((region.descriptor, pool.huge_page_bytes() >> 10))
    while True:
        cmd = conn.recv()
        if cmd == "idle":  # CPU use of this process while nothing arrives
            c0, t0 = _cpu_seconds(), time.monotonic()
            time.sleep(IDLE_S)
            conn.send(100.0 * (_cpu_seconds() - c0) / (time.monotonic() - t0))
        else:
            break
    engine.close()


def _bandwidth(engine, src, dst, size: int, total: int, contiguous: bool) -> float:
    """GB/s of `total` bytes in writes of `size` (contiguous: batches of adjacent pages)."""
    n = total // size
    slots = POOL // size
    if contiguous:
        offsets = (np.arange(n, dtype=np.uint64) % slots) * size
    else:  # every other slot: no two writes of a batch are adjacent
        offsets = ((np.arange(n, dtype=np.uint64) * 2) % slots) * size
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
        engine.write(PageWrites(src, part, dst, part, lengths[: part.size], TAG), done.release, on_error)
    for _ in range(nbatches):
        if not done.acquire(timeout=300):
            raise TimeoutError("bandwidth run did not complete")
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return n * size / seconds / 1e9


def _latency(engine, src, dst, size: int) -> list[float]:
    """Seconds per lone write, write_pages to on_done waking this thread."""
    one = threading.Event()
    errors: list[Exception] = []
    lat = []
    zero, lens = np.zeros(1, dtype=np.uint64), np.full(1, size, dtype=np.uint64)
    for _ in range(LAT_ITERS):
        one.clear()
        t = time.perf_counter()
        engine.write(PageWrites(src, zero, dst, zero, lens, TAG + 1), one.set, errors.append)
        if not one.wait(30):
            raise TimeoutError("latency write did not complete")
        lat.append(time.perf_counter() - t)
    if errors:
        raise errors[0]
    return lat


def _latency_sync(engine, src, dst, size: int) -> tuple[list[float], int]:
    """Seconds per lone write_pages_sync, and how many of them slept."""
    lat = []
    slept = 0
    zero, lens = np.zeros(1, dtype=np.uint64), np.full(1, size, dtype=np.uint64)
    for _ in range(LAT_ITERS):
        t = time.perf_counter()
        res = engine.write_sync(PageWrites(src, zero, dst, zero, lens, TAG + 2), timeout=30)
        lat.append(time.perf_counter() - t)
        slept += res.slept
    return lat, slept


def _start_receiver(provider: str, huge: bool, busy_poll: bool):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, provider, huge, busy_poll), daemon=True)
    proc.start()
    if not parent.poll(60):
        proc.kill()
        raise TimeoutError("receiver did not start")
    return proc, parent


def _stop_receiver(proc, parent) -> None:
    parent.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _idle_cpu(parent) -> float:
    parent.send("idle")
    if not parent.poll(IDLE_S + 30):
        raise TimeoutError("receiver did not report its idle CPU")
    return parent.recv()


def run_busy(provider: str, size: int, huge: bool) -> dict:
    """Lone-write latency with busy_poll on both engines, and the busy receiver's idle CPU."""
    proc, parent = _start_receiver(provider, huge, busy_poll=True)
    engine = TransferEngine(FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every", busy_poll=True))
    try:
        dst, _ = parent.recv()
        src_buf = alloc_buffer(POOL, huge_pages=huge, populate=True)
        src = engine.register(src_buf.view)
        engine.connect(dst.peer)
        _latency_sync(engine, src, dst, size)  # warm-up
        lat, _ = _latency_sync(engine, src, dst, size)
        engine.close()  # only the receiver's idle CPU is measured, not ours as well
        return {"lat_p50_us": statistics.median(lat) * 1e6, "idle_cpu_pct": _idle_cpu(parent)}
    finally:
        engine.close()
        _stop_receiver(proc, parent)


def run_python(provider: str, size: int, total: int, huge: bool) -> dict:
    proc, parent = _start_receiver(provider, huge, busy_poll=False)
    base = dict(provider=provider, node="127.0.0.1", imm_mode="every", tx_depth=WINDOW)
    engine = TransferEngine(FabricConfig(**base, coalesce=False))
    merger = TransferEngine(FabricConfig(**base, coalesce=True))
    try:
        dst, dst_huge_kib = parent.recv()
        src_buf = alloc_buffer(POOL, huge_pages=huge, populate=True)
        src = engine.register(src_buf.view)
        msrc = merger.register(src_buf.view)
        engine.connect(dst.peer)
        merger.connect(dst.peer)
        # warm-up: first contact (per-peer endpoints, connections) and first CMA of each page
        _bandwidth(engine, src, dst, size, min(total, POOL), contiguous=False)
        _bandwidth(merger, msrc, dst, size, min(total, POOL), contiguous=True)
        gbps = _bandwidth(engine, src, dst, size, total, contiguous=False)
        coalesced = _bandwidth(merger, msrc, dst, size, total, contiguous=True)
        _latency(engine, src, dst, size)  # warm-up
        lat = _latency(engine, src, dst, size)
        sync_lat, slept = _latency_sync(engine, src, dst, size)
        idle_cpu = _idle_cpu(parent)
        return {
            "gbps": gbps, "coalesced_gbps": coalesced, "lat_us": statistics.fmean(lat) * 1e6,
            "lat_p50_us": statistics.median(lat) * 1e6, "sync_lat_us": statistics.fmean(sync_lat) * 1e6,
            "sync_lat_p50_us": statistics.median(sync_lat) * 1e6, "sync_slept_pct": 100.0 * slept / LAT_ITERS,
            "idle_cpu_pct": idle_cpu,
            "src_huge_kib": src_buf.huge_page_bytes() >> 10, "dst_huge_kib": dst_huge_kib,
            "delivery_complete": engine.delivery_complete, "wait_mode": engine.wait_mode,
        }
    finally:
        engine.close()
        merger.close()
        _stop_receiver(proc, parent)


def memcpy_gbps(size: int, total: int, huge: bool) -> float:
    """numpy copyto of `size` blocks between two pools of the given page kind."""
    src_buf = alloc_buffer(POOL, huge_pages=huge, populate=True)
    dst_buf = alloc_buffer(POOL, huge_pages=huge, populate=True)
    src, dst = src_buf.numpy(), dst_buf.numpy()
    src[:] = 0x5A
    slots = POOL // size
    n = total // size
    t0 = time.perf_counter()
    for i in range(n):
        off = (i % slots) * size
        np.copyto(dst[off : off + size], src[off : off + size])
    return n * size / (time.perf_counter() - t0) / 1e9


def available(provider: str) -> bool:
    try:
        TransferEngine(FabricConfig(provider=provider, node="127.0.0.1")).close()
    except FabricError as exc:
        logger.warning("provider %s unavailable: %s", provider, exc)
        return False
    return True


def measure(exe: str, provider: str, size: int, total: int, huge: bool, repeat: int) -> Row:
    cs, ps, bs, ms, copies = [], [], [], [], []
    for _ in range(repeat):
        cs.append(run_c(exe, provider, size, total, huge))
        ps.append(run_python(provider, size, total, huge))
        bs.append(run_busy(provider, size, huge))
        ms.append(memcpy_gbps(size, total, huge))
        copies.append(run_copy(exe, size, total, huge))

    def med(values: list[dict], key: str) -> float:
        return float(statistics.median(v[key] for v in values))

    return Row(
        provider, size, huge, med(cs, "gbps"), med(ps, "gbps"), med(ps, "coalesced_gbps"), med(cs, "lat_us"),
        med(ps, "lat_us"), med(ps, "lat_p50_us"), med(ps, "sync_lat_us"), med(ps, "sync_lat_p50_us"),
        med(ps, "sync_slept_pct"), med(bs, "lat_p50_us"), med(ps, "idle_cpu_pct"), med(bs, "idle_cpu_pct"),
        float(statistics.median(ms)), med(copies, "memcpy_gbps"), med(copies, "cma_gbps"),
        huge_kib={"c_src": cs[-1].get("src_huge_kib"), "c_dst": cs[-1].get("dst_huge_kib"),
                  "py_src": ps[-1]["src_huge_kib"], "py_dst": ps[-1]["dst_huge_kib"],
                  "copy_src": copies[-1]["src_huge_kib"], "copy_dst": copies[-1]["dst_huge_kib"]},
        samples={"c": cs, "python": ps, "busy": bs, "memcpy_gbps": ms, "copy": copies},
    )


def render(info: dict, rows: list[Row], args: argparse.Namespace) -> list[str]:
    lines = [
        "# fabric benchmark",
        "",
        f"libfabric {info['libfabric']}, THP `{info['thp']}` (commit, machine and command at the end). "
        f"Load average (1 min) {info['loadavg_before']} before, {info.get('loadavg_after', '?')} after the run.",
        "",
        "A load average above the core count means other work shared the cores: C and Python "
        "rows then compete with it unevenly (the C receiver busy-polls, the engine's progress "
        "thread sleeps when idle), so compare rows of one run only and re-run on a quiet machine.",
        "",
        f"Each bandwidth row moves {args.bytes >> 20} MiB with writes of the given size, window {WINDOW} "
        "writes in flight, every write carrying immediate data, between two processes on one host; "
        "both pools on transparent huge pages (huge) or normal pages. Python: TransferEngine with "
        "coalescing off and no two writes of a batch adjacent (the same writes as C). Python "
        "coalesced: batches of adjacent pages, coalescing on (the KV messenger's case). Copy "
        "ceilings, same page kind and block size: C memcpy within one process, C CMA "
        "(process_vm_readv from another process: the copy shm makes for every write above its "
        "inject size, on the target's core), numpy copyto. "
        f"Medians of {args.repeat} run(s). Both C and Python run with FI_TCP_NODELAY="
        f"{os.environ.get('FI_TCP_NODELAY', 'unset')} (the engine's default); the engine's "
        "FI_DELIVERY_COMPLETE and wait mechanism per provider: "
        + ", ".join(sorted({f"{r.provider}: {r.samples['python'][-1]['delivery_complete']}, "
                            f"{r.samples['python'][-1]['wait_mode']}" for r in rows})) + ".",
        "",
        "| provider | pages | size | C GB/s | Python GB/s | % of C | coalesced GB/s | C memcpy GB/s | "
        "C CMA GB/s | numpy memcpy GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.provider} | {'huge' if r.huge else 'normal'} | {r.size >> 10} KiB | {r.c_gbps:.2f} | "
            f"{r.py_gbps:.2f} | {r.pct:.0f}% | {r.py_coalesced_gbps:.2f} | {r.c_memcpy_gbps:.2f} | "
            f"{r.c_cma_gbps:.2f} | {r.memcpy_gbps:.2f} |"
        )
    lines += [
        "",
        f"Latency: one write at a time, post to completion, {LAT_ITERS} writes, microseconds. C: both "
        "sides busy-poll (mean / p50). callback: write_pages, the progress thread polls the CQ and "
        "calls on_done, which wakes the caller (the KV messenger's path). sync: write_pages_sync, "
        "default config (the caller polls its own completion for up to sync_spin_us, the receiver's "
        "progress thread sleeps between writes and is woken by a doorbell / wait fd); slept: calls "
        "whose spin budget ran out. busy: write_pages_sync with busy_poll=True on both engines (what "
        "the C program does). Idle CPU: the receiving engine's process over "
        f"{IDLE_S:.0f} s with nothing arriving, default and busy_poll.",
        "",
        "| provider | pages | size | C | callback | sync | slept | busy | idle CPU % | busy idle CPU % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c_p50 = statistics.median(v.get("lat_p50_us", v["lat_us"]) for v in r.samples["c"])
        lines.append(
            f"| {r.provider} | {'huge' if r.huge else 'normal'} | {r.size >> 10} KiB | {r.c_lat_us:.1f} / "
            f"{c_p50:.1f} | {r.py_lat_us:.1f} / {r.py_lat_p50_us:.1f} | {r.py_sync_lat_us:.1f} / "
            f"{r.py_sync_lat_p50_us:.1f} | {r.py_sync_slept_pct:.0f}% | {r.py_busy_lat_p50_us:.1f} | "
            f"{r.receiver_idle_cpu_pct:.2f} | {r.busy_receiver_idle_cpu_pct:.1f} |"
        )
    lines += ["", "NIXL over UCX on this machine at 1 MiB (issue #3): "
              + ", ".join(f"{p} path {g} GB/s" for p, g in NIXL.items()) + "."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", default="shm,tcp;ofi_rxm")
    parser.add_argument("--bytes", type=int, default=512 << 20, help="bytes moved per row")
    parser.add_argument("--pages", choices=("both", "huge", "normal"), default="both")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="write sizes in bytes")
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement (median kept)")
    parser.add_argument("--record", action="store_true", help="write fabric[-TAG].md and .json into --results-dir")
    parser.add_argument("--tag", default=None, help="results file suffix (e.g. loaded)")
    add_results_args(parser, "fabric")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # the engine's FI_* defaults (FabricConfig.tcp_nodelay, ...) into this process's environment now,
    # before any endpoint opens, so that the C runs inherit the same settings as the Python ones
    environment.apply(FabricConfig())

    info = fabric_env()
    kinds = {"both": (False, True), "huge": (True,), "normal": (False,)}[args.pages]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp:
        exe = build_c(tmp)
        for provider in args.providers.split(","):
            if not available(provider):
                continue
            for huge in kinds:
                for size in (int(s) for s in args.sizes.split(",")):
                    row = measure(exe, provider, size, args.bytes, huge, args.repeat)
                    rows.append(row)
                    print(
                        f"{provider:12s} {'huge' if huge else 'small'} {size >> 10:5d} KiB  C {row.c_gbps:6.2f} GB/s  "
                        f"Python {row.py_gbps:6.2f} GB/s ({row.pct:3.0f}% of C), coalesced "
                        f"{row.py_coalesced_gbps:6.2f}, CMA {row.c_cma_gbps:5.2f}  lat C mean {row.c_lat_us:6.1f}, p50 "
                        f"callback {row.py_lat_p50_us:6.1f} sync {row.py_sync_lat_p50_us:6.1f} busy "
                        f"{row.py_busy_lat_p50_us:6.1f} us  idle CPU {row.receiver_idle_cpu_pct:.2f}% "
                        f"(busy {row.busy_receiver_idle_cpu_pct:.0f}%)  load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
    info["loadavg_after"] = round(os.getloadavg()[0], 2)
    lines = render(info, rows, args)
    print("\n".join(lines))
    if args.record:
        write_results(args.results_dir, "fabric" + (f"-{args.tag}" if args.tag else ""), lines=lines,
                      payload={"fabric": info, "rows": [asdict(r) | {"pct_of_c": r.pct} for r in rows]},
                      argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
