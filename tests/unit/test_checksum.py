"""Page-shard checksums (S7, kv_messenger.checksum): the C CRC32C (SSE4.2 and table paths) against
a bit-by-bit Python reference and published vectors, on random data, unaligned runs and odd lengths."""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.native import skip_unless_built

from kv_messenger import checksum

pytestmark = skip_unless_built(checksum.available(), "the checksum extension (kv_messenger._checksum)",
                               checksum.unavailable_reason())

IMPLS = ["auto", "table"] + (["hw", "hw_serial"] if checksum.available() and checksum.hardware() else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_known_vectors(impl):
    # CRC-32C check value (the "123456789" vector) and RFC 3720 B.4's iSCSI vectors.
    assert checksum.crc32c(b"123456789", impl=impl) == 0xE3069283
    assert checksum.crc32c(bytes(32), impl=impl) == 0x8A9136AA
    assert checksum.crc32c(b"\xff" * 32, impl=impl) == 0x62A8AB43
    assert checksum.crc32c(bytes(range(32)), impl=impl) == 0x46DD794E
    assert checksum.crc32c(b"", impl=impl) == 0
    assert checksum.crc32c_reference(b"123456789") == 0xE3069283


@pytest.mark.parametrize("impl", IMPLS)
def test_random_buffers_match_the_reference(impl):
    rng = random.Random(7)
    # Lengths around every path boundary: the 8-byte steps, the 3 x 256 B and 3 x 2 KiB interleaves.
    for n in [1, 7, 8, 9, 255, 767, 768, 769, 6143, 6144, 6145, 3 * 6144 + 771, 20011]:
        data = rng.randbytes(n)
        assert checksum.crc32c(data, impl=impl) == checksum.crc32c_reference(data), n
    data = rng.randbytes(5000)
    # continuation, as zlib.crc32 continues
    assert checksum.crc32c(data[1234:], checksum.crc32c(data[:1234], impl=impl), impl=impl) == \
        checksum.crc32c_reference(data)


@pytest.mark.parametrize("impl", IMPLS)
def test_runs_unaligned_and_odd(impl):
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, size=40000, dtype=np.uint8)      # [bytes]
    offsets = [0, 1, 3, 5, 4097, 12345, 39999, 100, 7]
    lengths = [0, 1, 17, 6151, 3, 20000, 1, 768, 2049]
    got = checksum.crc32c_runs(buf, offsets, lengths, impl=impl)
    assert got.dtype == np.uint32 and got.shape == (len(offsets),)
    raw = buf.tobytes()
    want = [checksum.crc32c_reference(raw[o:o + n]) for o, n in zip(offsets, lengths, strict=True)]
    assert got.tolist() == want
    # the same runs over raw memory, as the sender hashes its registered region
    at = checksum.crc32c_runs_at(buf.ctypes.data, buf.nbytes, np.array(offsets, dtype=np.uint64), lengths, impl=impl)
    assert at.tolist() == want
    assert checksum.crc32c_runs(buf, [], []).shape == (0,)


def test_hw_and_table_agree_on_page_shards():
    rng = np.random.default_rng(11)
    pool = rng.integers(0, 256, size=(4, 3, 16, 64 * 4), dtype=np.uint8)   # [pages, heads, tokens, head_dim bytes]
    hb = 16 * 64 * 4
    offsets = [p * 3 * hb + h * hb for p in range(4) for h in range(3)]
    a = checksum.crc32c_runs(pool, offsets, [hb] * 12, impl="table")
    b = checksum.crc32c_runs(pool, offsets, [hb] * 12)
    assert np.array_equal(a, b)
    flipped = pool.copy()
    flipped[2, 1, 5, 9] ^= 0x10   # one bit in page 2, head 1
    c = checksum.crc32c_runs(flipped, offsets, [hb] * 12)
    assert [i for i in range(12) if c[i] != b[i]] == [2 * 3 + 1]


def test_bad_runs_are_refused_before_reading():
    buf = bytes(100)
    with pytest.raises(ValueError, match=r"run 1 \[90, 111\) lies outside the buffer of 100 bytes"):
        checksum.crc32c_runs(buf, [0, 90], [10, 21])
    with pytest.raises(ValueError, match="run 0"):
        checksum.crc32c_runs(buf, [-1], [1])
    with pytest.raises(ValueError, match="2 offsets for 1 lengths"):
        checksum.crc32c_runs(buf, [0, 1], [1])
    with pytest.raises(ValueError, match="impl must be one of"):
        checksum.crc32c(buf, impl="fast")
    with pytest.raises(ValueError, match="C-contiguous"):
        checksum.crc32c_runs(np.zeros((4, 4), dtype=np.uint8)[:, ::2], [0], [1])


