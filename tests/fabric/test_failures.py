"""Failures: a peer dies mid-transfer; a receiver cancels and waits until no write can land."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
from fabric_peer import PeerProcess, digest

from fabric import FabricConfig, FabricError, PageWrites, TransferEngine, open_backend
from pdserve.engine.cache.hostmem import alloc_buffer

MiB = 1 << 20
# batches posted to the peer that is killed: ~4.8 GB, more than a fast transport (UCX over tcp
# zero-copy, ~4 GB/s here) lands while a loaded machine delays the kill
DOOMED = 600


class _Outcomes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[float] = []
        self.errors: list[tuple[float, Exception]] = []

    def on_done(self) -> None:
        with self.lock:
            self.done.append(time.monotonic())

    def on_error(self, err: Exception) -> None:
        with self.lock:
            self.errors.append((time.monotonic(), err))

    def count(self) -> int:
        with self.lock:
            return len(self.done) + len(self.errors)


@pytest.mark.timeout(60)
def test_receiver_killed_mid_transfer_fails_every_batch(backend: str) -> None:
    config = FabricConfig(provider=backend, node="127.0.0.1", peer_timeout_s=2.0, close_timeout_s=2.0)
    peer = PeerProcess.start(config, 32 * MiB)
    engine = open_backend(config)
    try:
        src = alloc_buffer(32 * MiB)
        region = engine.register(src.view)
        out = _Outcomes()
        page = 256 * 1024
        offs = np.arange(32, dtype=np.uint64) * page
        lens = np.full(32, page, dtype=np.uint64)
        batches = 600  # ~4.8 GB: far more than can land before the kill
        for i in range(batches):
            engine.write(PageWrites(region, offs, peer.descriptor, offs[::-1].copy(), lens, i),
                         out.on_done, out.on_error)
        deadline = time.monotonic() + 20
        while len(out.done) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert out.done, "no batch completed before the kill"
        killed_at = time.monotonic()
        peer.kill()
        deadline = killed_at + 10
        while out.count() < batches and time.monotonic() < deadline:
            time.sleep(0.01)
        settled_at = time.monotonic()
        assert out.count() == batches, f"{batches - out.count()} batches got neither on_done nor on_error"
        assert out.errors, "the kill produced no on_error"
        late = max(t for t, _ in out.errors) - killed_at
        assert late < 5.0, f"last on_error {late:.2f}s after the kill"
        assert all(isinstance(e, FabricError) for _, e in out.errors)
        assert settled_at - killed_at < 6.0
        # the failed peer is refused before anything is posted
        with pytest.raises(FabricError, match="failed|closed|stale"):
            engine.write(PageWrites(region, [0], peer.descriptor, [0], [4096], 1), out.on_done, out.on_error)
        # nothing is left in flight: what the dead peer held was written off with it
        assert engine.outstanding() == 0
    finally:
        t = time.monotonic()
        engine.close()
        assert time.monotonic() - t < 10
        peer.stop()


@pytest.mark.timeout(60)
def test_other_peers_keep_working_after_one_dies(backend: str) -> None:
    """A peer killed with hundreds of writes outstanding must not jam the endpoint.

    shm retires an endpoint's completions in order, so the dead peer's writes would hold back
    every later completion; the engine gives each shm peer its own transmit endpoint.
    """
    config = FabricConfig(provider=backend, node="127.0.0.1", peer_timeout_s=2.0, close_timeout_s=2.0)
    doomed = PeerProcess.start(config, 32 * MiB)
    healthy = PeerProcess.start(config, 32 * MiB)
    engine = open_backend(config)
    try:
        src = alloc_buffer(32 * MiB)
        src.numpy()[:] = np.arange(32 * MiB, dtype=np.uint64).astype(np.uint8)
        region = engine.register(src.view)
        page = 256 * 1024
        offs = np.arange(32, dtype=np.uint64) * page
        lens = np.full(32, page, dtype=np.uint64)
        first = _Outcomes()
        engine.write(PageWrites(region, [0], healthy.descriptor, [0], [4096], 1), first.on_done, first.on_error)
        doomed_out = _Outcomes()
        for i in range(DOOMED):
            engine.write(PageWrites(region, offs, doomed.descriptor, offs[::-1].copy(), lens, i),
                         doomed_out.on_done, doomed_out.on_error)
        deadline = time.monotonic() + 20
        while not doomed_out.done and time.monotonic() < deadline:
            time.sleep(0.001)
        doomed.kill()
        deadline = time.monotonic() + 10
        while doomed_out.count() < DOOMED and time.monotonic() < deadline:
            time.sleep(0.01)
        locks = getattr(engine, "shm_locks_released", None)   # libfabric's shm watchdog (not UCX)
        assert doomed_out.count() == DOOMED and doomed_out.errors, (doomed_out.count(), locks)
        # the healthy peer still gets writes and messages, byte for byte
        healthy.call("expect", [(0x77, 3 * 32)])
        out = _Outcomes()
        for _ in range(3):
            engine.write(PageWrites(region, offs, healthy.descriptor, offs, lens, 0x77, imm_mode="every"),
                         out.on_done, out.on_error)
        deadline = time.monotonic() + 10
        while out.count() < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(out.done) == 3, out.errors
        assert healthy.call("wait_fired", ([0x77], 10)).get(0x77) == 1
        got = healthy.call("digests", [(int(o), page) for o in offs])
        want = [digest(src.view, int(o), page) for o in offs]
        assert got == want
        assert engine.outstanding() == 0
        print(f"dead peer's region locks released by the watchdog: {getattr(engine, 'shm_locks_released', None)}")
    finally:
        engine.close()
        healthy.stop()
        doomed.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["kill", "close"])
def test_cancel_then_reuse_only_after_sender_gone(backend: str, how: str) -> None:
    config = FabricConfig(provider=backend, node="127.0.0.1", imm_mode="last")
    receiver = open_backend(config)
    sender = PeerProcess.start(config, 8 * MiB)
    try:
        pool = alloc_buffer(8 * MiB)
        region = receiver.register(pool.view)
        tag = 0xC0FFEE
        fired: list[int] = []
        receiver.imm_counter.expect(tag, 3, fired.append)
        sender.call("fill", 7)
        for b in range(2):  # two of the three batches the receiver waits for
            offs = [b * MiB + i * 65536 for i in range(4)]
            assert sender.call("write", (region.descriptor, offs, offs, [65536] * 4, tag)) == "done"
        deadline = time.monotonic() + 10
        while receiver.imm_counter.landed(tag) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert receiver.imm_counter.landed(tag) == 2 and not fired
        assert receiver.imm_counter.cancel(tag) == 2
        # the sender is alive: its writes could still land, so not safe yet
        assert receiver.wait_peer_gone(sender.peer, timeout=0.5) is False
        # a late write for the cancelled tag does not count
        offs = [3 * MiB]
        assert sender.call("write", (region.descriptor, offs, offs, [65536], tag)) == "done"
        deadline = time.monotonic() + 5
        while receiver.imm_counter.dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert receiver.imm_counter.dropped == 1 and receiver.imm_counter.landed(tag) == 0
        if how == "kill":
            sender.kill()
        else:
            sender.call("close_engine")
        t = time.monotonic()
        assert receiver.wait_peer_gone(sender.peer, timeout=5.0) is True
        assert time.monotonic() - t < 5.0
        pool[:] = bytes(len(pool))  # reuse is safe now
        assert not fired
    finally:
        receiver.close()
        sender.stop()


@pytest.mark.timeout(60)
def test_probe_detects_remote_endpoint_gone_across_hosts() -> None:
    """Peers on another host cannot be judged by pid: a failed probe proves it."""
    config = FabricConfig(provider="tcp;ofi_rxm", node="127.0.0.1", peer_timeout_s=2.0)
    receiver = TransferEngine(config)
    sender = PeerProcess.start(config, MiB)
    try:
        remote = dataclasses.replace(sender.peer, host_id="another-host")
        assert receiver.wait_peer_gone(remote, timeout=0.5) is False  # it answers probes
        sender.kill()
        assert receiver.wait_peer_gone(remote, timeout=8.0) is True
    finally:
        receiver.close()
        sender.stop()
