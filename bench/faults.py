"""The fault matrix of issue 15 in one command: network faults between a prefill node and a decode
node (tests/support/netfault.py: the prefill node in its own network namespace across a veth wire,
faults dropped or shaped in transit, tcp;ofi_rxm) and process faults on the prefill node, each
struck against a batch of concurrent requests on one running cluster; a table of fault x outcome
in bench/results/faults.md.

    sudo .venv/bin/python bench/faults.py            # every row (~6 min on 2 cores)
    sudo .venv/bin/python bench/faults.py --rows loss-1%,loss-20%
    sudo .venv/bin/python bench/faults.py --rows partition-long,loss-20% --update   # rerun rows in place
    sudo .venv/bin/python bench/faults.py --rotate-key-after 2   # the decode node releases unfenced holds

With --update the rows run replace the same rows of the existing results file, the others stay, and
a line under the header says which rows were rerun, when, on which machine and commit.

Cluster: 1 prefill (across the wire) + 1 decode (--local-prefill-fallback) + router, as
tests/integration/test_network_faults.py. Per row: requests completed / failed explicitly / lost
(neither within the request timeout), stale writes (the decode node's
pdserve:kv_stale_writes_total, cumulative over the run: a row's own is the increase), pages leaked
(pages still used, and quarantined, CLEAN_WITHIN_S after the batch), recovery seconds: from the
fault's end (from its start for a kill) until a fresh request succeeded by any path, and until one
was prefilled by the prefill node again; whether that request and a victim batch on reused pages gave
the fault-free greedy tokens. A node still holding pages after a row is restarted before the next
(said in the row's notes). Needs root, iproute2 and iptables (the harness says why not otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support import netfault as nf  # noqa: E402
from support.cluster import process_pid  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One fault of the matrix: how it is made, how long it is held (None: for the whole batch),
    whether its recovery counts from its start (a kill)."""

    name: str
    make: Callable[[nf.FaultNet, nf.NetCluster], contextlib.AbstractContextManager[nf.FaultHits]]
    hold_s: float | None
    from_start: bool = False
    describe: str = ""


@contextlib.contextmanager
def sigstop(cluster: nf.NetCluster, name: str) -> Iterator[nf.FaultHits]:
    """The node stopped (SIGSTOP) while held, continued (SIGCONT) on exit."""
    pid = process_pid(cluster, name)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield nf.FaultHits(1)
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def sigkill(cluster: nf.NetCluster, name: str) -> Iterator[nf.FaultHits]:
    """The node SIGKILLed on entry, started again (same address, a new process) on exit."""
    cluster.kill(name, signal.SIGKILL)
    try:
        yield nf.FaultHits(1)
    finally:
        cluster.restart(name)


S = nf.STALL_S
ROWS = (
    Row("partition-short", lambda n, c: nf.partition(n), S / 2, describe=f"P<->D all traffic dropped {S / 2:.1f} s"),
    Row("partition-long", lambda n, c: nf.partition(n), 3 * S, describe=f"P<->D all traffic dropped {3 * S:.0f} s"),
    Row("fabric-partition", lambda n, c: nf.fabric_partition(n), 2 * S,
        describe=f"fabric ports dropped {2 * S:.0f} s, gRPC up"),
    Row("loss-1%", lambda n, c: nf.loss(n, 1), None, describe="1% of packets dropped, either way, whole batch"),
    Row("loss-5%", lambda n, c: nf.loss(n, 5), None, describe="5% of packets dropped, either way, whole batch"),
    Row("loss-20%", lambda n, c: nf.loss(n, 20), None, describe="20% of packets dropped, either way, whole batch"),
    Row("squeeze-40mbit", lambda n, c: nf.squeeze(n, "40mbit"), None,
        describe="tbf 40 Mbit/s both ways, whole batch"),
    Row("prefill-sigstop", lambda n, c: sigstop(c, "prefill-0"), 3 * S,
        describe=f"prefill node SIGSTOP {3 * S:.0f} s mid-transfer, then SIGCONT"),
    Row("prefill-sigkill", lambda n, c: sigkill(c, "prefill-0"), S, from_start=True,
        describe="prefill node SIGKILL mid-transfer, restarted (same address)"),
)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()


def _machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{platform.node()}: {os.cpu_count()} cores ({cpu}), Linux {platform.release()}, "
            f"python {platform.python_version()}")


