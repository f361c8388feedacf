"""Node and router death on the request path (S1, S8, S10), with real processes: one prefill node,
two decode nodes and the router (pdserve.tools.launcher.Cluster, shm fabric).

- A decode node SIGKILLed while it streams costs its clients a pause, not an error: the router
  resumes each of its requests on the other decode node with the tokens already streamed
  (GenerateRequest.resume), and every client gets the tokens and text of a fault-free run: greedy,
  and seeded sampled ones too (the seed's stream continues exactly, SamplingParams.rng_skip_tokens).
  The router's log says which node serves each request: the victim is one serving a seeded request,
  and the run asserts that one moved.
- A router SIGKILLed mid-stream: the client gets an error well within its deadline, and every node
  frees its pages and requests within 1 s (the decode node sees its Generate stream cancelled); a
  new router on the same port serves at once, with the fault-free run's outputs.

- A decode node SIGSTOPped while it streams (hung, partitioned): the router's health poll marks it
  down and its requests move the same way; continued, it frees everything.
- A decode node whose engine thread dies while it streams (the test-only fault of
  $PDSERVE_TEST_ONLY_ENGINE_DEATH_FILE, pdserve.engine.engine_thread): its streams end with ERROR
  messages of ERROR_CAUSE_NODE, and the router moves them the same way (its log says "finish=node
  error"); the node is restarted for the next test.

After each fault every test asserts, on every node still running (and on a restarted one), never
assumes (issue 15; the checks of test_transfer_faults): every request ended with its tokens or an
explicit error; each node is back to free == total with nothing outstanding, quarantined, held,
tagged, slotted or in flight (NodeInfo.transfers, support.cluster.transfer_leftovers; bounded wait);
no stale write was counted (each node's `pdserve:kv_stale_writes_total` on its /metrics is 0); a batch
of victim requests run right after, on the freed pages, and then one fresh request give the greedy
tokens and text of the same requests on the fault-free cluster.

One module-scoped cluster, small engines (two cores): the fault-free runs first, then the router
test (it restarts the router), the SIGKILL test last (it leaves one decode node dead).
Every child inherits $PDSERVE_TEST_ONLY_ENGINE_DEATH_FILE = <tmp>/die-{pid}: a node's engine thread
dies only when the test creates that file for its process id.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.cluster import node_load, routed, running_cluster, transfer_leftovers
from support.prometheus import fetch, parse, total
from support.wait import wait_until

from pdserve.engine.engine_thread import TEST_DEATH_FILE_ENV
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, Client, ClientError
from pdserve.tools.launcher import Cluster, ProcessSpec

CLUSTER = dict(prefill=1, decode=2, port=0, http_port=None, num_blocks=64, threads_per_node=1,
               engine_args=("--max-batch-tokens", "16", "--page-size", "16"), startup_timeout_s=150,
               router_health_interval_s=0.5)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "Ünïcödé: café, naïve, 東京, 😀 — and then"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
VICTIM_GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=40, seed=seed, max_tokens=24, ignore_eos=True)


@dataclass(frozen=True)
class Job:
    """One request of a run: a prompt and how it samples."""

    prompt: str
    params: SamplingParams
    kind: str  # "greedy" or "seeded": part of its request id


# Every prompt greedy, two of them also seeded sampled (the last one's text has multi-byte characters).
JOBS = [Job(p, GREEDY, "greedy") for p in PROMPTS] + [Job(PROMPTS[i], _seeded(100 + i), "seeded") for i in (0, 3)]
# The batch run right after each fault, on the pages the fault's requests freed (short: two cores).
VICTIMS = [Job(p, VICTIM_GREEDY, "victim") for p in ("The history of the Roman empire begins with",
                                                     "import numpy as np\nx =", "Paris, Berlin, Madrid,",
                                                     "Photosynthesis converts light into")]
WAIT = 120.0          # every wait of a whole run is bounded by this
FREE_AFTER_KILL_S = 1.0  # a node frees a request whose Generate stream was cut off within this long
CLEAN_WITHIN_S = 30.0    # after a fault, every node is back to nothing held within this long
STALE_WRITES = "pdserve:kv_stale_writes_total"


@pytest.fixture(scope="module")
def death_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-death")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, death_dir):
    with pytest.MonkeyPatch.context() as env:   # set while the cluster runs: a restarted child gets it too
        env.setenv(TEST_DEATH_FILE_ENV, str(death_dir / "die-{pid}"))
        with running_cluster(tmp_path_factory, "migration", **CLUSTER) as c:
            yield c


def _pid(spec: ProcessSpec) -> int:
    """A child's process id, from /proc: the one started by this process whose command line ends
    with the spec's (pdserve.tools.launcher.child_command)."""
    tail, parent = list(spec.argv[1:]), ["--parent-pid", str(os.getpid())]
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            args = [a.decode(errors="replace") for a in (d / "cmdline").read_bytes().split(b"\0")[:-1]]
        except OSError:   # it exited meanwhile
            continue
        if args[-len(tail):] == tail and any(args[i:i + 2] == parent for i in range(len(args))):
            return int(d.name)
    raise AssertionError(f"no process of {spec.name} found in /proc")


