"""write_pages_sync: the caller-polled path lands the same bytes, counts, and failures as write_pages."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from fabric_peer import PeerProcess, digest
from support.wait import wait_until

from fabric import FabricConfig, FabricError, PageWrites, TransferEngine
from fabric.backend import SyncResult
from pdserve.engine.cache.hostmem import alloc_buffer

KiB = 1024
MiB = 1 << 20
POOL = 16 * MiB


def _filled(engine: TransferEngine, nbytes: int, seed: int):
    buf = alloc_buffer(nbytes)
    buf.numpy()[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf, engine.register(buf.view)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spin_us", [0, 200])
def test_sync_writes_land_and_count(provider: str, spin_us: int) -> None:
    """Lone writes and batches larger than the inline post (several rounds): bytes and tags exact.

    spin_us=0 takes the sleeping path at once (the progress thread finishes the batch), 200 the
    caller-polled one; both must give the same result."""
    config = FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every")
    peer = PeerProcess.start(config, POOL)
    engine = TransferEngine(config)
    try:
        buf, region = _filled(engine, POOL, seed=spin_us + 1)
        rng = np.random.default_rng(7)
        expected: dict[int, int] = {}
        writes = []
        dst_next = 0
        for i in range(40):
            k = int(rng.integers(1, 12))  # up to 11 entries: beyond the 4 posted inline
            sizes = rng.choice([4 * KiB, 16 * KiB, 64 * KiB, 100_000], size=k)
            src = rng.integers(0, POOL - 100_000, size=k).astype(np.uint64)
            dst = np.cumsum(np.concatenate(([dst_next], sizes[:-1] + 64))).astype(np.uint64)
            dst_next = int(dst[-1] + sizes[-1] + 64)
            tag = 1000 + i % 5
            res = engine.write_sync(PageWrites(region, src, peer.descriptor, dst, sizes.astype(np.uint64), tag),
                                    spin_us=spin_us, timeout=30)
            assert isinstance(res, SyncResult) and res.writes == k
            expected[tag] = expected.get(tag, 0) + k
            writes += list(zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True))
        assert dst_next <= POOL
        peer.call("expect", list(expected.items()))
        fired = peer.call("wait_fired", (list(expected), 30))
        assert {t: fired.get(t) for t in expected} == {t: 1 for t in expected}
        got = peer.call("digests", [(d, n) for _, d, n in writes])
        view = buf.view
        want = [digest(view, s, n) for s, _, n in writes]
        del view
        assert got == want
        assert region.inflight == 0
        assert engine.outstanding() == 0
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(120)
def test_sync_and_async_interleaved(provider: str) -> None:
    """Completions of async batches that a sync caller polls reach their callbacks exactly once,
    and messages arriving meanwhile are still delivered."""
    config = FabricConfig(provider=provider, node="127.0.0.1", imm_mode="every")
    peer = PeerProcess.start(config, POOL)
    got_msgs: list[bytes] = []
    engine = TransferEngine(config, on_message=lambda _peer, data: got_msgs.append(data))
    try:
        buf, region = _filled(engine, POOL, seed=3)
        half = POOL // 2
        done_lock = threading.Lock()
        done: list[int] = []
        errors: list[Exception] = []
        stop = threading.Event()
        sync_done = [0]
        async_posted = [0]

        def on_done(i: int) -> None:
            with done_lock:
                done.append(i)

        def async_writer() -> None:
            i = 0
            while not stop.is_set() or i < 300:  # overlaps the sync writer's whole run
                off = (i % 64) * 64 * KiB
                engine.write(PageWrites(region, [off], peer.descriptor, [off], [64 * KiB], 77),
                             lambda i=i: on_done(i), errors.append)
                i += 1
                if i % 32 == 0:
                    time.sleep(0.001)  # keep a few in flight, not thousands
            async_posted[0] = i

        def sync_writer() -> None:
            i = 0
            while not stop.is_set() or i < 200:
                off = half + (i % 64) * 64 * KiB
                engine.write_sync(PageWrites(region, [off], peer.descriptor, [off], [64 * KiB], 78), timeout=30)
                i += 1
            sync_done[0] = i

        writers = [threading.Thread(target=async_writer), threading.Thread(target=sync_writer)]
        for t in writers:
            t.start()
        # messages from the peer arrive while the sync thread polls our CQ
        payloads = [b"msg-%d" % i for i in range(20)]
        peer.call("send", (engine.peer_descriptor, payloads))
        deadline = time.monotonic() + 30
        while len(got_msgs) < len(payloads) and time.monotonic() < deadline:
            time.sleep(0.005)
        stop.set()
        for t in writers:
            t.join(60)
        assert not any(t.is_alive() for t in writers)
        assert got_msgs == payloads
        n_async = async_posted[0]
        while len(done) + len(errors) < n_async and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not errors, errors[:3]
        assert sorted(done) == list(range(n_async))
        peer.call("expect", [(77, n_async), (78, sync_done[0])])
        fired = peer.call("wait_fired", ([77, 78], 30))
        assert fired.get(77) == 1 and fired.get(78) == 1
        assert engine.outstanding() == 0 and region.inflight == 0
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(60)
def test_sync_validation_before_posting(provider: str) -> None:
    config = FabricConfig(provider=provider, node="127.0.0.1")
    peer = PeerProcess.start(config, POOL)
    engine = TransferEngine(config)
    try:
        _, region = _filled(engine, MiB, seed=1)
        with pytest.raises(ValueError, match="exceeds"):
            engine.write_sync(PageWrites(region, [0], peer.descriptor, [POOL - 10], [4096], 1))
        with pytest.raises(ValueError, match="spin_us"):
            engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [4096], 1), spin_us=-1)
        with pytest.raises(ValueError, match="timeout"):
            engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [4096], 1), timeout=-1.0)
        # from a callback (the progress thread) it could wait for itself: refused
        refused: list[Exception] = []
        done = threading.Event()

        def on_done() -> None:
            try:
                engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [4096], 1))
            except RuntimeError as exc:
                refused.append(exc)
            done.set()

        engine.write(PageWrites(region, [0], peer.descriptor, [0], [4096], 1), on_done, refused.append)
        assert done.wait(30)
        assert len(refused) == 1 and isinstance(refused[0], RuntimeError), refused
        assert engine.stats().batches == 1
        assert region.inflight == 0
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(60)
def _state(pid: int) -> str:
    """"T" once every thread of PID is stopped (/proc/PID/task/*/stat), else the first other state
    letter: SIGSTOP stops each thread as it is next interrupted, the polling one included."""
    states = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as f:
            states.add(f.read().rsplit(")", 1)[1].split()[0])
    return "T" if states <= {"T", "t"} else min(states - {"T", "t"})


def test_sync_timeout_detaches_then_completes() -> None:
    """shm moves data only while the target polls: a stopped target keeps the write in flight.
    The call times out, the batch stays in flight (region busy), and completes once the target
    runs again."""
    config = FabricConfig(provider="shm", peer_timeout_s=0)
    peer = PeerProcess.start(config, POOL)
    engine = TransferEngine(config)
    try:
        _, region = _filled(engine, MiB, seed=2)
        engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [64 * KiB], 5), timeout=30)  # connected
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            # the signal takes effect when the target is next scheduled: on a loaded machine the
            # write below could otherwise be served by a target that is still running
            wait_until(lambda: _state(peer.pid) == "T", 10, "the peer to be stopped")
            with pytest.raises(FabricError, match="still in flight") as exc:
                engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [256 * KiB], 5), timeout=0.3)
            assert exc.value.code == 110  # FI_ETIMEDOUT
            assert region.inflight == 1
            with pytest.raises(FabricError, match="in flight"):
                engine.deregister(region)
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while region.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert region.inflight == 0
        engine.deregister(region)
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(60)
def test_sync_fails_when_receiver_dies(provider: str) -> None:
    config = FabricConfig(provider=provider, node="127.0.0.1", peer_timeout_s=2.0, close_timeout_s=2.0)
    peer = PeerProcess.start(config, POOL)
    engine = TransferEngine(config)
    try:
        _, region = _filled(engine, POOL, seed=4)
        engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [4096], 9), timeout=30)
        peer.kill()
        offs = np.arange(16, dtype=np.uint64) * MiB
        lens = np.full(16, MiB, dtype=np.uint64)
        with pytest.raises(FabricError):
            for _ in range(200):  # the first writes may still land in socket buffers (tcp)
                engine.write_sync(PageWrites(region, offs, peer.descriptor, offs, lens, 9), timeout=20)
        assert region.inflight == 0
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(60)
def test_close_releases_a_blocked_sync_caller() -> None:
    """close() from another thread fails a sync write waiting on a stopped target; no hang, no crash."""
    config = FabricConfig(provider="shm", peer_timeout_s=0, close_timeout_s=0.5)
    peer = PeerProcess.start(config, POOL)
    engine = TransferEngine(config)
    outcome: list[object] = []
    try:
        _, region = _filled(engine, MiB, seed=5)
        engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [4096], 5), timeout=30)
        os.kill(peer.pid, signal.SIGSTOP)
        wait_until(lambda: _state(peer.pid) == "T", 10, "the peer to be stopped")   # see above

        def blocked() -> None:
            try:
                outcome.append(engine.write_sync(PageWrites(region, [0], peer.descriptor, [0], [512 * KiB], 5)))
            except FabricError as exc:
                outcome.append(exc)

        t = threading.Thread(target=blocked)
        t.start()
        time.sleep(0.3)
        engine.close()
        t.join(10)
        assert not t.is_alive(), "the sync caller is still blocked after close()"
        assert len(outcome) == 1 and isinstance(outcome[0], FabricError), outcome
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        engine.close()
        peer.stop()
