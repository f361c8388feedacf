"""Network faults between real nodes (tests/integration/test_network_faults.py, bench.faults.matrix).

The network. Two network namespaces and three veth pairs per `fault_net()` (names carry the pid
and a count: two runs, or two networks of one run, never collide), all deleted on exit whatever
happened:

    root namespace (decode nodes, router, the test's clients)   near_addr  = 10.253.S.1/30
      | veth near_dev  <->  wire_near_dev
    "wire" namespace: a router between the two sides, where every fault lives
      | veth wire_far_dev  <->  far_dev
    "far" namespace (prefill node(s))                            far_addr   = 10.254.S.2/30

Faults are iptables rules in the wire namespace's FORWARD chain and tc qdiscs on its two veth ends,
so packets are dropped in transit, silently, both ways, as a switch or a cable would: a DROP in a
host's own OUTPUT chain fails its sends at once with EPERM, which a real partition never does.
Nothing touches the host's interfaces, addresses or netfilter rules: the root namespace only gets
one end of our own veth pair (an address in 10.253.S.0/30) and one route to the far /30 through it.
This kernel has no netem, hence tbf for bandwidth and iptables' statistic match for loss.

Fabric ports. The tcp provider's listening ports are pinned to FABRIC_PORTS (FI_TCP_PORT_LOW_RANGE
/ FI_TCP_PORT_HIGH_RANGE in every node's environment), outside the kernel's ephemeral range where
gRPC's ports and every connecting socket's source port live, so `fabric_partition` can drop the
KV connections (either end in FABRIC_PORTS) while gRPC keeps answering.

Nodes. `NetCluster` is the launcher's Cluster with the prefill nodes moved into the far namespace
(`ip netns exec FAR`: it execs, so the child stays our child and still dies with us) and listening
on far_addr, decode nodes and router on near_addr; `local_prefill` more prefill nodes may stay on
near_addr (a second prefill node the partition does not cut off).

Every fault primitive is a context manager that undoes itself on exit, also after a failure.
`strike` runs one fault against a batch of requests and reports a FaultOutcome (what the requests
ended with, what the nodes still hold, stale writes, a fresh request's tokens, recovery seconds);
the tests assert on it, bench.faults.matrix tabulates it. It also takes a plain launcher Cluster (no
network namespace: process faults on decode nodes or the router, bench.faults.matrix's loopback rows);
its measures skip a node that has exited (a SIGKILL not followed by a restart).

Blocking waits and their bounds: every `ip` / `iptables` / `tc` call IP_TIMEOUT_S; cluster start
and stop as Cluster's (startup_timeout_s, stop_timeout_s); each request REQUEST_TIMEOUT_S; the
node clean-up CLEAN_WITHIN_S; recovery RECOVERY_WITHIN_S; a busy prefill node BUSY_WITHIN_S; one
`strike` as its docstring says.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, Client, ClientError, _Collector
from pdserve.tools.launcher import Cluster, ProcessSpec, _child_env, child_command
from support.cluster import node_info, node_load, transfer_leftovers
from support.prometheus import fetch, parse, total
from support.wait import wait_until

IP_TIMEOUT_S = 10.0
# the tcp provider's listening ports on every node (outside the ephemeral range: checked in unavailable())
FABRIC_PORTS = (20100, 20163)
# the decode node's default --prefill-stall (decode_node/__main__.py)
STALL_S = 3.0


class NetFaultError(RuntimeError):
    """A network set-up or fault command failed: the command and its stderr are in the message."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise NetFaultError(f"{' '.join(argv)} did not finish within {IP_TIMEOUT_S} s") from e
    if check and done.returncode != 0:
        raise NetFaultError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def in_ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run argv inside network namespace `ns` (bounded by IP_TIMEOUT_S)."""
    return _run("ip", "netns", "exec", ns, *argv, check=check)


def unavailable() -> str | None:
    """Why this machine cannot run the network-fault harness (a skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces and iptables need root"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install {package})"
    low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    if not (FABRIC_PORTS[1] < low or FABRIC_PORTS[0] > high):
        return f"the fabric ports {FABRIC_PORTS} overlap the ephemeral range {low}-{high}"
    probe = f"pdnf-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"this machine forbids network namespaces (ip netns add: {made.stderr.strip()})"
    try:
        rule = in_ns(probe, "iptables", "-w", "5", "-A", "FORWARD", "-m", "statistic", "--mode", "random",
                     "--probability", "0.5", "-j", "DROP", check=False)
        if rule.returncode != 0:
            return f"iptables cannot add a statistic rule in a namespace: {rule.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class FaultNet:
    """The namespaces, devices and addresses of one run (module docstring's picture)."""

    tag: str
    wire_ns: str
    far_ns: str
    near_dev: str          # root namespace end
    wire_near_dev: str     # wire namespace, facing the root namespace (its egress carries KV to decode)
    wire_far_dev: str      # wire namespace, facing the far namespace
    far_dev: str           # far namespace end
    near_addr: str         # decode nodes, router (root namespace)
    far_addr: str          # prefill nodes (far namespace)
    fabric_ports: tuple[int, int] = FABRIC_PORTS

    @property
    def wire_devs(self) -> tuple[str, str]:
        return (self.wire_near_dev, self.wire_far_dev)


_NETS = itertools.count()


def _free_subnet() -> int:
    """An S in 1..250 whose 10.253.S.0/30 and 10.254.S.0/30 no route of the root namespace uses."""
    routes = _run("ip", "-4", "route", "show", "table", "all").stdout
    start = os.getpid() % 250
    for i in range(250):
        s = (start + i) % 250 + 1
        if f"10.253.{s}." not in routes and f"10.254.{s}." not in routes:
            return s
    raise NetFaultError("no free 10.253.S.0/30 subnet for the fault network")


@contextlib.contextmanager
def fault_net() -> Iterator[FaultNet]:
    """Make the fault network (module docstring); removed on exit, whatever happened."""
    reason = unavailable()
    if reason:
        raise NetFaultError(f"the fault network cannot be made here: {reason}")
    tag = f"{os.getpid() % 100000}{next(_NETS)}"    # unique per network made (interface names: <= 15 chars)
    s = _free_subnet()
    net = FaultNet(tag=tag, wire_ns=f"pdnf-{tag}-wire", far_ns=f"pdnf-{tag}-far",
                   near_dev=f"pdnr{tag}", wire_near_dev=f"pdnw{tag}n", wire_far_dev=f"pdnw{tag}f",
                   far_dev=f"pdnf{tag}", near_addr=f"10.253.{s}.1", far_addr=f"10.254.{s}.2")
    namespaces: list[str] = []
    links: list[str] = []
    try:
        for ns in (net.wire_ns, net.far_ns):
            _run("ip", "netns", "add", ns)
            namespaces.append(ns)
        _run("ip", "link", "add", net.near_dev, "type", "veth", "peer", "name", net.wire_near_dev)
        links.append(net.near_dev)
        _run("ip", "link", "set", net.wire_near_dev, "netns", net.wire_ns)
        _run("ip", "-n", net.wire_ns, "link", "add", net.wire_far_dev, "type", "veth", "peer", "name", net.far_dev)
        _run("ip", "-n", net.wire_ns, "link", "set", net.far_dev, "netns", net.far_ns)
        _run("ip", "addr", "add", f"{net.near_addr}/30", "dev", net.near_dev)
        _run("ip", "link", "set", net.near_dev, "up")
        _run("ip", "-n", net.wire_ns, "addr", "add", f"10.253.{s}.2/30", "dev", net.wire_near_dev)
        _run("ip", "-n", net.wire_ns, "addr", "add", f"10.254.{s}.1/30", "dev", net.wire_far_dev)
        _run("ip", "-n", net.far_ns, "addr", "add", f"{net.far_addr}/30", "dev", net.far_dev)
        for ns, dev in ((net.wire_ns, net.wire_near_dev), (net.wire_ns, net.wire_far_dev), (net.far_ns, net.far_dev)):
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        in_ns(net.wire_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "route", "add", f"10.254.{s}.0/30", "via", f"10.253.{s}.2", "dev", net.near_dev)
        _run("ip", "-n", net.far_ns, "route", "add", "default", "via", f"10.254.{s}.1", "dev", net.far_dev)
        yield net
    finally:
        # deleting the root end removes its peer and the route at once (namespace teardown is lazy)
        for dev in links:
            _run("ip", "link", "del", dev, check=False)
        for ns in reversed(namespaces):
            _run("ip", "netns", "del", ns, check=False)


# --- faults: each undoes itself -----------------------------------------------------------------------

@dataclass
class FaultHits:
    """Filled when a fault's context exits: how many packets its rules dropped, or how many times
    its token buckets held a packet back (tc's overlimits): > 0 shows the fault touched traffic."""

    count: int = 0


def _forward_packets(net: FaultNet) -> int:
    """Packets matched so far by the wire's FORWARD rules (ours are the only ones there)."""
    text = in_ns(net.wire_ns, "iptables", "-w", "5", "-L", "FORWARD", "-v", "-x", "-n").stdout
    # two header lines, then: pkts bytes target prot opt in out source destination ...
    return sum(int(line.split()[0]) for line in text.splitlines()[2:] if line.strip())


@contextlib.contextmanager
def _forward_rules(net: FaultNet, rules: Sequence[Sequence[str]]) -> Iterator[FaultHits]:
    """Insert iptables FORWARD rules in the wire namespace (the only rules there); delete exactly
    those on exit, after counting the packets they dropped."""
    added: list[Sequence[str]] = []
    hits = FaultHits()
    try:
        for rule in rules:
            in_ns(net.wire_ns, "iptables", "-w", "5", "-I", "FORWARD", *rule)
            added.append(rule)
        yield hits
    finally:
        try:
            hits.count = _forward_packets(net)
        finally:
            for rule in reversed(added):
                in_ns(net.wire_ns, "iptables", "-w", "5", "-D", "FORWARD", *rule, check=False)


def partition(net: FaultNet):
    """Every packet between the two sides dropped, both ways (gRPC and fabric)."""
    return _forward_rules(net, [("-j", "DROP")])


def fabric_partition(net: FaultNet):
    """Only the KV connections dropped (TCP with either port in the fabric range), both ways; gRPC
    (health, GetNodeInfo, Prefill, AbortPrefill) keeps flowing."""
    low, high = net.fabric_ports
    return _forward_rules(net, [("-p", "tcp", "-m", "multiport", "--ports", f"{low}:{high}", "-j", "DROP")])


def loss(net: FaultNet, percent: float):
    """Each packet crossing the wire, either way, dropped with probability percent / 100."""
    if not 0 < percent < 100:
        raise ValueError(f"loss percent must be in (0, 100), got {percent!r}")
    return _forward_rules(net, [("-m", "statistic", "--mode", "random", "--probability", f"{percent / 100:.4f}",
                                 "-j", "DROP")])


def _overlimits(net: FaultNet, dev: str) -> int:
    text = in_ns(net.wire_ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout
    m = re.search(r"overlimits (\d+)", text)
    return int(m.group(1)) if m else 0


@contextlib.contextmanager
def squeeze(net: FaultNet, rate: str = "40mbit", burst: str = "32kb", latency: str = "200ms") -> Iterator[FaultHits]:
    """Both directions of the wire limited by a token bucket (tc tbf on the wire namespace's two
    egresses): `rate` sustained, `burst` bytes at line speed, packets queued past `latency` dropped."""
    added: list[str] = []
    hits = FaultHits()
    try:
        for dev in net.wire_devs:
            in_ns(net.wire_ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                  "latency", latency)
            added.append(dev)
        yield hits
    finally:
        try:
            hits.count = sum(_overlimits(net, dev) for dev in added)
        finally:
            for dev in added:
                in_ns(net.wire_ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)


def active_faults(net: FaultNet) -> str:
    """The wire namespace's FORWARD rules and qdiscs now (for failure messages and a check that a
    fault undid itself)."""
    rules = in_ns(net.wire_ns, "iptables", "-w", "5", "-S", "FORWARD").stdout.strip()
    qdiscs = " | ".join(in_ns(net.wire_ns, "tc", "qdisc", "show", "dev", dev).stdout.strip() for dev in net.wire_devs)
    return f"{rules} ; {qdiscs}"


def no_faults(net: FaultNet) -> bool:
    rules = in_ns(net.wire_ns, "iptables", "-w", "5", "-S", "FORWARD").stdout.split("\n")
    qdiscs = [in_ns(net.wire_ns, "tc", "qdisc", "show", "dev", dev).stdout for dev in net.wire_devs]
    return [r for r in rules if r.strip()] == ["-P FORWARD ACCEPT"] and not any("tbf" in q for q in qdiscs)


# --- the cluster across the wire ----------------------------------------------------------------------

def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]


class NetCluster(Cluster):
    """A Cluster (options as ClusterConfig's, provider tcp;ofi_rxm by default) whose first
    `prefill - local_prefill` prefill nodes run in the far namespace on far_addr; the rest, the
    decode nodes and the router run here on near_addr. Every node's fabric listens in FABRIC_PORTS.
    decode_args: flags only the decode nodes get (e.g. --local-prefill-fallback)."""

    def __init__(self, net: FaultNet, local_prefill: int = 0, decode_args: Sequence[str] = (),
                 **options: object) -> None:
        options.setdefault("provider", "tcp;ofi_rxm")
        super().__init__(host=net.near_addr, **options)
        self.net = net
        prefills = [s for s in self.specs if s.role == "prefill"]
        if not 0 <= local_prefill < len(prefills):
            raise ValueError(f"local_prefill must leave at least one of the {len(prefills)} prefill nodes across "
                             f"the wire, got {local_prefill}")
        self.far_names = {s.name for s in prefills[:len(prefills) - local_prefill]}
        moved: dict[str, str] = {}     # near HOST:PORT -> far HOST:PORT
        specs: list[ProcessSpec] = []
        for s in self.specs:
            if s.name in self.far_names:
                argv = _replace_flag(list(s.argv), "--host", net.far_addr)
                argv = _replace_flag(argv, "--fabric-node", net.far_addr)
                s2 = ProcessSpec(s.name, s.role, net.far_addr, s.port, tuple(argv), s.http_port, s.cpus)
                moved[s.address] = s2.address
                specs.append(s2)
            else:
                specs.append(s)
        for i, s in enumerate(specs):
            if s.role == "decode":
                argv = list(s.argv)
                j = argv.index("--prefill")
                argv[j + 1] = ",".join(moved.get(a, a) for a in argv[j + 1].split(","))
                argv += list(decode_args)
                specs[i] = ProcessSpec(s.name, s.role, s.host, s.port, tuple(argv), s.http_port, s.cpus)
        self.specs = specs
        for s in specs:
            self._children[s.name].spec = s

    def _spawn(self, name: str) -> None:
        child = self._children[name]
        env = {**_child_env(), "FI_TCP_PORT_LOW_RANGE": str(self.net.fabric_ports[0]),
               "FI_TCP_PORT_HIGH_RANGE": str(self.net.fabric_ports[1])}
        argv = child_command(child.spec.argv, os.getpid(), child.spec.cpus)
        if name in self.far_names:
            argv = ["ip", "netns", "exec", self.net.far_ns, *argv]   # exec: the child is still ours
        with open(child.log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            child.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)


def fabric_listeners(net: FaultNet) -> dict[str, list[int]]:
    """TCP ports listening in each namespace of the cluster now ("near": root, "far")."""
    out: dict[str, list[int]] = {}
    for side, prefix in (("near", ()), ("far", ("ip", "netns", "exec", net.far_ns))):
        text = _run(*prefix, "ss", "-Htln").stdout
        out[side] = sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in text.splitlines() if line.strip()})
    return out