def _crashes(cluster: nf.NetCluster, log_dir: str) -> str:
    """Which children exited, and how (a native crash prints 'terminated with signal N' in its log)."""
    exited = cluster.poll()
    said = []
    for name in exited:
        with contextlib.suppress(OSError):
            said += [f"{name}: {line.strip()[:90]}" for line in open(Path(log_dir) / f"{name}.log", errors="replace")
                     if "terminated with signal" in line or line.startswith("pdf_core")][-1:]
    return f"exited {exited} {' '.join(said)}" if exited else "no process exited"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def decode_args(rotate_key_after_s: float | None) -> tuple[str, ...]:
    """The decode node's flags: local prefill fallback, and key rotation when asked."""
    rotate = () if rotate_key_after_s is None else ("--rotate-key-after", f"{rotate_key_after_s:g}")
    return ("--local-prefill-fallback", *rotate)


def run(rows: list[Row], log_dir: str, rotate_key_after_s: float | None = None
        ) -> list[tuple[Row, nf.FaultOutcome | None, str]]:
    out: list[tuple[Row, nf.FaultOutcome | None, str]] = []
    with nf.fault_net() as net, nf.NetCluster(
            net, prefill=1, decode=1, port=0, num_blocks=160, threads_per_node=1,
            engine_args=("--max-batch-tokens", "32"), decode_args=decode_args(rotate_key_after_s),
            log_dir=log_dir, startup_timeout_s=150, router_health_interval_s=0.5) as cluster:
        ref = nf.reference(cluster.url)
        stale_before = nf.stale_writes(cluster) or 0.0
        for row in rows:
            try:
                held = nf.reset_if_held(cluster)
            except (AssertionError, OSError, grpc.RpcError, nf.NetFaultError) as e:
                out.append((row, None, f"could not reset the cluster before this row: {e!r}"[:300]))
                print(f"{row.name}: reset failed {e!r}", flush=True)
                continue
            notes = f"restarted first: {held} " if held else ""
            if held:   # a restarted decode node counts from 0 again
                stale_before = nf.stale_writes(cluster) or 0.0
            t0 = time.monotonic()
            try:
                o = nf.strike(cluster, row.name, lambda row=row: row.make(net, cluster), row.hold_s, ref)
            except Exception as e:  # a row that cannot finish is a row of the table, not the end of the run
                out.append((row, None, notes + f"no outcome after {time.monotonic() - t0:.0f} s: "
                            f"{_crashes(cluster, log_dir)}; the harness saw {str(e).splitlines()[0][:160]}"))
                print(f"{row.name}: harness error {e!r}", flush=True)
                continue
            stale = None if o.stale_writes is None else o.stale_writes - stale_before
            if o.stale_writes is not None:
                stale_before = o.stale_writes
            conns = nf.fabric_connections(net)
            if o.leftovers:
                notes += f"established KV connections after: decode side {conns['near']}, prefill side {conns['far']} "
            out.append((row, o, notes + ("" if stale is None else f"stale={stale:g}")))
            print(f"{row.name}: {o.completed}/{len(o.ends)} ok, errors {o.errors}, lost {o.lost}, stale {stale}, "
                  f"leftovers {o.leftovers}, recovery {o.recovery_s} / {o.remote_recovery_s}", flush=True)
    return out


