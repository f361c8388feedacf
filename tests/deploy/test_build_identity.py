"""Build identity (NodeInfo.build, pdserve.serving.build_identity): the KV-layout hash changes with
each covered field and only with them, the model config hash ignores key order, the commit is read
from a checkout's files (loose ref, packed ref, detached, a worktree's gitdir file) and is '' without
one, and the decode node's PrefillPool never chooses a prefill node of another model or KV layout
(real gRPC servers on loopback answering NodeInfo), with the gauge and the log naming both."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import pathlib

import grpc
import pytest
from support.net import free_port
from support.node_stubs import InfoOnlyDecode, serve_node_services

from decode_node.prefill_pool import PrefillPool
from kv_messenger.ticket import peer_to_bytes
from pdserve.serving.build_identity import (
    COMMIT_ENV,
    BuildIdentity,
    KvLayoutKey,
    build_commit,
    commit_of_checkout,
    incompatibility,
    model_config_hash,
    node_identity,
)
from pdserve.serving.metrics import node_metrics
from pdserve_api.v1 import node_pb2, node_pb2_grpc

KEY = KvLayoutKey(num_layers=2, kv_heads=2, head_dim=16, page_size=16, dtype="float32", hidden_size=64,
                  context_top_k=32)
SHA_A, SHA_B = "a" * 40, "b" * 40


def test_the_kv_layout_hash_changes_with_each_covered_field_and_is_stable_otherwise():
    assert KEY.digest() == KvLayoutKey(**dataclasses.asdict(KEY)).digest()   # same fields, same hash
    assert len(KEY.digest()) == 16 and "page=16" in KEY.describe() and "dtype=float32" in KEY.describe()
    changed = {"num_layers": 3, "kv_heads": 4, "head_dim": 32, "page_size": 32, "dtype": "bfloat16",
               "hidden_size": 128, "context_top_k": 16, "context_version": 4, "hidden_kind": "pre_norm",
               "context_history": 128}
    assert set(changed) == {f.name for f in dataclasses.fields(KvLayoutKey)}, "every field is covered"
    digests = {KEY.digest()}
    for name, value in changed.items():
        other = dataclasses.replace(KEY, **{name: value})
        assert other.digest() != KEY.digest(), f"{name} is not covered by the hash"
        digests.add(other.digest())
    assert len(digests) == 1 + len(changed)
    for bad in ({"page_size": 0}, {"kv_heads": -1}, {"dtype": ""}, {"num_layers": True}, {"context_version": 0},
                {"hidden_kind": ""}, {"context_history": -1}):
        with pytest.raises(ValueError, match="KvLayoutKey"):
            dataclasses.replace(KEY, **bad)


def test_the_model_config_hash_ignores_key_order_and_sees_values(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d, cfg in ((a, {"hidden_size": 64, "num_hidden_layers": 2}), (b, {"num_hidden_layers": 2, "hidden_size": 64}),
                   (c, {"hidden_size": 64, "num_hidden_layers": 3})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
    assert model_config_hash(a) == model_config_hash(b) != model_config_hash(c)
    assert model_config_hash(tmp_path / "missing") == ""   # never raises


def test_the_commit_is_read_from_the_checkout_files_and_is_empty_without_one(tmp_path):
    assert commit_of_checkout(tmp_path) == ""                          # no .git anywhere above (tmp)
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / "pkg").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert commit_of_checkout(repo / "pkg") == ""                     # the branch has no commit yet
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{SHA_B} refs/heads/main\n")
    assert commit_of_checkout(repo / "pkg") == SHA_B                  # packed
    (repo / ".git" / "refs" / "heads" / "main").write_text(SHA_A + "\n")
    assert commit_of_checkout(repo / "pkg") == SHA_A                  # a loose ref wins over packed-refs
    (repo / ".git" / "HEAD").write_text(SHA_B + "\n")
    assert commit_of_checkout(repo) == SHA_B                          # detached
    wt = tmp_path / "worktree"
    (repo / ".git" / "worktrees" / "wt").mkdir(parents=True)
    (repo / ".git" / "worktrees" / "wt" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "worktrees" / "wt" / "commondir").write_text("../..\n")
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {repo / '.git' / 'worktrees' / 'wt'}\n")
    assert commit_of_checkout(wt) == SHA_A                            # a linked worktree: refs in the main .git
    (repo / ".git" / "HEAD").write_text("garbage")
    assert commit_of_checkout(repo) == ""


def test_the_commit_env_wins(monkeypatch):
    build_commit.cache_clear()
    monkeypatch.setenv(COMMIT_ENV, SHA_A)
    try:
        assert build_commit() == SHA_A
    finally:
        build_commit.cache_clear()


def _identity(tmp_path: pathlib.Path, model: str = "tiny", **layout) -> BuildIdentity:
    d = tmp_path / f"{model}-config"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model": model}))
    return node_identity(model, d, dataclasses.replace(KEY, **layout))


def test_incompatibility_names_what_differs_and_both_identities(tmp_path):
    own = _identity(tmp_path)
    assert incompatibility(own, own) == ""
    assert incompatibility(own, dataclasses.replace(own, version="9.9", commit=SHA_B)) == ""   # reported only
    page = incompatibility(own, _identity(tmp_path, page_size=32))
    assert page.startswith("KV layout differ") and "page=32" in page and "page=16" in page
    model = incompatibility(own, _identity(tmp_path, model="other"))
    assert model.startswith("model differ") and "'other'" in model and "'tiny'" in model
    config = incompatibility(own, dataclasses.replace(own, model_config_hash="0" * 16))
    assert config.startswith("model differ")
    assert incompatibility(own, BuildIdentity.from_pb(node_pb2.BuildIdentity())) == "the peer reports no build identity"
    assert BuildIdentity.from_pb(own.to_pb()) == own


class _Prefill(node_pb2_grpc.NodeServiceServicer):
    """NodeService of a prefill node with a given build (and a fabric peer, so the pool may choose it)."""

    def __init__(self, node_id: str, build: BuildIdentity, peer: bytes) -> None:
        self.node_id, self.build, self.peer = node_id, build, peer

    async def GetNodeInfo(self, request, context):
        return node_pb2.NodeInfo(node_id=self.node_id, role=node_pb2.NODE_ROLE_PREFILL, fabric_peer=self.peer,
                                 build=self.build.to_pb())


async def _serve(servicer: _Prefill) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    node_pb2_grpc.add_NodeServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    return server, address


def test_the_prefill_pool_never_chooses_a_node_of_another_kv_layout_or_model(tmp_path, caplog):
    from fabric import PeerDescriptor

    own = _identity(tmp_path)
    peer = peer_to_bytes(PeerDescriptor(provider="shm", address=b"\x01", engine_id="e" * 32, host_id="h", pid=1,
                                        start_time=1))
    gauge = node_metrics().incompatible_peers

    async def main() -> None:
        good, other_page, other_model = _Prefill("good", own, peer), _Prefill("page", _identity(tmp_path, page_size=32),
                                                                              peer), _Prefill("model", own, peer)
        other_model.build = _identity(tmp_path, model="other")
        served = [await _serve(s) for s in (good, other_page, other_model)]
        (_, a_good), (_, a_page), (_, a_model) = served
        pool = PrefillPool([a_good, a_page, a_model], identity=own)
        try:
            with caplog.at_level(logging.ERROR, logger="decode_node.prefill_pool"):
                await pool.refresh()
            assert {pool.choose(exclude=set()).address for _ in range(6)} == {a_good}
            assert pool.choose(exclude={a_good}) is None and pool.retry_in(exclude={a_good}) is None
            assert f"{a_page} (incompatible: KV layout differ" in pool.describe_down()
            assert gauge.labels(peer=a_good)._value.get() == 0
            assert gauge.labels(peer=a_page)._value.get() == gauge.labels(peer=a_model)._value.get() == 1
            skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
            assert len(skipped) == 2 and any(a_page in m and "page=32" in m and "page=16" in m for m in skipped)
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="decode_node.prefill_pool"):
                await pool.refresh()   # still skipped: logged once, not at every poll
            assert not [r for r in caplog.records if "skipped" in r.getMessage()]
            other_page.build = own   # restarted with our layout: chosen again
            await pool.refresh()
            assert gauge.labels(peer=a_page)._value.get() == 0
            assert pool.choose(exclude={a_good}).address == a_page
        finally:
            await pool.close()
            for server, _ in served:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("bad_peer", [b"not json", b'{"provider": "shm"}', json.dumps(
    {"provider": "shm", "address": "zz", "engine_id": "e", "host_id": "h", "pid": 1, "start_time": 1}).encode()])
def test_a_malformed_fabric_peer_marks_the_node_down_and_its_poll_goes_on(tmp_path, bad_peer):
    """Issue 33: an unreadable (or version-skewed) fabric_peer in a GetNodeInfo answer killed the
    refresh with an exception (the node's refresh loop died, and every later Prefill to it
    stalled). It marks the node down, the next poll still runs, and a good answer brings it back."""
    from fabric import PeerDescriptor

    own = _identity(tmp_path)
    good = peer_to_bytes(PeerDescriptor(provider="shm", address=b"\x01", engine_id="e" * 32, host_id="h", pid=1,
                                        start_time=1))

    async def main() -> None:
        node = _Prefill("skewed", own, bad_peer)
        server, address = await _serve(node)
        pool = PrefillPool([address], identity=own)
        try:
            await pool.refresh()   # raised ValueError here before
            (n,) = pool.nodes
            assert n.down_since is not None and "unusable fabric_peer" in n.down_reason
            assert n.peer is None and pool.choose(exclude=set()) is None and not pool.usable()
            node.peer = good
            await pool.refresh_node(n)
            assert n.down_since is None and n.peer is not None and pool.choose(exclude=set()).address == address
        finally:
            await pool.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_prefill_pool_never_chooses_a_node_of_another_context_record_layout(tmp_path):
    """D19: a prefill node whose context record this decode node cannot consume (another header
    version, another hidden kind, another count of history rows) is skipped like another KV layout,
    its announced layout named."""
    from fabric import PeerDescriptor

    own = _identity(tmp_path)
    assert "ctx3=v3header" in own.kv_layout and ":final_norm," in own.kv_layout and "history" not in own.kv_layout
    peer = peer_to_bytes(PeerDescriptor(provider="shm", address=b"\x01", engine_id="e" * 32, host_id="h", pid=1,
                                        start_time=1))

    async def main() -> None:
        nodes = [_Prefill("good", own, peer), _Prefill("v1", _identity(tmp_path, context_version=1), peer),
                 _Prefill("kind", _identity(tmp_path, hidden_kind="pre_norm"), peer),
                 _Prefill("hist", _identity(tmp_path, context_history=128), peer)]
        served = [await _serve(s) for s in nodes]
        a_good, a_v1, a_kind, a_hist = (a for _, a in served)
        pool = PrefillPool([a_good, a_v1, a_kind, a_hist], identity=own)
        try:
            await pool.refresh()
            assert {pool.choose(exclude=set()).address for _ in range(6)} == {a_good}
            assert pool.choose(exclude={a_good}) is None
            down = pool.describe_down()
            assert f"{a_v1} (incompatible: KV layout differ" in down and "ctx3=v1header" in down
            assert f"{a_kind} (incompatible: KV layout differ" in down and ":pre_norm," in down
            assert f"{a_hist} (incompatible: KV layout differ" in down and "history128x" in down
        finally:
            await pool.close()
            for server, _ in served:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_router_sends_nothing_to_a_decode_node_of_another_model(caplog):
    from pdserve_api.v1 import generate_pb2
    from router.config import RouterConfig
    from router.nodes import NodePool

    async def main() -> None:
        decoders = [InfoOnlyDecode("d0", "other"), InfoOnlyDecode("d1", "tiny"), InfoOnlyDecode("d2", "tiny")]
        servers = await serve_node_services(decoders)
        addresses = [a for _, a in servers]
        pool = NodePool(RouterConfig(decode_nodes=tuple(addresses), health_interval_s=60))
        request = generate_pb2.GenerateRequest(text="hello")
        try:
            with caplog.at_level(logging.WARNING, logger="router.nodes"):
                await pool.start()   # d0 is the first configured, but the others agree on another model
            assert sorted(n.address for n in pool.healthy()) == sorted(addresses[1:])
            (odd,) = [n for n in pool.nodes if not n.healthy]
            assert odd.reason == "serves model 'other'; the other decode nodes serve 'tiny'"
            assert any("out of rotation: serves model 'other'" in r.getMessage() for r in caplog.records)
            assert {pool.route(request)[0].address for _ in range(6)} == set(addresses[1:])
            await pool.poll_all()   # still out, nothing flaps
            assert not odd.healthy
            decoders[0].model = "tiny"   # restarted with the others' model: back
            await pool.poll_all()
            assert odd.healthy and len(pool.healthy()) == 3
            decoders[2].model = "new"    # two against one again, the other way
            decoders[0].model = "new"
            await pool.poll_all()
            assert sorted(n.address for n in pool.healthy()) == sorted([addresses[0], addresses[2]])
            assert not [r for r in caplog.records if "'tiny'; the other decode nodes serve 'other'" in r.getMessage()]
        finally:
            await pool.close()
            for server, _ in servers:
                await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))