def fabric_connections(net: FaultNet) -> dict[str, int]:
    """Established TCP connections with an end in FABRIC_PORTS, per side ("near", "far"): after a
    fault, a side that still counts one its peer has dropped holds a half-open KV connection."""
    low, high = net.fabric_ports
    out: dict[str, int] = {}
    for side, prefix in (("near", ()), ("far", ("ip", "netns", "exec", net.far_ns))):
        n = 0
        for line in _run(*prefix, "ss", "-Htn", "state", "established").stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4:
                ports = {int(x.rsplit(":", 1)[1]) for x in parts[2:4]}
                n += any(low <= p <= high for p in ports)
        out[side] = n
    return out


# --- one fault against a running cluster: what happened to the requests and to the nodes -------------

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# ~230 tokens each, distinct heads (no prefix-cache hit between them): ~8 prefill chunks of 32 and
# ~11 MB of KV each (SmolLM2-135M, float32) across the wire, so that a fault struck at the first
# transfer in flight finds the batch mid-transfer (15 pages each: 3 quarantined + 3 retried fit in
# the tests' 160 pages)
FAULT_PROMPTS = tuple(f"Network fault prompt {i}: " + "the quick brown fox jumps over the lazy dog and runs. " * 19
                      for i in range(3))
VICTIMS = ("The history of the Roman empire begins with " * 5, "Photosynthesis converts light into energy; " * 5)
REQUEST_TIMEOUT_S = 90.0    # a request still open this long after its start is lost (not an explicit error)
CLEAN_WITHIN_S = 30.0       # S2: after the batch, every node is back to nothing held within this
RECOVERY_WITHIN_S = 60.0    # a fresh request succeeds within this after the fault ends, or recovery failed
BUSY_WITHIN_S = 60.0        # a KV transfer is under way within this after the batch starts


