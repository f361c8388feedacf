"""The fault matrix of issue 15 in one command: network faults between a prefill node and a decode
node (tests/support/netfault.py: the prefill node in its own network namespace across a veth wire,
faults dropped or shaped in transit, tcp;ofi_rxm) and process faults on the prefill node, on a decode
node and on the router, each struck against a batch of concurrent requests on a running cluster; a
table of fault x outcome in bench/results/faults/faults.md.

    sudo PYTHONPATH=tests python -m bench.faults.matrix            # every row (~3 min on 2 cores)
    sudo PYTHONPATH=tests python -m bench.faults.matrix --rows loss-1%,loss-20%
    sudo PYTHONPATH=tests python -m bench.faults.matrix --rows partition-long,loss-20% --update   # rerun rows
    sudo PYTHONPATH=tests python -m bench.faults.matrix --rotate-key-after 2   # decode nodes release unfenced holds

PYTHONPATH=tests: the matrix drives the suite's own fault harness (tests/support: netfault, cluster,
wait), which imports itself as `support`, so the suite's folder must be on the path.

With --update the rows run replace the same rows of the existing results file, the others stay, and
a line under the header says which rows were rerun, when, on which machine and commit.

Two clusters, one after the other (a row runs on the one its Row.cluster names; a cluster no row
asked for is not started), every node tcp;ofi_rxm, decode nodes --local-prefill-fallback:
- "netns": 1 prefill (across the wire) + 1 decode + router, as tests/integration/test_network_faults.py:
  the network rows, prefill-sigstop, prefill-sigkill (restarted in the row: there is no other prefill node);
- "loopback": 2 prefill + 2 decode + router on 127.0.0.1, as tests/integration/test_migration.py's
  cluster with a second prefill node: decode-sigstop and decode-sigkill (the decode node serving the
  most requests, struck mid-stream: the router moves its streams to the other one), router-sigkill
  (mid-stream, restarted in the row), prefill-sigkill-failover (mid-transfer, the other prefill
  node takes over). A node killed and not restarted in its row is restarted after it (notes).
Per row: requests completed / failed explicitly / lost (neither within the request timeout), stale
writes (the running decode nodes' pdserve:kv_stale_writes_total, cumulative over the run: a row's
own is the increase), pages leaked (pages still used, and quarantined, on the running nodes
CLEAN_WITHIN_S after the batch), recovery seconds: from the fault's end (from its start for a kill)
until a fresh request succeeded by any path, and until one was prefilled by a prefill node again (the
one across the wire on "netns"); whether that request and a victim batch on reused pages gave the
fault-free greedy tokens; notes: what the router's log says it moved, and what the row measured while
the fault was in place. A node still holding pages after a row is restarted before the next (said in
the row's notes). Needs root, iproute2 and iptables (the harness says why not otherwise).
"""


from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.common.results import RESULTS_DIR, stamp
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import Client, ClientError
from pdserve.tools.launcher import Cluster

try:   # the suite's fault harness: tests/ on PYTHONPATH (see above)
    from support import netfault as nf
    from support.cluster import node_load, process_pid, routed, transfer_leftovers
    from support.wait import wait_until
except ImportError as e:   # a clear message instead of a bare ModuleNotFoundError
    raise SystemExit(f"bench.faults.matrix needs the suite's helpers: run it as `sudo PYTHONPATH=tests python -m "
                     f"bench.faults.matrix ...` from the repository root ({e})") from e

NETNS, LOOPBACK = "netns", "loopback"
CLUSTERS = {
    NETNS: "1 prefill node in its own network namespace, 1 decode node + router in the root namespace, across a veth "
           "wire (tests/support/netfault.py)",
    LOOPBACK: "2 prefill + 2 decode nodes + router on 127.0.0.1 (the launcher's Cluster: "
              "tests/integration/test_migration.py's with a second prefill node)",
}
# Every node of both clusters: SmolLM2-135M float32, 160 pages, 1 thread, chunks of 32 prompt tokens.
NODES = dict(num_blocks=160, threads_per_node=1, engine_args=("--max-batch-tokens", "32"), startup_timeout_s=150,
             router_health_interval_s=0.5)
