"""Whole clusters on one machine (K1, D1, D18, R3, R6, S2): real router, prefill and decode processes.

Evidence for the cluster: greedy outputs through the router equal the single-process engine's
(so, by test_engine_reference, transformers'), for prompts that need several prefill chunks
(--max-batch-tokens 32) and many pages; 32 concurrent streaming clients all finish right and leave
no page behind on any node; `pdserve generate --url` prints what the local command prints; a
colocated cluster gives the same outputs; a killed decode node leaves the rotation and comes back.

Each cluster is class-scoped, so at most one runs at a time. Engines are small (--num-blocks 256,
--threads 1) to fit two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import pytest
from support.cluster import assert_no_page_leak, running_cluster
from support.paths import ROOT
from support.wait import wait_until

from pdserve.engine.sampling_params import SamplingParams
from pdserve.tools.client import AsyncClient, Client
from pdserve.tools.launcher import (
    Cluster,
    ClusterConfig,
    ClusterStartError,
    add_up_args,
    cmd_up,
    free_ports,
    plan,
)

ENGINE = ("--max-batch-tokens", "32")
SMALL = dict(port=0, num_blocks=256, threads_per_node=1, engine_args=ENGINE, startup_timeout_s=150,
             router_health_interval_s=0.5)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
LONG = ("In the beginning the universe was created. This has made a lot of people very angry and been "
        "widely regarded as a bad move. " * 6) + "The answer to everything is"
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", LONG]
LONG_IDS = list(range(300, 300 + 70))  # token ids as given: 70 tokens, 5 pages, 3 chunks of 32
WAIT = 30.0


# ---- the launcher alone ------------------------------------------------------------------------


def _up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return p.parse_args(list(argv))


def test_dry_run_prints_every_command_in_start_order(capsys):
    assert cmd_up(_up_args("--prefill", "2", "--decode", "1", "--port", "50123", "--num-blocks", "64",
                           "--provider", "tcp;ofi_rxm", "--max-batch-tokens", "32", "--dry-run")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" -m ")[1].split()[0] for line in lines] == ["prefill_node", "prefill_node", "decode_node",
                                                                     "router"]
    ports = [int(line.split("--port ")[1].split()[0]) for line in lines]
    assert len(set(ports)) == 4 and ports[-1] == 50123
    prefill_addrs = ",".join(f"127.0.0.1:{p}" for p in ports[:2])
    assert f"--prefill {prefill_addrs}" in lines[2] and f"--decode 127.0.0.1:{ports[2]}" in lines[3]
    assert all("'--provider' 'tcp;ofi_rxm'" in x or "--provider 'tcp;ofi_rxm'" in x for x in lines[:3])
    assert all("--num-blocks 64" in x and "--max-batch-tokens 32" in x for x in lines[:3])

    assert cmd_up(_up_args("--colocated", "2", "--dry-run")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("--colocated" in x for x in lines[:2]) and "prefill_node" not in "".join(lines)


def test_cluster_config_names_bad_values():
    for kwargs, match in ((dict(decode=0), "at least one decode node"), (dict(prefill=0), "at least one prefill"),
                          (dict(colocated=1, decode=2), "colocated nodes replace"),
                          (dict(colocated=1, prefill=1), "colocated nodes replace"),
                          (dict(provider="verbs"), "provider"),
                          (dict(prefill=-1), "prefill must be"), (dict(num_blocks=0), "num_blocks")):
        with pytest.raises(ValueError, match=match):
            ClusterConfig(**kwargs)
    assert ClusterConfig(colocated=2).prefill == 0


def test_http_port_pinned_cores_and_urls_in_the_plan(capsys):
    assert cmd_up(_up_args("--colocated", "1", "--port", "50123", "--http-port", "8123", "--dry-run")) == 0
    router = capsys.readouterr().out.splitlines()[-1]
    assert " -m router " in router and "--port 50123" in router and router.endswith("--http-port 8123")
    assert cmd_up(_up_args("--colocated", "1", "--http-port", "-1", "--dry-run")) == 0
    assert "--http-port" not in capsys.readouterr().out

    config = ClusterConfig(prefill=1, decode=2, port=0, http_port=0, threads_per_node=2, pin_cores=True,
                           node_metrics=False)
    specs = plan(config, ports=range(41000, 41005), cores=[4, 5, 6, 7, 8, 9, 10])
    assert [(s.name, s.port, s.cpus) for s in specs] == [
        ("prefill-0", 41000, (4, 5)), ("decode-0", 41001, (6, 7)), ("decode-1", 41002, (8, 9)), ("router", 41003, ())]
    router = specs[-1]
    assert router.http_port == 41004 and router.http_url == "http://127.0.0.1:41004"
    assert router.argv[-2:] == ("--http-port", "41004")
    assert specs[0].command.startswith("taskset -c 4,5 ") and not router.command.startswith("taskset")
    assert all("--threads 2" in s.command for s in specs[:3])
    with pytest.raises(ValueError, match=r"needs 6 cores, but this process may use only 5 \(0,1,2,3,4\)"):
        plan(config, ports=range(41000, 41005), cores=range(5))
    with pytest.raises(ValueError, match="pin_cores needs threads_per_node"):
        ClusterConfig(pin_cores=True)
    with pytest.raises(ValueError, match="http_port must be in 0..65535"):
        ClusterConfig(http_port=70000)
    with pytest.raises(ValueError, match="gRPC and HTTP ports must differ"):
        ClusterConfig(port=9000, http_port=9000)

    cluster = Cluster(colocated=1, port=0, http_port=0, threads_per_node=1)  # node_metrics: on by default
    urls = cluster.metrics_urls
    assert urls["router"] == f"{cluster.http_url}/metrics" and set(urls) == {"router", "colocated-0"}
    node = cluster.processes["colocated-0"]
    assert urls["colocated-0"] == f"http://127.0.0.1:{node.http_port}/metrics"
    assert node.argv[-2:] == ("--metrics-port", str(node.http_port))
    router = cluster.processes["router"]
    assert len({node.port, node.http_port, router.port, router.http_port}) == 4
    assert Cluster(colocated=1, http_port=None).http_url is None


def test_a_pinned_child_runs_only_on_its_cores():
    import os
    import subprocess

    from pdserve.tools.launcher import child_command, spawn

    core = sorted(os.sched_getaffinity(0))[-1]
    code = "import os, sys; print(sorted(os.sched_getaffinity(0)), sys.argv[1:])"
    proc = spawn([sys.executable, "-c", code, "a", "--b"], (core,), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == f"[{core}] ['a', '--b']"
    assert child_command([sys.executable, "-m", "router", "--port", "1"], 42, (2, 3)) == [
        sys.executable, "-m", "pdserve.tools.launcher", "--parent-pid", "42", "--cpus", "2,3",
        "-m", "router", "--port", "1"]
    with pytest.raises(ValueError, match="preexec_fn is not accepted"):
        spawn([sys.executable, "-c", "pass"], preexec_fn=lambda: None)
    with pytest.raises(ValueError, match=r"must be \[python, '-m', MODULE"):
        child_command(["router", "--port", "1"], 42)


# A launcher in its own process: it counts Python at-fork handler calls (gRPC's pre-fork handler,
# with fork support, is one of those: a cluster test once hung in it inside Popen), spawns a child
# that prints its pid and sleeps, reports, and waits to be killed.
_LAUNCHER = """
import os, subprocess, sys, time
from pdserve.tools.launcher import spawn
forks = []
os.register_at_fork(before=lambda: forks.append(1))
subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, check=True)
with_preexec = len(forks)
child = spawn([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(300)"],
              stdout=subprocess.PIPE, text=True)
print(with_preexec, len(forks) - with_preexec, child.stdout.readline().strip(), flush=True)
time.sleep(300)
"""


def _state(pid: int) -> str:
    """A process's state letter from /proc (Z: a zombie), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_children_run_no_at_fork_handler_and_die_with_the_launcher():
    import os
    import signal
    import subprocess

    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child = None
    try:
        line = launcher.stdout.readline().split()
        assert len(line) == 3, f"launcher said {line!r} (exit {launcher.poll()})"
        with_preexec, with_spawn, child = (int(x) for x in line)
        assert with_preexec == 1, "the at-fork counter does not see a preexec_fn fork: the check below proves nothing"
        assert with_spawn == 0, "spawning a child ran the launcher's at-fork handlers (it must not fork with them)"
        assert _state(child) not in ("gone", "Z")
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        wait_until(lambda: _state(child) in ("gone", "Z"), 30, f"child {child} to die with its killed launcher",
                   interval=0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        if child is not None and _state(child) not in ("gone", "Z"):
            os.kill(child, signal.SIGKILL)  # the test failed: leave no sleeper behind


def test_free_ports_are_distinct_and_bindable():
    import socket

    ports = free_ports(5, exclude=(50051,))
    assert len(set(ports)) == 5 and 50051 not in ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_child_that_fails_to_start_is_named_with_its_log(tmp_path):
    cluster = Cluster(colocated=1, port=0, engine_args=("--no-such-flag",), log_dir=str(tmp_path),
                      startup_timeout_s=60)
    with pytest.raises(ClusterStartError) as err:
        cluster.start()
    message = str(err.value)
    assert "colocated-0 exited with status 2" in message and "--no-such-flag" in message
    assert all(code is not None for code in cluster.stop().values() if code is not None)


# ---- helpers -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """Single-process greedy outputs for PROMPTS and LONG_IDS, computed before any cluster starts."""
    from pdserve import LLM

    llm = LLM(num_blocks=256, num_threads=1)
    outs = llm.generate([*PROMPTS, LONG_IDS], GREEDY)
    assert len(llm.tokenizer(LONG)["input_ids"]) > 64  # several prefill chunks, several pages
    return {key: (o.text, tuple(o.token_ids), o.finish_reason) for key, o in zip([*PROMPTS, "ids"], outs, strict=True)}


def check_greedy(url: str, reference: dict) -> list[str]:
    """Every reference prompt through Client equals the single-process output; returns decode node ids."""
    nodes = []
    with Client(url, timeout=120) as client:
        for key, prompt in [*((p, p) for p in PROMPTS), ("ids", LONG_IDS)]:
            done = client.complete(prompt, GREEDY)
            assert (done.text, done.token_ids, done.finish_reason) == reference[key], key[:40]
            assert done.usage is not None and done.usage.completion_tokens == len(done.token_ids)
            nodes.append(done.timings.decode_node if done.timings else "")
    return nodes


async def concurrent_streams(url: str, n: int) -> list[tuple[str, str, tuple[int, ...], str | None, str]]:
    async with AsyncClient(url, timeout=150) as client:
        async def one(i: int):
            prompt = PROMPTS[i % len(PROMPTS)]
            text, ids, finish, node = [], [], None, ""
            async for chunk in client.generate(prompt, GREEDY, request_id=f"conc-{i}"):
                assert chunk.request_id == f"conc-{i}"
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                if chunk.finish_reason:
                    finish, node = chunk.finish_reason, chunk.timings.decode_node if chunk.timings else ""
            return prompt, "".join(text), tuple(ids), finish, node

        return await asyncio.gather(*(one(i) for i in range(n)))


def check_concurrent_streams(url: str, n: int,
                             reference: dict) -> list[tuple[str, str, tuple[int, ...], str | None, str]]:
    """`n` concurrent streams through the cluster at `url`, each equal to the reference; returns them."""
    results = asyncio.run(asyncio.wait_for(concurrent_streams(url, n), 180))
    for prompt, text, ids, finish, _ in results:
        assert (text, ids, finish) == reference[prompt], prompt[:40]
    return results


# ---- 1 prefill, 2 decode -------------------------------------------------------------------------


@pytest.mark.slow
class TestOnePrefillTwoDecode:
    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls, reference, tmp_path_factory):
        with running_cluster(tmp_path_factory, "p1d2", prefill=1, decode=2, **SMALL) as cluster:
            yield cluster

    def test_greedy_outputs_equal_the_single_process_engine(self, cluster, reference):
        check_greedy(cluster.url, reference)
        assert_no_page_leak(cluster)

    def test_32_concurrent_streams_finish_right_spread_and_leak_nothing(self, cluster, reference):
        results = check_concurrent_streams(cluster.url, 32, reference)
        used = {node for *_, node in results}
        assert used == {"decode-0", "decode-1"}, used
        assert_no_page_leak(cluster)

    def test_generate_url_prints_what_the_local_command_prints(self, cluster, capsys):
        from pdserve.tools.cli import build_parser, main
        from pdserve.tools.client import cmd_generate_remote

        argv = ["generate", "--json", "--max-tokens", str(MAX_TOKENS), "--num-blocks", "256", "--threads", "1",
                PROMPTS[0], PROMPTS[1]]
        assert main(argv) == 0
        local = capsys.readouterr().out
        args = build_parser().parse_args(argv)
        args.url, args.timeout = cluster.url, 120.0
        assert cmd_generate_remote(args) == 0
        remote = capsys.readouterr().out
        assert [json.loads(x) for x in remote.splitlines()] == [json.loads(x) for x in local.splitlines()]
        assert remote == local

        args.json = False
        assert cmd_generate_remote(args) == 0
        assert capsys.readouterr().out == "".join(json.loads(x)["text"] + "\n" for x in local.splitlines())

        chat = ["generate", "--json", "--chat", "--max-tokens", "6", "--num-blocks", "64", "--threads", "1",
                "What is 2+2?"]
        assert main(chat) == 0
        local = capsys.readouterr().out
        args = build_parser().parse_args(chat)
        args.url, args.timeout = cluster.url, 120.0
        assert cmd_generate_remote(args) == 0
        assert capsys.readouterr().out == local

    def test_killed_decode_node_leaves_rotation_and_comes_back(self, cluster, reference):
        cluster.kill("decode-1")
        with Client(cluster.url, timeout=120) as client:
            for _ in range(3):  # the first may reach the dead node: the router retries elsewhere
                done = client.complete(PROMPTS[0], GREEDY)
                assert (done.text, done.token_ids, done.finish_reason) == reference[PROMPTS[0]]
                assert done.timings.decode_node == "decode-0"
            cluster.restart("decode-1")

            def decode_1_served_one_of_two() -> bool:
                return "decode-1" in [client.complete(PROMPTS[0], GREEDY).timings.decode_node for _ in range(2)]

            wait_until(decode_1_served_one_of_two, WAIT, "the restarted decode-1 to get a request back", interval=0.01)
        assert_no_page_leak(cluster)


# ---- 2 prefill, 1 decode -------------------------------------------------------------------------


@pytest.mark.slow
class TestTwoPrefillOneDecode:
    @pytest.fixture(scope="class")
    @classmethod
    def cluster(cls, reference, tmp_path_factory):
        with running_cluster(tmp_path_factory, "p2d1", prefill=2, decode=1, **SMALL) as cluster:
            yield cluster

    def test_greedy_outputs_equal_the_single_process_engine(self, cluster, reference):
        check_greedy(cluster.url, reference)
        check_concurrent_streams(cluster.url, 8, reference)
        assert_no_page_leak(cluster)


# ---- colocated -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_colocated_cluster_gives_the_same_outputs(reference, tmp_path):
    with Cluster(colocated=1, log_dir=str(tmp_path), **SMALL) as cluster:
        assert check_greedy(cluster.url, reference)
        with Client(cluster.url, timeout=30) as client:
            assert client.list_models()[0].max_context_length > 0
        assert_no_page_leak(cluster)
        statuses = cluster.stop()
    assert statuses == {"colocated-0": 0, "router": 0}, statuses
