"""Coalescing: runs contiguous at both ends become one write, and the receiver's counts stay exact.

With imm_mode "every" a merged write carries the number of entries it holds (fabric.imm), so
the receiver counts entries (pages) whatever was merged; "last" counts one per batch.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fabric import FabricConfig, PageWrites, TransferEngine
from pdserve.engine.cache.hostmem import alloc_buffer

KiB = 1024
MiB = 1 << 20
PAGE = 4 * KiB


class _Landing:
    """Fires once per tag; records how often."""

    def __init__(self) -> None:
        self.fired: dict[int, int] = {}
        self.cv = threading.Condition()

    def __call__(self, tag: int) -> None:
        with self.cv:
            self.fired[tag] = self.fired.get(tag, 0) + 1
            self.cv.notify_all()

    def wait(self, tag: int, timeout: float = 10.0) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: tag in self.fired, timeout)


@pytest.fixture
def engines(provider: str):
    def make(**overrides):
        config = FabricConfig(provider=provider, node="127.0.0.1", **overrides)
        a, b = TransferEngine(config), TransferEngine(config)
        made.extend((a, b))
        src_buf, dst_buf = alloc_buffer(8 * MiB), alloc_buffer(8 * MiB)
        src_buf.numpy()[:] = np.random.default_rng(1).integers(0, 256, 8 * MiB, dtype=np.uint8)
        return a, b, src_buf, dst_buf, a.register(src_buf.view), b.register(dst_buf.view)

    made: list[TransferEngine] = []
    yield make
    for engine in made:
        engine.close()


def _write(a, src, dst, s, d, n, tag, mode) -> None:
    done = threading.Event()
    errors: list[Exception] = []
    a.write(PageWrites(src, s, dst.descriptor, d, n, tag, imm_mode=mode),
            done.set, lambda e: (errors.append(e), done.set()))
    assert done.wait(10) and not errors, errors


FENCE_TAG = 0xF00D


def _fence(a, b, src, dst, landing: _Landing) -> None:
    """One more write, posted after every earlier write completed at the sender, lands behind them
    on the same connection: once it has, a surplus unit of an earlier tag would have been counted."""
    b.imm_counter.expect(FENCE_TAG, 1, landing)
    _write(a, src, dst, [0], [7 * MiB], [PAGE], FENCE_TAG, "every")
    assert landing.wait(FENCE_TAG), "the fence write never landed"


def _check_landed(src_buf, dst_buf, s, d, n) -> None:
    src, dst = src_buf.numpy(), dst_buf.numpy()
    bad = [i for i, (so, do, ln) in enumerate(zip(s, d, n, strict=True))
           if not np.array_equal(src[so : so + ln], dst[do : do + ln])]
    assert not bad, f"{len(bad)} of {len(s)} entries differ, first {bad[0]}"


@pytest.mark.timeout(60)
def test_contiguous_run_is_posted_as_few_writes_and_counted_per_page(engines) -> None:
    a, b, src_buf, dst_buf, src, dst = engines()
    landing = _Landing()
    # 600 pages contiguous at both ends, then 10 contiguous at the destination only
    s = [i * PAGE for i in range(600)] + [(700 + 10 - i) * PAGE for i in range(10)]
    d = [MiB + i * PAGE for i in range(610)]
    n = [PAGE] * 610
    b.imm_counter.expect(0xABCDE, 610, landing)
    before = a.stats()
    _write(a, src, dst, s, d, n, 0xABCDE, "every")
    after = a.stats()
    # 255 + 255 + 90 pages (a write carries at most 255 units), then 10 single pages
    assert after.writes - before.writes == 3 + 10
    assert after.entries - before.entries == 610
    assert landing.wait(0xABCDE)
    _check_landed(src_buf, dst_buf, s, d, n)
    _fence(a, b, src, dst, landing)
    assert landing.fired == {0xABCDE: 1, FENCE_TAG: 1} and b.imm_counter.landed(0xABCDE) == 0


@pytest.mark.timeout(60)
def test_max_write_bytes_bounds_merged_writes(engines) -> None:
    a, b, src_buf, dst_buf, src, dst = engines(max_write_bytes=4 * PAGE)
    landing = _Landing()
    s = [i * PAGE for i in range(37)]
    d = [2 * MiB + i * PAGE for i in range(37)]
    n = [PAGE] * 37
    b.imm_counter.expect(77, 37, landing)
    before = a.stats()
    _write(a, src, dst, s, d, n, 77, "every")
    assert a.stats().writes - before.writes == 10  # 9 writes of 4 pages and one of 1
    assert landing.wait(77)
    _check_landed(src_buf, dst_buf, s, d, n)


@pytest.mark.timeout(60)
def test_last_mode_counts_batches_and_merges_too(engines) -> None:
    a, b, src_buf, dst_buf, src, dst = engines()
    landing = _Landing()
    b.imm_counter.expect(5, 3, landing)
    before = a.stats()
    entries = []
    for k in range(3):
        s = [k * MiB + i * PAGE for i in range(64)]
        d = [4 * MiB + k * MiB + i * PAGE for i in range(64)]
        _write(a, src, dst, s, d, [PAGE] * 64, 5, "last")
        entries += zip(s, d, strict=True)
    assert a.stats().writes - before.writes == 3
    assert landing.wait(5)
    _check_landed(src_buf, dst_buf, [e[0] for e in entries], [e[1] for e in entries], [PAGE] * len(entries))
    _fence(a, b, src, dst, landing)
    assert landing.fired == {5: 1, FENCE_TAG: 1} and b.imm_counter.landed(5) == 0


@pytest.mark.timeout(60)
def test_coalescing_off_posts_one_write_per_entry(engines) -> None:
    a, b, src_buf, dst_buf, src, dst = engines(coalesce=False)
    landing = _Landing()
    s = [i * PAGE for i in range(20)]
    d = [i * PAGE for i in range(20)]
    b.imm_counter.expect(9, 20, landing)
    before = a.stats()
    _write(a, src, dst, s, d, [PAGE] * 20, 9, "every")
    assert a.stats().writes - before.writes == 20
    assert landing.wait(9)
    _check_landed(src_buf, dst_buf, s, d, [PAGE] * 20)