# The loopback rows' requests: long enough that a decode node is struck with streams half done.
STREAM = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
STREAMED = 3                # a decode or router row is struck once every request has streamed this many tokens
MARK_DOWN_WITHIN_S = 20.0   # decode-sigstop: the router marks the stopped node down within this (or the note says not)
FREE_WITHIN_S = 10.0        # router-sigkill: every node frees its requests within this of the kill (or the note says)


@dataclass
class Target:
    """The process a row's fault struck and when (time.monotonic()), recorded as it is struck (a
    decode row picks its node then); the tokens each request of the batch has streamed so far."""

    name: str = ""
    at: float = 0.0
    progress: dict[str, int] = field(default_factory=dict)
    stale_at_kill: float = 0.0   # a killed decode node's pdserve:kv_stale_writes_total, read just before

    def pick(self, name: str) -> str:
        self.name, self.at = name, time.monotonic()
        return name


@dataclass(frozen=True)
class Row:
    """One fault of the matrix: how it is made, how long it is held (None: for the whole batch),
    whether its recovery counts from its start (a kill), the cluster it runs on, the moment a held
    fault is struck (None: netfault's default, a prefill node's transfer in flight), what is measured
    while it is in place (a note), the requests' sampling."""

    name: str
    make: Callable[[nf.FaultNet | None, Cluster, Target], contextlib.AbstractContextManager[nf.FaultHits]]
    hold_s: float | None
    from_start: bool = False
    describe: str = ""
    cluster: str = NETNS
    ready: Callable[[Cluster, Target], Callable[[], bool]] | None = None
    during: Callable[[Cluster, Target], str] | None = None
    sampling: SamplingParams = nf.GREEDY


@contextlib.contextmanager
def sigstop(cluster: Cluster, name: str) -> Iterator[nf.FaultHits]:
    """The node stopped (SIGSTOP) while held, continued (SIGCONT) on exit."""
    pid = process_pid(cluster, name)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield nf.FaultHits(1)
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def sigkill(cluster: Cluster, name: str, restart: bool = True, target: Target | None = None) -> Iterator[nf.FaultHits]:
    """The process SIGKILLed on entry; with `restart`, started again (same address, a new process) on
    exit, else left dead (run() restarts it after the row). A decode node's stale-write counter dies
    with it: with `target`, it is read just before the kill (Target.stale_at_kill), so the row's
    count still covers it (writes landing between that read and the kill are not seen)."""
    if target is not None and cluster.processes[name].role == "decode":
        target.stale_at_kill = nf.metric(cluster.metrics_urls[name], "pdserve:kv_stale_writes_total") or 0.0
    cluster.kill(name, signal.SIGKILL)
    try:
        yield nf.FaultHits(1)
    finally:
        if restart:
            cluster.restart(name)


def _running(cluster: Cluster, role: str) -> list[str]:
    exited = cluster.poll()
    return [s.name for s in cluster.specs if s.role == role and s.name not in exited]


def _attempts(cluster: Cluster, ids: set[str]) -> dict[str, list[tuple[str, int]]]:
    """The router log's attempts of these requests, in order: request id -> (decode node address,
    tokens resumed after) (test_migration.py reads the same lines)."""
    attempts: dict[str, list[tuple[str, int]]] = {}
    with contextlib.suppress(OSError):
        for rid, node, resumed in routed(cluster):
            if rid in ids:
                attempts.setdefault(rid, []).append((node, resumed))
    return attempts


def busiest_prefill(cluster: Cluster) -> str:
    """The running prefill node with the most requests in its batch (then outstanding)."""
    loads = {n: node_load(cluster.processes[n].address) for n in _running(cluster, "prefill")}
    return max(loads, key=lambda n: (loads[n].running_requests, loads[n].outstanding_requests))


def busiest_decode(cluster: Cluster, target: Target) -> str:
    """The running decode node that serves the most of the batch's unfinished streams now, by the
    router's log (its last attempt of each), as test_migration.py picks its victim."""
    serving = {rid: a[-1][0] for rid, a in _attempts(cluster, set(target.progress)).items()}
    names = {cluster.processes[n].address: n for n in _running(cluster, "decode")}
    streams = Counter(serving.get(rid) for rid, n in target.progress.items() if n < STREAM.max_tokens)
    return names[max(names, key=lambda a: streams[a])]