@dataclass(frozen=True)
class RequestEnd:
    """How one request ended: its tokens, an explicit error from the cluster, or lost (still open at
    REQUEST_TIMEOUT_S, or fewer tokens than asked with no error)."""

    request_id: str
    tokens: tuple[int, ...] | None
    error: str | None
    lost: bool
    at: float = 0.0     # when it ended (time.monotonic())


@dataclass(frozen=True)
class FaultOutcome:
    """One fault's result. leftovers: what nodes still held CLEAN_WITHIN_S after the batch ended
    (support.cluster.transfer_leftovers; empty = clean). stale_writes: the decode nodes'
    pdserve:kv_stale_writes_total (None: no such metric). fresh_ok / victims_ok: the first fresh
    request after the fault and a victim batch after the clean-up gave the fault-free greedy tokens.
    recovery_s: from the fault's end until a fresh request succeeded by any path (local fallback
    included); remote_recovery_s: until one succeeded that a counted prefill node prefilled (the far
    ones of a NetCluster, counted_prefill_nodes: their pdserve:prefill_requests_total{outcome="ok"}
    moved, nothing else in flight); None: none did within RECOVERY_WITHIN_S. hits: packets the fault
    dropped or held back (> 0: it touched traffic)."""

    fault: str
    held_s: float
    hits: int
    ends: tuple[RequestEnd, ...]
    leftovers: dict[str, dict[str, int]]
    stale_writes: float | None
    fresh_ok: bool
    victims_ok: bool
    recovery_s: float | None
    remote_recovery_s: float | None
    during: object = None          # what strike's `during` returned while the fault was in place

    @property
    def completed(self) -> int:
        return sum(e.tokens is not None for e in self.ends)

    @property
    def errors(self) -> list[str]:
        return [f"{e.request_id}: {e.error}" for e in self.ends if e.error is not None]

    @property
    def lost(self) -> list[str]:
        return [e.request_id for e in self.ends if e.lost]

    @property
    def leaked_pages(self) -> int:
        return sum(c.get("used_blocks", 0) for c in self.leftovers.values())


