"""Two processes on loopback: random page sets land byte for byte, tags complete once."""

from __future__ import annotations

import random
import threading
import zlib

import numpy as np
import pytest
from fabric_peer import PeerProcess, digest

from fabric import FabricConfig, FabricError, PageWrites, TransferEngine, open_backend
from pdserve.engine.cache.hostmem import alloc_buffer

POOL = 48 << 20
KiB = 1024
MiB = 1 << 20


def _sizes(rng: random.Random, budget: int) -> list[int]:
    """Page sizes from 4 KiB to 4 MiB, mostly small, summing to <= budget."""
    sizes = []
    used = 0
    while True:
        if rng.random() < 0.9:
            size = 4 * KiB * 2 ** rng.randint(0, 4)  # 4..64 KiB
        else:
            size = 4 * KiB * 2 ** rng.randint(5, 10)  # 128 KiB..4 MiB
        if rng.random() < 0.2:
            size += rng.randint(1, 4095)  # odd sizes too
        size = min(size, 4 * MiB)
        if used + size > budget:
            return sizes
        sizes.append(size)
        used += size


def _plan_round(rng: random.Random, src_len: int) -> list[list[tuple[int, int, int]]]:
    """Runs of (src_offset, dst_offset, length) covering disjoint ranges of the destination.

    About half the runs are contiguous at both ends (the engine coalesces them into fewer
    writes); the others are contiguous at the destination only, or single entries.
    """
    sizes = _sizes(rng, POOL - 64 * KiB)
    rng.shuffle(sizes)
    runs: list[list[tuple[int, int, int]]] = []
    dst = 0
    i = 0
    while i < len(sizes):
        k = min(rng.randint(1, 8), len(sizes) - i)
        both = rng.random() < 0.5
        run = []
        src = rng.randrange(0, src_len - sum(sizes[i : i + k]))
        for size in sizes[i : i + k]:
            if not both:
                src = rng.randrange(0, src_len - size)
            run.append((src, dst, size))
            src += size
            dst += size
        dst += rng.choice((0, 64))  # a gap, or the next run starts where this one ends
        runs.append(run)
        i += k
    return runs


class _Waiter:
    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.done = 0
        self.errors: list[Exception] = []
        self.cv = threading.Condition()

    def on_done(self) -> None:
        with self.cv:
            self.done += 1
            self.cv.notify_all()

    def on_error(self, err: Exception) -> None:
        with self.cv:
            self.errors.append(err)
            self.cv.notify_all()

    def wait(self, timeout: float) -> None:
        with self.cv:
            ok = self.cv.wait_for(lambda: self.done + len(self.errors) >= self.expected, timeout)
        assert not self.errors, self.errors[:3]
        assert ok, f"only {self.done} of {self.expected} batches completed"


def _run_rounds(provider: str, imm_mode: str, rounds: int, seed: int, node: str | None = "127.0.0.1") -> int:
    config = FabricConfig(provider=provider, node=node, imm_mode=imm_mode)
    peer = PeerProcess.start(config, POOL)
    engine = open_backend(config)
    try:
        src_buf = alloc_buffer(64 * MiB)
        src_np = src_buf.numpy()
        src_np[:] = np.random.default_rng(seed).integers(0, 256, src_np.size, dtype=np.uint8)
        region = engine.register(src_buf.view)
        rng = random.Random(seed)
        total_writes = 0
        for r in range(rounds):
            peer.call("zero")
            runs = _plan_round(rng, len(src_buf))
            writes = [w for run in runs for w in run]
            total_writes += len(writes)
            # several tags, each split into several batches, submitted interleaved
            tags = [(seed * 1000 + r * 16 + t) & 0xFFFFFF for t in range(4)]
            batches: list[tuple[int, list[tuple[int, int, int]]]] = []
            for t, tag in enumerate(tags):
                mine = [w for run in runs[t :: len(tags)] for w in run]
                cut = sorted(rng.sample(range(1, len(mine)), 3)) if len(mine) > 4 else []
                for part in np.split(np.arange(len(mine)), cut):
                    batches.append((tag, [mine[i] for i in part]))
            rng.shuffle(batches)
            per_tag: dict[int, int] = {tag: 0 for tag in tags}
            for tag, part in batches:
                per_tag[tag] += 1 if imm_mode == "last" else len(part)
            # half the tags are expected before the writes, half after they landed
            early = tags[:2]
            peer.call("expect", [(t, per_tag[t]) for t in early])
            waiter = _Waiter(len(batches))
            for tag, part in batches:
                s, d, n = zip(*part, strict=True)
                engine.write(PageWrites(region, s, peer.descriptor, d, n, tag), waiter.on_done, waiter.on_error)
            waiter.wait(60)
            peer.call("expect", [(t, per_tag[t]) for t in tags[2:]])
            fired = peer.call("wait_fired", (tags, 30))
            assert {t: fired.get(t) for t in tags} == {t: 1 for t in tags}, (fired, per_tag)
            assert peer.call("landed", tags) == {t: 0 for t in tags}
            got = peer.call("digests", [(d, n) for _, d, n in writes])
            view = src_buf.view
            want = [digest(view, s, n) for s, _, n in writes]
            del view
            bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            assert not bad, f"{len(bad)} of {len(writes)} writes differ, first {writes[bad[0]]}"
        # exactly once: nothing fired twice after everything settled
        fired = peer.call("fired")
        assert set(fired.values()) == {1}, fired
        # contiguous runs were posted as fewer writes, and the counts above stayed exact
        stats = engine.stats()
        assert stats.entries == total_writes and stats.writes < stats.entries, stats
        return total_writes
    finally:
        engine.close()
        peer.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("imm_mode", ["last", "every"])
def test_random_pages_land_byte_for_byte(backend: str, imm_mode: str) -> None:
    writes = _run_rounds(backend, imm_mode, rounds=4, seed=zlib.crc32(f"{backend}{imm_mode}".encode()) & 0xFFFF)
    assert writes >= 900  # several hundred entries a round, whatever the seed


@pytest.mark.timeout(60)
def test_same_process_engines_exchange_messages(backend: str) -> None:
    got: list[bytes] = []
    ev = threading.Event()

    def on_message(peer, payload: bytes) -> None:
        got.append(payload)
        ev.set()

    config = FabricConfig(provider=backend, node="127.0.0.1")
    with open_backend(config) as a, open_backend(config, on_message=on_message) as b:
        a.send(b.peer_descriptor, b"hello over the fabric")
        assert ev.wait(10)
        assert got == [b"hello over the fabric"]


@pytest.mark.rdma
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rdma_provider", ["efa", "verbs;ofi_rxm"])
def test_rdma_providers_same_code_path(rdma_provider: str) -> None:
    try:
        TransferEngine(FabricConfig(provider=rdma_provider)).close()
    except FabricError as exc:
        pytest.skip(f"no {rdma_provider} NIC here: {exc}")
    assert _run_rounds(rdma_provider, "last", rounds=2, seed=3, node=None) > 0