def streaming(cluster: Cluster, target: Target) -> Callable[[], bool]:
    """Whether every request of the batch has streamed STREAMED tokens: a decode or router fault is
    struck then (mid-stream, as test_migration.py strikes)."""

    def streaming() -> bool:
        return len(target.progress) == len(nf.FAULT_PROMPTS) and min(target.progress.values()) >= STREAMED

    return streaming


def transferring(cluster: Cluster, target: Target) -> Callable[[], bool]:
    """Whether a running prefill node has a request in flight and a decode node awaits its KV
    (netfault.transferring, any prefill node): the prefill-failover row is struck then."""
    checks = [nf.transferring(cluster, n) for n in _running(cluster, "prefill")]

    def transferring() -> bool:
        return any(check() for check in checks)

    return transferring


def marked_down(cluster: Cluster, target: Target) -> str:
    """How long after the stop the router's Health says the stopped decode node is out of rotation."""
    address = cluster.processes[target.name].address

    def down() -> bool:
        with Client(cluster.url, timeout=2.0) as client:
            return any(n.address == address and not n.serving for n in client.health().nodes)

    try:
        wait_until(down, MARK_DOWN_WITHIN_S, f"the router to mark {target.name} down", interval=0.05,
                   retry_on=(ClientError,))
    except AssertionError:
        return f"the router did not mark {target.name} down within {MARK_DOWN_WITHIN_S:.0f} s"
    return f"router marked {target.name} down {time.monotonic() - target.at:.1f} s after the stop"


def nodes_free(cluster: Cluster, target: Target) -> str:
    """How long after the router's kill every running node holds nothing (transfer_leftovers)."""
    addresses = nf.node_addresses(cluster)
    try:
        wait_until(lambda: transfer_leftovers(addresses), FREE_WITHIN_S, "every node free after the router's kill",
                   interval=0.05)
    except AssertionError:
        return f"nodes still held {FREE_WITHIN_S:.0f} s after the kill: {transfer_leftovers(addresses).left}"
    return f"every node free {time.monotonic() - target.at:.2f} s after the kill"


S = nf.STALL_S
ROWS = (
    Row("partition-short", lambda n, c, t: nf.partition(n), S / 2, describe=f"P<->D all traffic dropped {S / 2:.1f} s"),
    Row("partition-long", lambda n, c, t: nf.partition(n), 3 * S, describe=f"P<->D all traffic dropped {3 * S:.0f} s"),
    Row("fabric-partition", lambda n, c, t: nf.fabric_partition(n), 2 * S,
        describe=f"fabric ports dropped {2 * S:.0f} s, gRPC up"),
    Row("loss-1%", lambda n, c, t: nf.loss(n, 1), None, describe="1% of packets dropped, either way, whole batch"),
    Row("loss-5%", lambda n, c, t: nf.loss(n, 5), None, describe="5% of packets dropped, either way, whole batch"),
    Row("loss-20%", lambda n, c, t: nf.loss(n, 20), None, describe="20% of packets dropped, either way, whole batch"),
    Row("squeeze-40mbit", lambda n, c, t: nf.squeeze(n, "40mbit"), None,
        describe="tbf 40 Mbit/s both ways, whole batch"),
    Row("prefill-sigstop", lambda n, c, t: sigstop(c, t.pick("prefill-0")), 3 * S,
        describe=f"prefill node SIGSTOP {3 * S:.0f} s mid-transfer, then SIGCONT"),
    Row("prefill-sigkill", lambda n, c, t: sigkill(c, t.pick("prefill-0")), S, from_start=True,
        describe="prefill node SIGKILL mid-transfer, restarted (same address)"),
    Row("decode-sigstop", lambda n, c, t: sigstop(c, t.pick(busiest_decode(c, t))), 2 * S, cluster=LOOPBACK,
        ready=streaming, during=marked_down, sampling=STREAM,
        describe=f"busiest decode node SIGSTOP {2 * S:.0f} s mid-stream, then SIGCONT"),
    Row("decode-sigkill", lambda n, c, t: sigkill(c, t.pick(busiest_decode(c, t)), restart=False, target=t), 0.0,
        from_start=True, cluster=LOOPBACK, ready=streaming, sampling=STREAM,
        describe="busiest decode node SIGKILL mid-stream, the other decode node up"),
    Row("router-sigkill", lambda n, c, t: sigkill(c, t.pick("router")), 0.0, from_start=True, cluster=LOOPBACK,
        ready=streaming, during=nodes_free, sampling=STREAM,
        describe="router SIGKILL mid-stream, restarted (same port)"),
    Row("prefill-sigkill-failover", lambda n, c, t: sigkill(c, t.pick(busiest_prefill(c)), restart=False), 0.0,
        from_start=True, cluster=LOOPBACK, ready=transferring,
        describe="busiest prefill node SIGKILL mid-transfer, the other prefill node up"),
)