async def _one(client: AsyncClient, prompt: str, request_id: str, timeout: float = REQUEST_TIMEOUT_S,
               sampling: SamplingParams = GREEDY, progress: dict[str, int] | None = None) -> RequestEnd:
    """One request through the router, as AsyncClient.complete; `progress[request_id]`: the tokens it
    has streamed so far."""
    t0 = time.monotonic()
    acc = _Collector()
    try:
        async for chunk in client.generate(prompt, sampling, request_id=request_id, timeout=timeout):
            acc.add(chunk)
            if progress is not None:
                progress[request_id] = len(acc.ids)
        out = acc.result()
    except ClientError as e:
        hung = e.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 >= timeout * 0.95
        return RequestEnd(request_id, None, None if hung else str(e), hung, time.monotonic())
    tokens = tuple(out.token_ids)
    if len(tokens) != sampling.max_tokens:
        return RequestEnd(request_id, None, None, True, time.monotonic())
    return RequestEnd(request_id, tokens, None, False, time.monotonic())


async def batch(url: str, prompts: Sequence[str], tag: str, sampling: SamplingParams = GREEDY,
                progress: dict[str, int] | None = None) -> tuple[RequestEnd, ...]:
    """Run prompts concurrently through the router at `url` (bounded by REQUEST_TIMEOUT_S each), as
    request ids TAG-i; `progress`: the tokens each has streamed so far, by request id."""
    async with AsyncClient(url, timeout=REQUEST_TIMEOUT_S) as client:
        return tuple(await asyncio.gather(*(_one(client, p, f"{tag}-{i}", sampling=sampling, progress=progress)
                                            for i, p in enumerate(prompts))))


