"""What only the UCX backend (fabric.ucx, issue 32) has to show: it is selected like a provider,
its remote descriptors carry the packed key across processes, its tag counts follow libfabric's
immediate-data arithmetic, and disconnect cancels what is outstanding. The behaviour both
backends share runs over it in the parametrized tests (`backend` fixture: test_transfer,
test_failures, test_fabric_bad_input, test_netns)."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
from fabric_peer import PeerProcess, digest

from fabric import FabricConfig, FabricError, PageWrites, TransferEngine, open_backend
from fabric.backend import TransferBackend
from pdserve.engine.cache.hostmem import alloc_buffer

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _ucx_built() -> None:
    """Every test here needs the UCX extension: fail (never skip) without it."""
    from fabric.ucx import load_native

    try:
        load_native()
    except ImportError as exc:
        pytest.fail(f"fabric._ucx does not import ({exc}): run `python fabric/_ucx_build.py` or scripts/setup.sh")


def test_selected_like_a_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.ucx import UcxBackend

    with open_backend(FabricConfig(provider="ucx", node="127.0.0.1")) as be:
        assert isinstance(be, UcxBackend) and isinstance(be, TransferBackend)
        assert be.peer_descriptor.provider == "ucx" and be.rails[0].peer == be.peer_descriptor
        assert not be.writes_ordered and not be.closes_connections
    monkeypatch.setenv("FI_PROVIDER", "ucx")
    with open_backend(FabricConfig(node="127.0.0.1")) as be:
        assert isinstance(be, UcxBackend)
    monkeypatch.delenv("FI_PROVIDER")
    with open_backend(FabricConfig(provider="shm")) as be:
        assert isinstance(be, TransferEngine)
    # every abstract method of the seam is UcxBackend's own
    assert not TransferBackend.__abstractmethods__ - set(vars(UcxBackend))
    with pytest.raises(ValueError, match="node='10.254.254.254': no interface"):
        UcxBackend(FabricConfig(provider="ucx", node="10.254.254.254"))
    with pytest.raises(ValueError, match="UcxBackend needs provider 'ucx'"):
        UcxBackend(FabricConfig(provider="tcp;ofi_rxm"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["", "tcp"])
def test_descriptor_crosses_processes_pickled(tls: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if tls:
        monkeypatch.setenv("UCX_TLS", tls)
    config = FabricConfig(provider="ucx", node="127.0.0.1", imm_mode="every")
    peer = PeerProcess.start(config, 4 * MiB)
    engine = open_backend(config)
    try:
        desc = pickle.loads(pickle.dumps(peer.descriptor))
        assert desc.rkey and desc == peer.descriptor
        src = alloc_buffer(4 * MiB)
        src.numpy()[:] = np.random.default_rng(5).integers(0, 256, 4 * MiB, dtype=np.uint8)
        region = engine.register(src.view)
        # "every": one unit per entry, however the entries merged (3 contiguous + 2 apart = 5)
        offs = [0, 4096, 8192, 1 * MiB, 3 * MiB]
        peer.call("expect", [(9, 5), (10, 1)])
        engine.write_sync(PageWrites(region, offs, desc, offs, [4096] * 5, 9), timeout=20)
        # "last": one unit per batch; imm None: nothing counted
        engine.write_sync(PageWrites(region, [2 * MiB], desc, [2 * MiB], [65536], 10, imm_mode="last"), timeout=20)
        engine.write_sync(PageWrites(region, [0], desc, [5 * 4096], [4096], None), timeout=20)
        assert peer.call("wait_fired", ([9, 10], 10)) == {9: 1, 10: 1}
        assert peer.call("landed", [9, 10]) == {9: 0, 10: 0}
        got = peer.call("digests", [(o, 4096) for o in offs] + [(2 * MiB, 65536), (5 * 4096, 4096)])
        want = [digest(src.view, o, 4096) for o in offs] + [digest(src.view, 2 * MiB, 65536), digest(src.view, 0, 4096)]
        assert got == want
        st = engine.stats()
        assert (st.batches, st.entries, st.writes) == (3, 7, 5), st   # the three contiguous entries: one put
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(60)
def test_disconnect_cancels_every_outstanding_batch() -> None:
    config = FabricConfig(provider="ucx", node="127.0.0.1", peer_timeout_s=5.0)
    with open_backend(config) as a, open_backend(config) as b:
        src = a.register(alloc_buffer(8 * MiB).view)
        dst = b.register(alloc_buffer(8 * MiB).view)
        a.connect(b.peer_descriptor)
        lock = threading.Lock()
        outcomes: dict[int, list[str]] = {}
        everything = threading.Event()
        total = 400

        def record(i: int, what: str) -> None:
            with lock:
                outcomes.setdefault(i, []).append(what)
                if len(outcomes) == total:
                    everything.set()

        offs = np.arange(8, dtype=np.uint64) * MiB
        lens = np.full(8, MiB, dtype=np.uint64)
        for i in range(total):
            a.write(PageWrites(src, offs, dst.descriptor, offs, lens, i),
                    lambda i=i: record(i, "done"), lambda e, i=i: record(i, "error"))
        with pytest.raises(FabricError, match="in flight"):
            a.deregister(src)
        a.disconnect(b.peer_descriptor)
        assert everything.wait(10), f"{total - len(outcomes)} batches got no callback"
        assert all(len(v) == 1 for v in outcomes.values()), "a batch got two callbacks"
        assert "error" in {v[0] for v in outcomes.values()}, "disconnect cancelled nothing"
        assert a.outstanding() == 0
        with pytest.raises(FabricError, match="has failed"):
            a.write(PageWrites(src, [0], dst.descriptor, [0], [4096], 1), lambda: None, lambda e: None)
        a.connect(b.peer_descriptor)   # a fresh endpoint: writes flow again
        a.write_sync(PageWrites(src, [0], dst.descriptor, [0], [4096], None), timeout=10)
        a.deregister(src)