def _stamp_line() -> str:
    """Machine and commit for the results file's run lines (the file is updated in place, row by row)."""
    st = stamp()
    tree = f" plus uncommitted changes in the tree ({st.dirty} files)" if st.dirty else ""
    return f"Machine: {st.machine.summary()}. Commit {st.commit}{tree}."


def _crashes(cluster: Cluster) -> str:
    """Which children exited, and how (a native crash prints 'terminated with signal N' in its log)."""
    exited = cluster.poll()
    said = []
    for name in exited:
        with contextlib.suppress(OSError):
            said += [f"{name}: {line.strip()[:90]}" for line in open(cluster.log_dir / f"{name}.log", errors="replace")
                     if "terminated with signal" in line or line.startswith("pdf_core")][-1:]
    return f"exited {exited} {' '.join(said)}" if exited else "no process exited"


def _moved(cluster: Cluster, o: nf.FaultOutcome) -> str:
    """What the router's log says it moved of the row's requests: each attempt after a request's
    first, with the tokens it resumed after."""
    resumed = [n for a in _attempts(cluster, {e.request_id for e in o.ends}).values() for _, n in a[1:]]
    return f"router moved {len(resumed)} (resumed after {', '.join(map(str, resumed))} tokens)" if resumed else ""


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def decode_args(rotate_key_after_s: float | None) -> tuple[str, ...]:
    """The decode node's flags: local prefill fallback, and key rotation when asked."""
    rotate = () if rotate_key_after_s is None else ("--rotate-key-after", f"{rotate_key_after_s:g}")
    return ("--local-prefill-fallback", *rotate)


Result = tuple[Row, nf.FaultOutcome | None, str]


def _restart_exited(cluster: Cluster) -> str:
    """Restart the nodes a row killed and left dead; wait until the router serves through them
    (every decode node back in its rotation); a note."""
    exited = [n for n in cluster.poll() if n != "router"]
    if not exited:
        return ""
    t0 = time.monotonic()
    nf.reset_if_held(cluster)

    def all_in_rotation() -> bool:
        with Client(cluster.url, timeout=2.0) as client:
            return all(n.serving for n in client.health().nodes)

    wait_until(all_in_rotation, nf.RECOVERY_WITHIN_S, "every decode node back in the router's rotation",
               interval=0.2, retry_on=(ClientError,))
    return f"{', '.join(exited)} restarted after the row ({time.monotonic() - t0:.0f} s) "