def _tag(what: str) -> str:
    return f"{what}-{os.getpid()}-{time.monotonic_ns() // 1_000_000}"


def reference(url: str) -> dict[str, tuple[int, ...]]:
    """The victims' greedy tokens on the fault-free cluster, by prompt."""
    ends = asyncio.run(batch(url, VICTIMS, _tag("reference")))
    bad = [e for e in ends if e.tokens is None]
    if bad:
        raise AssertionError(f"the fault-free reference run failed: {bad}")
    return {p: e.tokens for p, e in zip(VICTIMS, ends, strict=True)}


def metric(url: str, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples (with `labels`) on the /metrics at `url`; None when it has none."""
    text, _ = fetch(url)
    samples = parse(text)
    if not any(n == name for n, _ in samples):
        return None
    return total(samples, name, **labels)


def stale_writes(cluster: Cluster) -> float | None:
    """Sum of pdserve:kv_stale_writes_total over the running decode nodes' /metrics; None when absent."""
    exited = cluster.poll()
    values = [metric(url, "pdserve:kv_stale_writes_total") for name, url in cluster.metrics_urls.items()
              if cluster.processes[name].role == "decode" and name not in exited]
    return None if any(v is None for v in values) else sum(values)


def counted_prefill_nodes(cluster: Cluster) -> list[str]:
    """The prefill nodes whose prefills count as "via a prefill node": a NetCluster's far ones (across
    the wire), every prefill node of a plain Cluster."""
    far = getattr(cluster, "far_names", None)
    return sorted(far) if far else [s.name for s in cluster.specs if s.role == "prefill"]


def remote_prefills(cluster: Cluster) -> float:
    """Prefills the running counted prefill nodes (counted_prefill_nodes) answered ok so far."""
    exited = cluster.poll()
    return sum(metric(cluster.metrics_urls[n], "pdserve:prefill_requests_total", outcome="ok") or 0.0
               for n in counted_prefill_nodes(cluster) if n not in exited)


def node_addresses(cluster: Cluster) -> list[str]:
    """The running nodes' addresses (one that has exited answers nothing)."""
    exited = cluster.poll()
    return [s.address for s in cluster.specs if s.role != "router" and s.name not in exited]


class LeftoversError(AssertionError):
    """Nodes still hold pages, transfers or requests after a fault (S2): raised by `assert_clean`, so
    that an xfail can name this failure and no other."""


def assert_clean(out: FaultOutcome) -> None:
    if out.leftovers:
        raise LeftoversError(f"nodes still hold {CLEAN_WITHIN_S:.0f} s after the batch: {out.leftovers}")


async def _first_success(url: str, expected: tuple[int, ...], since: float,
                         counted: Callable[[], float] | None = None) -> tuple[float | None, bool]:
    """Send the first victim until one succeeds (and, with `counted`, moved that count: it went the
    way asked for), each try bounded by what is left of RECOVERY_WITHIN_S after `since`: seconds
    after `since`, and whether the successful request's tokens equal the fault-free run's."""
    deadline = since + RECOVERY_WITHIN_S
    while time.monotonic() < deadline:
        before = await asyncio.to_thread(counted) if counted else 0.0
        async with AsyncClient(url) as client:
            end = await _one(client, VICTIMS[0], _tag("fresh"), timeout=max(1.0, deadline - time.monotonic()))
        if end.tokens is not None:
            if counted is None or await asyncio.to_thread(counted) > before:
                return time.monotonic() - since, end.tokens == expected
        await asyncio.sleep(0.2)
    return None, False


def transferring(cluster: Cluster, busy_node: str) -> Callable[[], bool]:
    """Whether `busy_node` (a prefill node) has a request in flight and a running decode node awaits
    KV (NodeInfo.transfers.tags_in_use): strike's default moment to strike a held fault."""
    busy_address = cluster.processes[busy_node].address
    exited = cluster.poll()
    decodes = [s.address for s in cluster.specs if s.role == "decode" and s.name not in exited]

    def transferring() -> bool:
        return bool(node_load(busy_address).outstanding_requests
                    and any(node_info(a).transfers.tags_in_use for a in decodes))

    return transferring


async def _strike(cluster: Cluster, name: str, fault: Callable[[], contextlib.AbstractContextManager[FaultHits]],
                  hold_s: float | None, prompts: Sequence[str], ref: dict[str, tuple[int, ...]],
                  busy_node: str, during: Callable[[], object] | None, ready: Callable[[], bool] | None,
                  sampling: SamplingParams, progress: dict[str, int] | None) -> FaultOutcome:
    url = cluster.url
    seen: object = None
    expected = ref[VICTIMS[0]]
    tag = _tag(name)
    # Each strike's own prompts: the same text as an earlier strike's would hit the prefill node's
    # prefix cache, its prefill would be a burst of writes over before the fault, and the fault
    # would touch no packet.
    prompts = [f"{tag}: {p}" for p in prompts]
    with contextlib.ExitStack() as stack:
        if hold_s is None:     # the fault in place before the batch starts, lifted when it ends
            hits = stack.enter_context(fault())
        task = asyncio.create_task(batch(url, prompts, tag, sampling, progress))
        t0 = time.monotonic()
        if hold_s is not None:  # struck once `ready` (default: the prefill node has a request in flight)
            what = (f"{busy_node} to have a request in flight and a decode node a transfer" if ready is None
                    else f"the moment to strike {name} ({getattr(ready, '__name__', 'ready')})")
            await asyncio.sleep(0.1)
            await asyncio.to_thread(wait_until, ready or transferring(cluster, busy_node), BUSY_WITHIN_S, what,
                                    interval=0.05)
            t0 = time.monotonic()
            hits = stack.enter_context(fault())
            lift_at = t0 + hold_s
            if during is not None:
                seen = await asyncio.to_thread(during)
            await asyncio.sleep(max(0.0, lift_at - time.monotonic()))
        else:
            if during is not None:
                seen = await asyncio.to_thread(during)
            await asyncio.wait_for(asyncio.shield(task), REQUEST_TIMEOUT_S + 30)
    ended = time.monotonic()
    recovery_s, fresh_ok = await _first_success(url, expected, ended)
    ends = await asyncio.wait_for(task, REQUEST_TIMEOUT_S + 30)
    remote_s, remote_ok = await _first_success(url, expected, ended, lambda: remote_prefills(cluster))
    addresses = node_addresses(cluster)
    try:
        await asyncio.to_thread(wait_until, lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S,
                                "every node free == total with nothing quarantined, held, tagged or in flight",
                                interval=0.2)
        left: dict[str, dict[str, int]] = {}
    except AssertionError:
        left = (await asyncio.to_thread(transfer_leftovers, addresses)).left
    stale = await asyncio.to_thread(stale_writes, cluster)
    victims = await batch(url, VICTIMS, _tag(f"victims-{name}"))
    victims_ok = all(e.tokens == ref[p] for p, e in zip(VICTIMS, victims, strict=True))
    return FaultOutcome(name, ended - t0, hits.count, ends, left, stale, fresh_ok and (remote_ok or remote_s is None),
                        victims_ok, recovery_s, remote_s, seen)


def strike(cluster: Cluster, name: str, fault: Callable[[], contextlib.AbstractContextManager[FaultHits]],
           hold_s: float | None, ref: dict[str, tuple[int, ...]], prompts: Sequence[str] = FAULT_PROMPTS,
           busy_node: str | None = None, during: Callable[[], object] | None = None,
           ready: Callable[[], bool] | None = None, sampling: SamplingParams = GREEDY,
           progress: dict[str, int] | None = None) -> FaultOutcome:
    """Run `prompts` (each with `sampling`; `progress`, filled as they stream: the tokens each request
    has streamed so far, by request id) through the router under `fault()`: with hold_s, struck
    once `ready()` is true (polled every 50 ms, at most BUSY_WITHIN_S; default: `busy_node`, the
    first counted prefill node by default, has one in flight and a decode node awaits its KV,
    `transferring`), and lifted hold_s seconds later; with None, in place before the batch starts and
    lifted when it ends. `during` (bounded by its own calls) runs once while the fault is in place.
    Then measure (FaultOutcome). Bounded: about 2 * REQUEST_TIMEOUT_S + 2 * RECOVERY_WITHIN_S +
    CLEAN_WITHIN_S + BUSY_WITHIN_S."""
    busy = busy_node or counted_prefill_nodes(cluster)[0]
    bound = 2 * REQUEST_TIMEOUT_S + 2 * RECOVERY_WITHIN_S + CLEAN_WITHIN_S + BUSY_WITHIN_S + 60
    return asyncio.run(asyncio.wait_for(
        _strike(cluster, name, fault, hold_s, prompts, ref, busy, during, ready, sampling, progress), bound))


def reset_if_held(cluster: Cluster) -> dict[str, dict[str, int]]:
    """Restart every node that still holds pages, transfers or requests, or has exited (so that one
    scenario's leftovers, already reported by its own test, do not fail the next); what they held."""
    by_address = {s.address: s.name for s in cluster.specs}
    dead = {s.address: {"exited": code} for name, code in cluster.poll().items()
            for s in cluster.specs if s.name == name and s.role != "router"}
    held = {**transfer_leftovers(node_addresses(cluster)).left, **dead}
    for address in held:
        cluster.restart(by_address[address])
    if held:   # serving is not enough: the router takes it back in rotation at its next health poll

        def serves() -> bool:
            with Client(cluster.url, timeout=REQUEST_TIMEOUT_S) as client:
                return len(client.complete(VICTIMS[0], GREEDY, request_id=_tag("after-restart")).token_ids) > 0

        wait_until(serves, RECOVERY_WITHIN_S, "the router to serve through the restarted nodes", interval=0.5,
                   retry_on=(ClientError,))
    return held