def table(results: list[tuple[Row, nf.FaultOutcome | None, str]]) -> list[str]:
    lines = ["| fault | held s | requests ok / err / lost | stale writes | pages leaked (quarantined) | "
             "recovery s (any / via prefill node) | greedy after = fault-free | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for row, o, notes in results:
        if o is None:
            lines.append(f"| {row.name}: {row.describe} | - | - | - | - | - | - | {notes} |")
            continue
        extra = o.held_s if row.from_start else 0.0
        rec = "/".join(_fmt(None if r is None else r + extra) for r in (o.recovery_s, o.remote_recovery_s))
        quarantined = sum(c.get("quarantined_kv_blocks", 0) for c in o.leftovers.values())
        stale = notes.rsplit("stale=", 1)[1] if "stale=" in notes else "n/a"
        other = notes.rsplit("stale=", 1)[0].strip()
        errs = "; ".join(e[:160] for e in o.errors)
        lines.append(
            f"| {row.name}: {row.describe} | {o.held_s:.1f} | {o.completed} / {len(o.errors)} / {len(o.lost)} | "
            f"{stale} | {o.leaked_pages} ({quarantined}) | {rec}{' (from the kill)' if row.from_start else ''} | "
            f"{'yes' if o.fresh_ok and o.victims_ok else 'NO'} | {other}{' errors: ' + errs if errs else ''} |")
    return lines


def updated(lines: list[str], results: list[tuple[Row, nf.FaultOutcome | None, str]], note: str) -> list[str]:
    """An existing results file (`lines`) with the table rows of `results` replaced (appended after
    the table when absent) and `note` as its own paragraph after the run line."""
    new = dict(zip((row.name for row, _, _ in results), table(results)[2:], strict=True))
    out: list[str] = []
    for line in lines:
        name = line[2:].split(":", 1)[0] if line.startswith("| ") else None
        out.append(new.pop(name) if name in new else line)
    last = max(i for i, line in enumerate(out) if line.startswith("|"))
    out[last + 1:last + 1] = list(new.values())
    run_line = next(i for i, line in enumerate(out) if line.startswith("`sudo"))
    return [*out[:run_line + 1], "", note, *out[run_line + 1:]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="", help="comma-separated row names (default: all): "
                   + ", ".join(r.name for r in ROWS).replace("%", "%%"))   # argparse formats help with %
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.md"))
    p.add_argument("--log-dir", default=None, help="the nodes' logs (default: a new temporary folder, kept)")
    p.add_argument("--update", action="store_true",
                   help="replace only the rows run in the existing --out file (the others stay) and note the rerun")
    p.add_argument("--rotate-key-after", type=float, default=None, metavar="S",
                   help="the decode node's --rotate-key-after (default: off): a hold this old whose abort ended "
                        "unfenced, or whose prefill node went silent, is released by a key rotation")
    args = p.parse_args()
    if args.rotate_key_after is not None and not args.rotate_key_after > 0:
        p.error(f"--rotate-key-after must be > 0, got {args.rotate_key_after}")
    reason = nf.unavailable()
    if reason:
        print(f"bench/faults.py cannot run here: {reason}", file=sys.stderr)
        return 2
    wanted = [w for w in args.rows.split(",") if w]
    unknown = set(wanted) - {r.name for r in ROWS}
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; known: {[r.name for r in ROWS]}")
    rows = [r for r in ROWS if not wanted or r.name in wanted]
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    logs = args.log_dir or tempfile.mkdtemp(prefix="pdserve-faults-")
    print(f"node logs in {logs}", flush=True)
    results = run(rows, logs, args.rotate_key_after)
    flags = (f" --rows {args.rows}" if args.rows else "") + (
        f" --rotate-key-after {args.rotate_key_after:g}" if args.rotate_key_after is not None else "")
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    tree = f" plus uncommitted changes in the shared tree ({len(dirty.splitlines())} files)" if dirty else ""
    text = [
        "# Fault matrix (issue 15)",
        "",
        f"`sudo .venv/bin/python bench/faults.py{flags}` on "
        f"{started:%Y-%m-%d %H:%M} UTC, {time.monotonic() - t0:.0f} s. Machine: {_machine()}. Commit {commit}{tree}.",
        "",
        f"Cluster: 1 prefill node in its own network namespace, 1 decode node "
        f"({' '.join(decode_args(args.rotate_key_after))}, default --prefill-stall {nf.STALL_S:g} s) + router in "
        "the root namespace, tcp;ofi_rxm across a veth wire (tests/support/netfault.py); SmolLM2-135M float32, "
        "160 pages, 1 thread per node. Each row: "
        f"{len(nf.FAULT_PROMPTS)} concurrent ~230-token prompts x {nf.GREEDY.max_tokens} greedy tokens; the fault is "
        "struck once the prefill node has one in flight (held rows) or is in place for the whole batch. "
        f"Lost = neither tokens nor an explicit error within {nf.REQUEST_TIMEOUT_S:.0f} s. Pages leaked = pages "
        f"still used on any node {nf.CLEAN_WITHIN_S:.0f} s after the batch (of which quarantined). Recovery = from "
        "the fault's end (a kill: its start) until a fresh request succeeded (any path / prefilled by the prefill "
        "node); '-' = none within "
        f"{nf.RECOVERY_WITHIN_S:.0f} s. Greedy = that request and a victim batch on reused pages equal the "
        "fault-free run.",
        "",
        *table(results),
        "",
    ]
    if args.update and Path(args.out).exists():
        text = updated(Path(args.out).read_text().split("\n"), results,
                       f"Rows {', '.join(r.name for r in rows)} rerun with `sudo .venv/bin/python bench/faults.py"
                       f"{flags} --update` on {started:%Y-%m-%d %H:%M} UTC, "
                       f"{time.monotonic() - t0:.0f} s. Machine: {_machine()}. Commit {commit}{tree}.")
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