def _rows(rows: list[Row], cluster: Cluster, net: nf.FaultNet | None, done: dict[str, Result]) -> None:
    """Strike `rows` one after another on a running cluster; each row's result into `done` as it ends."""
    ref = nf.reference(cluster.url)
    stale_before = nf.stale_writes(cluster) or 0.0
    for row in rows:
        try:
            held = nf.reset_if_held(cluster)
        except (AssertionError, OSError, grpc.RpcError, nf.NetFaultError) as e:
            done[row.name] = (row, None, f"could not reset the cluster before this row: {e!r}"[:300])
            print(f"{row.name}: reset failed {e!r}", flush=True)
            continue
        notes = [f"restarted first: {held}"] if held else []
        if held:   # a restarted decode node counts from 0 again
            stale_before = nf.stale_writes(cluster) or 0.0
        target = Target()
        t0 = time.monotonic()
        try:
            o = nf.strike(cluster, row.name, lambda row=row, target=target: row.make(net, cluster, target),
                          row.hold_s, ref, ready=row.ready(cluster, target) if row.ready else None,
                          during=(lambda row=row, target=target: row.during(cluster, target)) if row.during else None,
                          sampling=row.sampling, progress=target.progress)
        except Exception as e:  # a row that cannot finish is a row of the table, not the end of the run
            notes.append(f"no outcome after {time.monotonic() - t0:.0f} s: {_crashes(cluster)}; the harness saw "
                         f"{str(e).splitlines()[0][:160]}")
            print(f"{row.name}: harness error {e!r}", flush=True)
            with contextlib.suppress(Exception):   # the next row starts on a cluster whole again
                notes.append(_restart_exited(cluster))
            done[row.name] = (row, None, "; ".join(n for n in notes if n))
            continue
        # the killed decode node's count is no longer in o.stale_writes (running nodes only)
        stale = None if o.stale_writes is None else o.stale_writes + target.stale_at_kill - stale_before
        notes += [_moved(cluster, o), str(o.during or "")]
        if target.at:
            notes.append(f"{target.name} struck; the batch's last request ended "
                         f"{max(e.at for e in o.ends) - target.at:.1f} s later")
        if net is not None and o.leftovers:
            conns = nf.fabric_connections(net)
            notes.append(f"established KV connections after: decode side {conns['near']}, prefill side {conns['far']}")
        try:
            restarted = _restart_exited(cluster)
        except (AssertionError, OSError, grpc.RpcError) as e:
            restarted = f"restarting the killed node failed: {e!r}"[:200]
        notes.append(restarted)
        if restarted:   # a restarted decode node counts from 0 again
            stale_before = nf.stale_writes(cluster) or 0.0
        elif o.stale_writes is not None:
            stale_before = o.stale_writes
        said = "; ".join(n for n in notes if n)
        done[row.name] = (row, o, said + ("" if stale is None else f" stale={stale:g}"))
        print(f"{row.name}: {o.completed}/{len(o.ends)} ok, errors {o.errors}, lost {o.lost}, stale {stale}, "
              f"leftovers {o.leftovers}, recovery {o.recovery_s} / {o.remote_recovery_s}; {said}", flush=True)


def run(rows: list[Row], log_dir: str, rotate_key_after_s: float | None = None) -> list[Result]:
    """Each cluster that a row of `rows` runs on, started in turn (logs in log_dir/<cluster>), its rows
    struck; the results in the order of `rows`."""
    done: dict[str, Result] = {}
    for which in (NETNS, LOOPBACK):
        mine = [r for r in rows if r.cluster == which]
        if not mine:
            continue
        logs = str(Path(log_dir) / which)
        try:
            with contextlib.ExitStack() as stack:
                if which == NETNS:
                    net = stack.enter_context(nf.fault_net())
                    cluster: Cluster = stack.enter_context(nf.NetCluster(
                        net, prefill=1, decode=1, port=0, decode_args=decode_args(rotate_key_after_s),
                        log_dir=logs, **NODES))
                else:
                    net = None
                    cluster = stack.enter_context(Cluster(
                        prefill=2, decode=2, port=0, provider="tcp;ofi_rxm",
                        decode_args=decode_args(rotate_key_after_s), log_dir=logs, **NODES))
                _rows(mine, cluster, net, done)
        except Exception as e:   # that cluster's rows not done say why; the other cluster's stand
            for r in mine:
                done.setdefault(r.name, (r, None, f"the {which} cluster failed: {str(e).splitlines()[0][:200]}"))
            print(f"{which} cluster: {e!r}", flush=True)
    return [done[r.name] for r in rows]


