"""UCX (fabric.ucx, issue 32) write bandwidth beside libfabric's, and ucx_perftest's put_bw.

    python -m bench.fabric.ucx [--sizes 65536,262144,1048576,4194304] [--bytes N] [--repeat R]
                               [--backends tcp;ofi_rxm,ucx-tcp,shm,ucx] [--no-perftest] [--record]

Each row moves ``--bytes`` between two processes on this host with writes of one size: batches of
BATCH writes, none adjacent (so nothing merges), imm_mode "every", WINDOW batches in flight, both
pools from pdserve's allocator (transparent huge pages where the host gives them), through
``fabric.open_backend``: the libfabric TransferEngine (``tcp;ofi_rxm``, ``shm``) or UcxBackend
(``ucx-tcp``: UCX_TLS=tcp; ``ucx``: the transports UCX picks itself, on one host shared memory).
Beside them, ``ucx_perftest -t ucp_put_bw`` of the libucx wheel over the same loopback with
UCX_TLS=tcp and the same sizes: one cache-hot buffer put again and again (the rows above rotate
through a 64 MiB pool), a ceiling for the UCX rows, not the same pattern. Medians of --repeat runs.
A short check that it runs: ``--sizes 262144 --bytes 16777216 --backends ucx-tcp --no-perftest``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import threading
import time

import numpy as np

from bench.common.results import add_results_args, write_results
from fabric import FabricConfig, PageWrites, open_backend
from pdserve.engine.cache.hostmem import alloc_buffer

POOL = 64 << 20
BATCH = 16
WINDOW = 8           # batches in flight
TAG = 0x0B
SIZES = (65536, 262144, 1 << 20, 4 << 20)
BACKENDS = ("tcp;ofi_rxm", "ucx-tcp", "shm", "ucx")
PERFTEST_PORT = 13471
_TIMEOUT_S = 120


def _env(backend: str) -> tuple[str, dict[str, str]]:
    """(provider, environment additions) of a backend name."""
    if backend == "ucx-tcp":
        return "ucx", {"UCX_TLS": "tcp"}
    return backend, {}


def _receiver(conn, provider: str) -> None:
    engine = open_backend(FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every"))
    pool = alloc_buffer(POOL, populate=True)
    region = engine.register(pool.view)
    conn.send(region.descriptor)
    conn.recv()
    engine.close()


def _bandwidth(engine, src, dst, size: int, total: int) -> float:
    """GB/s of ``total`` bytes in writes of ``size``, no two of a batch adjacent."""
    n = max(BATCH, total // size)
    slots = POOL // size
    offsets = ((np.arange(n, dtype=np.uint64) * 2) % slots) * size   # [n] byte offsets
    lengths = np.full(BATCH, size, dtype=np.uint64)                   # [BATCH]
    window = threading.Semaphore(WINDOW)
    errors: list[Exception] = []

    def failed(err: Exception) -> None:
        errors.append(err)
        window.release()

    nbatches = (n + BATCH - 1) // BATCH
    t0 = time.perf_counter()
    for b in range(nbatches):
        if not window.acquire(timeout=_TIMEOUT_S):
            raise TimeoutError("bandwidth run stalled")
        part = offsets[b * BATCH : (b + 1) * BATCH]
        engine.write(PageWrites(src, part, dst, part, lengths[: part.size], TAG), window.release, failed)
    for _ in range(WINDOW):
        if not window.acquire(timeout=_TIMEOUT_S):
            raise TimeoutError("bandwidth run did not complete")
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return n * size / seconds / 1e9


def run_backend(backend: str, sizes: list[int], total: int, repeat: int) -> dict[int, list[float]]:
    provider, extra = _env(backend)
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)   # read when each side's UCX context opens (the receiver inherits it)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, provider), daemon=True)
    proc.start()
    engine = None
    try:
        if not parent.poll(60):
            raise TimeoutError(f"{backend}: receiver did not start")
        dst = parent.recv()
        engine = open_backend(FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every", coalesce=False))
        src_buf = alloc_buffer(POOL, populate=True)
        src = engine.register(src_buf.view)
        engine.connect(dst.peer)
        out: dict[int, list[float]] = {}
        for size in sizes:
            _bandwidth(engine, src, dst, size, min(total, POOL))   # warm-up: first touch, connections
            out[size] = [_bandwidth(engine, src, dst, size, total) for _ in range(repeat)]
        return out
    finally:
        if engine is not None:
            engine.close()
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def perftest(size: int, total: int) -> float | None:
    """ucx_perftest put_bw GB/s over loopback TCP (the libucx wheel's binary), or None without it."""
    try:
        import libucx
    except ImportError:
        return None
    root = os.path.dirname(libucx.__file__)
    exe = os.path.join(root, "bin", "ucx_perftest")
    env = dict(os.environ, UCX_TLS="tcp", LD_LIBRARY_PATH=os.path.join(root, "lib"))
    iters = str(max(16, total // size))
    args = ["-t", "ucp_put_bw", "-s", str(size), "-n", iters, "-p", str(PERFTEST_PORT)]
    server = subprocess.Popen([exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        client = subprocess.run([exe, "127.0.0.1", *args], env=env, capture_output=True, text=True,
                                timeout=_TIMEOUT_S, check=False)
    finally:
        server.wait(10) if server.poll() is not None else server.kill()
        server.wait(10)
    final = re.search(r"^Final:\s+(\S+\s+){5}(\S+)", client.stdout, re.M)
    return float(final.group(2)) * 2**20 / 1e9 if final else None   # MB/s column (MiB): GB/s


def render(rows: dict[str, dict[int, list[float]]], perf: dict[int, float | None], args) -> list[str]:
    sizes = [int(s) for s in args.sizes.split(",")]
    head = "| size | " + " | ".join(f"{b} GB/s" for b in rows) + " | ucx_perftest tcp GB/s |"
    lines = [
        "# UCX beside libfabric: write bandwidth (bench/fabric/ucx.py)", "",
        f"Each cell: {args.bytes >> 20} MiB in writes of one size between two processes on this host, "
        f"batches of {BATCH} writes (none adjacent), {WINDOW} batches in flight, imm_mode every, "
        f"median of {args.repeat}. ucx-tcp: UcxBackend with UCX_TLS=tcp; ucx: UCX's own choice "
        "(shared memory here). ucx_perftest: one cache-hot buffer (not the rotating pool).", "",
        head, "|---:|" + "---:|" * (len(rows) + 1)]
    for size in sizes:
        cells = [f"{statistics.median(rows[b][size]):.2f}" for b in rows]
        p = perf.get(size)
        lines.append(f"| {size >> 10} KiB | " + " | ".join(cells) + f" | {'-' if p is None else f'{p:.2f}'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--bytes", type=int, default=128 << 20, help="bytes moved per cell")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--no-perftest", action="store_true", help="skip ucx_perftest")
    parser.add_argument("--record", action="store_true", help="write ucx[-TAG].md/.json into --results-dir")
    parser.add_argument("--tag", default=None)
    add_results_args(parser, "fabric")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = {b: run_backend(b, sizes, args.bytes, args.repeat) for b in args.backends.split(",")}
    perf = {} if args.no_perftest else {s: perftest(s, args.bytes) for s in sizes}
    lines = render(rows, perf, args)
    print("\n".join(lines))
    if args.record:
        stem = "ucx" + (f"-{args.tag}" if args.tag else "")
        write_results(args.results_dir, stem, payload={"rows": {b: {str(s): v for s, v in r.items()}
                                                                for b, r in rows.items()},
                                                       "perftest": {str(s): v for s, v in perf.items()}},
                      lines=lines, argv=argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