def test_transfer_checksums_canonical_order_pack_and_first_mismatch():
    import random

    from kv_messenger.plan import KvLayout
    from kv_messenger.shard_plan import KvShards, plan_transfer

    layout = KvLayout(num_layers=3, num_pages=10, kv_heads=2, page_size=4, head_dim=8, dtype="float32")
    pages = [7, 2, 5]
    off, ln = checksum.kv_runs(layout, pages)
    assert off.dtype == np.uint64 and ln.tolist() == [layout.page_nbytes] * (3 * 3 * 2)
    # (layer, K/V, page): run layer * 2 * len(pages) + side * len(pages) + i
    for layer in range(3):
        k, v = layout.page_offsets(layer, np.asarray(pages))
        for i in range(3):
            assert off[layer * 6 + i] == k[i] and off[layer * 6 + 3 + i] == v[i]
    # the same order as a TP 1 -> TP 1 shard plan's entries (one run a page)
    one = KvShards.of(layout, 1)
    plan = plan_transfer(one, one, random.Random(0))
    e = plan.entries(np.asarray(pages), np.asarray(pages))
    assert e.dst_offsets.tolist() == off.tolist() and e.lengths.tolist() == ln.tolist()

    def describe(i: int) -> str:
        return plan.describe_entry(i, pages)

    region = np.random.default_rng(0).integers(0, 256, layout.nbytes, dtype=np.uint8)
    sums = np.append(checksum.crc32c_runs(region, off, ln), np.uint32(0x1234))
    raw = checksum.pack(sums)
    assert len(raw) == 4 * sums.size and raw[-4:] == bytes([0x34, 0x12, 0, 0])   # little-endian
    back = checksum.unpack(raw, sums.size)
    assert back.dtype == np.uint32 and (back == sums).all()
    with pytest.raises(ValueError, match="kv_checksums holds 76 bytes, 20 values need 80"):
        checksum.unpack(raw, 20)
    assert checksum.first_mismatch(back, sums.copy(), describe) is None

    region[int(off[1 * 6 + 3 + 2]) + 5] ^= 1   # layer 1, V, page index 2 (id 5)
    region[int(off[2 * 6 + 0])] ^= 1           # and a later run
    actual = np.append(checksum.crc32c_runs(region, off, ln), np.uint32(0x1234))
    m = checksum.first_mismatch(sums, actual, describe)
    assert m is not None and (m.run, m.what, m.bad_runs) == (11, "layer 1 page 2 (id 5) V", 2)
    assert m.expected == int(sums[11]) and m.actual == int(actual[11]) and m.expected != m.actual
    assert "2 run(s) differ, first run 11: layer 1 page 2 (id 5) V: sender crc32c 0x" in m.describe()
    ctx = sums.copy()
    ctx[-1] ^= 1
    assert checksum.first_mismatch(sums, ctx, describe).what == "context record"
    with pytest.raises(ValueError, match="19 checksums from the sender, 18 runs here"):
        checksum.first_mismatch(sums, sums[:-1], describe)


def test_describe_entry_names_heads_and_ranks_under_tensor_parallelism():
    import random

    from kv_messenger.plan import KvLayout
    from kv_messenger.shard_plan import KvShards, plan_transfer

    layout = KvLayout(num_layers=2, num_pages=8, kv_heads=3, page_size=4, head_dim=8, dtype="float32")
    plan = plan_transfer(KvShards.of(layout, 2), KvShards.of(layout, 1), random.Random(0))
    assert len(plan.runs) == 2   # heads (0, 1) from prefill rank 0, head 2 from rank 1
    pages = [4, 1]
    e = plan.entries(np.asarray(pages), np.asarray(pages))
    assert e.lengths.size == 2 * 2 * 2 * 2   # layers x runs x (K, V) x pages
    # entry (layer 1, run 1, V, page 0) = 1 * 8 + 1 * 4 + 1 * 2 + 0
    assert plan.describe_entry(14, pages) == ("layer 1 page 0 (id 4) V, KV heads 2..2 from prefill rank 1 to "
                                              "decode rank 0")
    assert int(e.src_ranks[14]) == 1 and int(e.dst_ranks[14]) == 0