def table(results: list[Result]) -> list[str]:
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
        stale = notes.rsplit(" stale=", 1)[1] if " stale=" in notes else "n/a"
        other = notes.rsplit(" stale=", 1)[0].strip()
        errs = "; ".join(e[:160] for e in o.errors)
        lines.append(
            f"| {row.name}: {row.describe} | {o.held_s:.1f} | {o.completed} / {len(o.errors)} / {len(o.lost)} | "
            f"{stale} | {o.leaked_pages} ({quarantined}) | {rec}{' (from the kill)' if row.from_start else ''} | "
            f"{'yes' if o.fresh_ok and o.victims_ok else 'NO'} | {other}{' errors: ' + errs if errs else ''} |")
    return lines


def updated(lines: list[str], results: list[Result], note: str) -> list[str]:
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
    p.add_argument("--out", default=str(RESULTS_DIR / "faults" / "faults.md"))
    p.add_argument("--log-dir", default=None,
                   help="the nodes' logs, a folder per cluster (default: a new temporary folder, kept)")
    p.add_argument("--update", action="store_true",
                   help="replace only the rows run in the existing --out file (the others stay) and note the rerun")
    p.add_argument("--rotate-key-after", type=float, default=None, metavar="S",
                   help="the decode nodes' --rotate-key-after (default: off): a hold this old whose abort ended "
                        "unfenced, or whose prefill node went silent, is released by a key rotation")
    args = p.parse_args()
    if args.rotate_key_after is not None and not args.rotate_key_after > 0:
        p.error(f"--rotate-key-after must be > 0, got {args.rotate_key_after}")
    reason = nf.unavailable()
    if reason:
        print(f"bench.faults.matrix cannot run here: {reason}", file=sys.stderr)
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
    stamped = _stamp_line()
    text = [
        "# Fault matrix (issue 15)",
        "",
        f"`sudo PYTHONPATH=tests python -m bench.faults.matrix{flags}` on "
        f"{started:%Y-%m-%d %H:%M} UTC, {time.monotonic() - t0:.0f} s. {stamped}",
        "",
        "Clusters, one after the other; every node SmolLM2-135M float32, 160 pages, 1 thread, tcp;ofi_rxm; decode "
        f"nodes {' '.join(decode_args(args.rotate_key_after))} (default --prefill-stall {nf.STALL_S:g} s); router "
        f"health poll every {NODES['router_health_interval_s']:g} s:",
        "",
        *(f"- {which}{' (rows ' + ', '.join(names) + ')' if names else ''}: {CLUSTERS[which]}"
          for which, names in ((w, [r.name for r in rows if r.cluster == w]) for w in (NETNS, LOOPBACK))),
        "",
        f"Each row: {len(nf.FAULT_PROMPTS)} concurrent ~230-token prompts x {nf.GREEDY.max_tokens} greedy tokens "
        f"({STREAM.max_tokens} on loopback, so that a decode node is struck mid-stream); a held fault is struck once "
        "a prefill node has one in flight and a decode node awaits its KV (decode and router rows: once every "
        f"request has streamed {STREAMED} tokens; the busiest decode node serves the most unfinished streams then, "
        "by the router's log; the busiest prefill node has the most requests), or is in place for the whole batch. "
        f"Lost = neither tokens nor an explicit error within {nf.REQUEST_TIMEOUT_S:.0f} s. "
        f"Pages leaked = pages still used on any running node {nf.CLEAN_WITHIN_S:.0f} s after the batch (of which "
        "quarantined). Recovery = from the fault's end (a kill: its start, so a restart in the row counts) until a "
        "fresh request succeeded (any path / prefilled by a prefill node: on netns the one across the wire); '-' = "
        f"none within {nf.RECOVERY_WITHIN_S:.0f} s. Greedy = that request and a victim batch on reused pages equal "
        "the fault-free run. Notes: the router's re-submissions of the batch's requests (from its log, with the "
        "tokens already streamed), what was measured while the fault was in place, when the batch's last request "
        "ended after the strike.",
        "",
        *table(results),
        "",
    ]
    if args.update and Path(args.out).exists():
        text = updated(Path(args.out).read_text().split("\n"), results,
                       f"Rows {', '.join(r.name for r in rows)} rerun with "
                       f"`sudo PYTHONPATH=tests python -m bench.faults.matrix{flags} --update` on "
                       f"{started:%Y-%m-%d %H:%M} UTC, {time.monotonic() - t0:.0f} s. {stamped}")
    Path(args.out).write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
