"""Node and router death on the request path (S1, S8, S10), with real processes: one prefill node,
two decode nodes and the router (pdserve.tools.launcher.Cluster, shm fabric).

- A decode node SIGKILLed while it streams costs its clients a pause, not an error: the router
  resumes each of its requests on the other decode node with the tokens already streamed
  (GenerateRequest.resume), and every client gets the greedy tokens and text of a fault-free run.
- A router SIGKILLed mid-stream: the client gets an error well within its deadline, and every node
  frees its pages and requests within ~2 s (the decode node sees its Generate stream cancelled).

- A decode node SIGSTOPped while it streams (hung, partitioned): the router's health poll marks it
  down and its requests move the same way; continued, it frees everything.

One module-scoped cluster, small engines (two cores): the router test runs first (it restarts the
router), the SIGKILL test last (it leaves one decode node dead).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from support.cluster import node_load, running_cluster
from support.wait import wait_until

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, Client, ClientError
from pdserve.tools.launcher import Cluster

CLUSTER = dict(prefill=1, decode=2, port=0, http_port=None, num_blocks=64, threads_per_node=1,
               engine_args=("--max-batch-tokens", "16", "--page-size", "16"), startup_timeout_s=150,
               router_health_interval_s=0.5)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "Ünïcödé: café, naïve, 東京, 😀 — and then"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
WAIT = 120.0          # every wait of a whole run is bounded by this
FREE_AFTER_KILL_S = 2.0  # a node frees a request whose Generate stream was cut off within this long


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory, "migration", **CLUSTER) as c:
        yield c


def _live_nodes(cluster: Cluster) -> list[str]:
    running = {n for n in cluster.processes if n not in cluster.poll()}
    return [s.address for s in cluster.specs if s.role != "router" and s.name in running]


def _held(cluster: Cluster) -> dict[str, tuple[int, int, int]]:
    """Live nodes that still hold pages or requests: address -> (free, total, outstanding)."""
    loads = {a: node_load(a) for a in _live_nodes(cluster)}
    return {a: (x.free_kv_blocks, x.total_kv_blocks, x.outstanding_requests) for a, x in loads.items()
            if x.free_kv_blocks != x.total_kv_blocks or x.outstanding_requests}


async def _stream_all(url: str, started: asyncio.Event | None = None, after: int = 3):
    """Run every prompt at once; `started` is set once each has streamed `after` tokens. Returns, per
    prompt, (token ids, text, finish reason, error)."""
    progress = [0] * len(PROMPTS)
    async with AsyncClient(url, timeout=WAIT) as client:
        async def one(i: int, prompt: str):
            ids, text, finish, error = [], [], None, ""
            async for chunk in client.generate(prompt, GREEDY, request_id=f"mig-{i}-{time.monotonic_ns()}"):
                ids.extend(chunk.token_ids)
                text.append(chunk.text)
                progress[i] = len(ids)
                if started is not None and min(progress) >= after:
                    started.set()
                if chunk.finish_reason:
                    finish, error = chunk.finish_reason, chunk.error
            return ids, "".join(text), finish, error

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


def test_a_killed_router_fails_its_clients_fast_and_every_node_frees_within_two_seconds(cluster):
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
    cluster.restart("router")
    with Client(cluster.url, timeout=WAIT) as client:
        assert client.complete(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3)).finish_reason == "length"


@pytest.fixture(scope="module")
def reference(cluster):
    """The fault-free run's outputs, per prompt."""
    outputs = asyncio.run(asyncio.wait_for(_stream_all(cluster.url), WAIT))
    assert all(finish == "length" and not error for _, _, finish, error in outputs), outputs
    wait_until(lambda: not _held(cluster), 30, "every node free after the fault-free run", interval=0.1)
    return outputs


def _fault_mid_stream(cluster: Cluster, reference, fault) -> str:
    """Stream every prompt, apply `fault(name)` to the decode node holding the most of them once each
    has streamed 3 tokens; assert 0 client errors and the fault-free run's tokens and text."""
    decodes = [s for s in cluster.specs if s.role == "decode" and s.name not in cluster.poll()]

    async def faulty():
        started = asyncio.Event()
        run = asyncio.create_task(_stream_all(cluster.url, started))
        await asyncio.wait_for(started.wait(), WAIT)
        loads = {s.name: node_load(s.address).outstanding_requests for s in decodes}
        victim = max(loads, key=loads.get)
        assert loads[victim] > 0, loads   # so at least one request has to move
        fault(victim)
        return victim, loads, await run

    victim, loads, outputs = asyncio.run(asyncio.wait_for(faulty(), 2 * WAIT))
    errors = [(i, finish, error) for i, (_, _, finish, error) in enumerate(outputs) if finish != "length" or error]
    assert not errors, f"client errors after the fault on {victim} (requests per node {loads}): {errors}"
    for i, ((ids, text, _, _), (ref_ids, ref_text, _, _)) in enumerate(zip(outputs, reference, strict=True)):
        assert ids == ref_ids, f"prompt {i}: tokens differ from the fault-free run"
        assert text == ref_text, f"prompt {i}: text differs from the fault-free run at the seam"
    return victim


def test_a_stopped_decode_node_is_marked_down_and_its_streams_move(cluster, reference):
    # SIGSTOP (a hung process, a partition): its health checks time out, the router marks it down
    # and moves its streams; once continued, it sees their calls cancelled and frees everything.
    victim = _fault_mid_stream(cluster, reference, lambda name: cluster.send_signal(name, signal.SIGSTOP))
    cluster.send_signal(victim, signal.SIGCONT)
    wait_until(lambda: not _held(cluster), 30, "every node free once the stopped node runs again", interval=0.1)


def test_a_decode_node_killed_mid_stream_costs_a_pause_not_an_error(cluster, reference):
    _fault_mid_stream(cluster, reference, lambda name: cluster.kill(name, signal.SIGKILL))
    wait_until(lambda: not _held(cluster), 30, "every surviving node free after the migration", interval=0.1)
    with Client(cluster.url, timeout=WAIT) as client:   # the cluster keeps serving on the survivor
        assert client.complete(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3)).finish_reason == "length"