def _live_specs(cluster: Cluster) -> list[ProcessSpec]:
    """The nodes (not the router) running now."""
    running = {n for n in cluster.processes if n not in cluster.poll()}
    return [s for s in cluster.specs if s.role != "router" and s.name in running]


def _live_nodes(cluster: Cluster) -> list[str]:
    return [s.address for s in _live_specs(cluster)]


def _held(cluster: Cluster) -> dict[str, tuple[int, int, int]]:
    """Live nodes that still hold pages or requests: address -> (free, total, outstanding)."""
    loads = {a: node_load(a) for a in _live_nodes(cluster)}
    return {a: (x.free_kv_blocks, x.total_kv_blocks, x.outstanding_requests) for a, x in loads.items()
            if x.free_kv_blocks != x.total_kv_blocks or x.outstanding_requests}


def _routes(cluster: Cluster, tag: str) -> list[tuple[str, str, int]]:
    """The router log's attempts of run `tag`, in order: (request id, node address, tokens resumed)."""
    return [r for r in routed(cluster) if r[0].startswith(f"mig-{tag}-")]


async def _stream_all(url: str, started: asyncio.Event | None = None, after: int = 3, tag: str = "ref",
                      jobs: list[Job] = JOBS):
    """Run every job at once (request ids mig-<tag>-<kind>-<i>); `started` is set once each has
    streamed `after` tokens. Returns, per job, (token ids, text, finish reason, error)."""
    progress = [0] * len(jobs)
    async with AsyncClient(url, timeout=WAIT) as client:
        async def one(i: int, job: Job):
            ids, text, finish, error = [], [], None, ""
            async for chunk in client.generate(job.prompt, job.params, request_id=f"mig-{tag}-{job.kind}-{i}"):
                ids.extend(chunk.token_ids)
                text.append(chunk.text)
                progress[i] = len(ids)
                if started is not None and min(progress) >= after:
                    started.set()
                if chunk.finish_reason:
                    finish, error = chunk.finish_reason, chunk.error
            return ids, "".join(text), finish, error

        return await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))


@pytest.fixture(scope="module")
def reference(cluster):
    """The fault-free run's outputs, per job."""
    outputs = asyncio.run(asyncio.wait_for(_stream_all(cluster.url), WAIT))
    assert all(finish == "length" and not error for _, _, finish, error in outputs), outputs
    wait_until(lambda: not _held(cluster), 30, "every node free after the fault-free run", interval=0.1)
    return outputs


@pytest.fixture(scope="module")
def victim_reference(cluster, reference):
    """The victim batch's outputs on the fault-free cluster (after the fault-free run, before any fault)."""
    outputs = asyncio.run(asyncio.wait_for(_stream_all(cluster.url, tag="victims-ref", jobs=VICTIMS), WAIT))
    assert all(finish == "length" and not error and len(ids) == VICTIM_GREEDY.max_tokens
               for ids, _, finish, error in outputs), outputs
    return outputs


def _assert_as_reference(outputs, reference, what: str, jobs: list[Job] = JOBS) -> None:
    errors = [(i, finish, error) for i, (_, _, finish, error) in enumerate(outputs) if finish != "length" or error]
    assert not errors, f"client errors {what}: {errors}"
    for i, ((ids, text, _, _), (ref_ids, ref_text, _, _)) in enumerate(zip(outputs, reference, strict=True)):
        assert ids == ref_ids, f"job {i} ({jobs[i].kind}) {what}: tokens differ from the fault-free run"
        assert text == ref_text, f"job {i} ({jobs[i].kind}) {what}: text differs from the fault-free run at the seam"


def _stale_writes(cluster: Cluster) -> dict[str, float]:
    """Every running node's pdserve:kv_stale_writes_total, read from its own /metrics (the family
    must be there: a node that stopped exposing it must not pass as 0)."""
    counts = {}
    for spec in _live_specs(cluster):
        samples = parse(fetch(cluster.metrics_urls[spec.name])[0])
        assert any(name == STALE_WRITES for name, _ in samples), f"{spec.name} exposes no {STALE_WRITES}"
        counts[spec.name] = total(samples, STALE_WRITES)
    return counts


def _assert_clean(cluster: Cluster, when: str) -> None:
    """Every running node back to free == total with nothing outstanding, quarantined, held, tagged,
    slotted or in flight (bounded wait), and no stale write counted on any."""
    addresses = _live_nodes(cluster)
    wait_until(lambda: transfer_leftovers(addresses), CLEAN_WITHIN_S,
               f"every node {when}: free == total, nothing quarantined, held, tagged, slotted or in flight",
               interval=0.1)
    stale = _stale_writes(cluster)
    assert not any(stale.values()), f"stale KV writes counted {when}: {stale}"


def _assert_recovered(cluster: Cluster, victim_reference, tag: str) -> None:
    """After a fault: every running node clean with no stale write; a victim batch on the freed pages,
    then one fresh request, give the fault-free greedy outputs; every node clean again after them."""
    _assert_clean(cluster, f"after the fault ({tag})")
    victims = asyncio.run(asyncio.wait_for(_stream_all(cluster.url, tag=f"victims-{tag}", jobs=VICTIMS), WAIT))
    _assert_as_reference(victims, victim_reference, f"in the victim batch after the fault ({tag})", VICTIMS)
    with Client(cluster.url, timeout=WAIT) as client:
        fresh = client.complete(VICTIMS[0].prompt, VICTIM_GREEDY, request_id=f"mig-fresh-{tag}")
    ids, text, _, _ = victim_reference[0]
    assert (list(fresh.token_ids), fresh.text, fresh.finish_reason) == (ids, text, "length"), \
        f"the fresh request after the fault ({tag}) differs from the fault-free run"
    _assert_clean(cluster, f"after the victim batch and the fresh request ({tag})")


def test_a_killed_router_fails_its_clients_fast_and_every_node_frees_within_a_second(cluster, reference,
                                                                                     victim_reference):
    async def go():
        async with AsyncClient(cluster.url, timeout=WAIT) as client:
            stream = client.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            got = 0
            async for chunk in stream:
                got += len(chunk.token_ids)
                if got >= 3:
                    break
            assert any(node_load(a).outstanding_requests for a in _live_nodes(cluster))
            cluster.kill("router", signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(ClientError) as err:
                async for _ in stream:
                    pass
            return killed, time.monotonic() - killed, err.value

    killed, error_after, error = asyncio.run(asyncio.wait_for(go(), WAIT))
    assert error_after < 10.0, f"the client's error came {error_after:.1f} s after the kill ({error})"
    wait_until(lambda: not _held(cluster), max(killed + FREE_AFTER_KILL_S - time.monotonic(), 1e-3),
               f"every node free within {FREE_AFTER_KILL_S} s of the router's death (address: free, total, "
               "outstanding)", interval=0.05)
    _assert_clean(cluster, "after the router's death")
    # A new router process on the same port: the first requests it gets, a whole run on the pages the
    # killed stream used, come out as the fault-free run's.
    cluster.restart("router")
    outputs = asyncio.run(asyncio.wait_for(_stream_all(cluster.url, tag="new-router"), WAIT))
    _assert_as_reference(outputs, reference, "from the restarted router")
    _assert_recovered(cluster, victim_reference, "router-restart")


def _fault_mid_stream(cluster: Cluster, reference, fault, tag: str) -> str:
    """Stream every job; once each has streamed 3 tokens, apply `fault(name)` to the decode node
    serving the most seeded jobs (then the most jobs), by the router's log; assert 0 client errors,
    the fault-free run's tokens and text, and that a seeded job was resumed."""
    decodes = {s.address: s.name for s in cluster.specs if s.role == "decode" and s.name not in cluster.poll()}

    async def faulty():
        started = asyncio.Event()
        run = asyncio.create_task(_stream_all(cluster.url, started, tag=tag))
        await asyncio.wait_for(started.wait(), WAIT)
        serving = {rid: node for rid, node, _ in _routes(cluster, tag)}   # the last attempt of each
        held = {a: [rid for rid, node in serving.items() if node == a] for a in decodes}
        victim = max(held, key=lambda a: (sum("-seeded-" in r for r in held[a]), len(held[a])))
        assert any("-seeded-" in r for r in held[victim]), held   # so a seeded request has to move
        fault(decodes[victim])
        return decodes[victim], held, await run

    victim, held, outputs = asyncio.run(asyncio.wait_for(faulty(), 2 * WAIT))
    _assert_as_reference(outputs, reference, f"after the fault on {victim} (requests per node {held})")
    resumed = {rid for rid, _, n in _routes(cluster, tag) if n > 0}
    assert any("-seeded-" in r for r in resumed), f"no seeded request resumed: {resumed}"
    return victim


def test_a_stopped_decode_node_is_marked_down_and_its_streams_move(cluster, reference, victim_reference):
    # SIGSTOP (a hung process, a partition): its health checks time out, the router marks it down
    # and moves its streams; once continued, it sees their calls cancelled and frees everything.
    victim = _fault_mid_stream(cluster, reference, lambda name: cluster.send_signal(name, signal.SIGSTOP), "stop")
    cluster.send_signal(victim, signal.SIGCONT)
    _assert_recovered(cluster, victim_reference, "stop")   # the continued node included


def test_a_decode_node_whose_engine_thread_dies_mid_stream_moves_its_streams(cluster, reference, victim_reference,
                                                                              death_dir):
    def kill_engine_thread(name: str) -> None:
        (death_dir / f"die-{_pid(next(s for s in cluster.specs if s.name == name))}").touch()

    victim = _fault_mid_stream(cluster, reference, kill_engine_thread, "engine-death")
    log = (cluster.log_dir / "router.log").read_text(errors="replace")
    moved = re.findall(r"done request_id=(mig-engine-death-\S+) node=\S+ finish=node error", log)
    assert moved, f"no stream on {victim} ended with a node error that the router moved"
    # its counter dies with the process: read it (and every other node's) before the restart
    stale = _stale_writes(cluster)
    assert not any(stale.values()), f"stale KV writes counted before {victim}'s restart: {stale}"
    cluster.restart(victim)   # it runs, but without an engine it cannot serve (NOT_SERVING)
    _assert_recovered(cluster, victim_reference, "engine-death")   # the restarted node included


def test_a_decode_node_killed_mid_stream_costs_a_pause_not_an_error(cluster, reference, victim_reference):
    _fault_mid_stream(cluster, reference, lambda name: cluster.kill(name, signal.SIGKILL), "kill")
    _assert_recovered(cluster, victim_reference, "kill")   # the cluster keeps serving on the survivors
