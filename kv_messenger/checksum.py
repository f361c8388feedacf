"""Page-shard checksums (S7): CRC32C of exactly the byte runs a transfer writes.

The sender hashes the runs it posts (source offsets in its registered KV region, one value per
entry of `ShardPlan.layer_writes`); the receiver hashes the runs that landed (destination offsets
in its region) and compares. A run is hashed on its own, from 0, so either side can hash its runs
in any order and grouping.

- `crc32c(data, crc=0)`: one buffer (zlib.crc32's calling convention, Castagnoli polynomial).
- `crc32c_runs(buf, offsets, lengths)`: one uint32 per run of a buffer-protocol object
  (numpy array, memoryview, bytes; a CPU torch tensor via `.numpy()`).
- `crc32c_runs_at(address, size, offsets, lengths)`: the same over raw memory [address, address +
  size), e.g. a registered region (`MemoryRegion` address and length).
- `crc32c_reference(data, crc=0)`: the same function in plain Python, bit by bit (tests only: slow).

A transfer's checksums on the wire (PrefillResponse.kv_checksums, S7): one uint32 per run in the
canonical order of the transfer's shard plan (`ShardPlan.entries`: layer 0 .. L-1; in each, run by
run of the plan; in each run K then V; in each, the ticket's pages in token order) -- then the
context record. Between TP 1 nodes a page is one run and `kv_runs(layout, pages)` gives those runs'
byte offsets in a node's KV region; `pack` / `unpack` the little-endian bytes, `first_mismatch`
names the first bad run.

The C code (csrc/checksum.c, built by _checksum_build.py into kv_messenger._checksum) uses the
SSE4.2 crc32 instruction when the CPU has it and a slicing-by-8 table otherwise (`impl` forces one:
"auto", "hw", "table"); speeds in bench/results/fabric/checksum.md. Every run is checked to lie inside the
buffer before any byte is read. The C call holds no lock and does not block; cffi releases the GIL
around it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

try:
    from kv_messenger import _checksum

    ffi = _checksum.ffi
    lib = _checksum.lib
    IMPORT_ERROR: str | None = None
except ImportError as exc:
    ffi = None
    lib = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    logger.info("kv_messenger._checksum unavailable (%s): build it with `python kv_messenger/_checksum_build.py` "
                "or `pip install -e .`", IMPORT_ERROR)

CRC32C_POLY = 0x82F63B78   # reflected Castagnoli polynomial
_IMPLS = {"auto": 0, "hw": 1, "table": 2, "hw_serial": 3}   # hw_serial: one crc32 chain (benchmark)
_init_lock = threading.Lock()
_hw: bool | None = None


def available() -> bool:
    """True when the compiled module imported."""
    return lib is not None


def unavailable_reason() -> str | None:
    return IMPORT_ERROR


def _lib():
    global _hw
    if lib is None:
        raise RuntimeError(f"the checksum extension kv_messenger._checksum is not built: {IMPORT_ERROR}")
    if _hw is None:
        with _init_lock:
            if _hw is None:
                _hw = bool(lib.pd_crc32c_init())
    return lib


def hardware() -> bool:
    """Whether this CPU runs the SSE4.2 path."""
    _lib()
    return bool(_hw)


def _impl(impl: str) -> int:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {sorted(_IMPLS)}, got {impl!r}")
    if impl in ("hw", "hw_serial") and not hardware():
        raise ValueError(f"impl={impl!r} asked for, but this CPU has no SSE4.2 crc32 instruction")
    return _IMPLS[impl]


def crc32c(data, crc: int = 0, *, impl: str = "auto") -> int:
    """CRC32C of a buffer-protocol object (C-contiguous), continuing from `crc`."""
    lb = _lib()
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"crc must be a 32-bit value, got {crc}")
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    buf = ffi.from_buffer("uint8_t[]", mv)
    return int(lb.pd_crc32c(crc, buf, mv.nbytes, _impl(impl)))


def _runs(size: int, offsets, lengths) -> tuple[np.ndarray, np.ndarray]:
    off = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
    ln = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    if off.shape != ln.shape:
        raise ValueError(f"{off.size} offsets for {ln.size} lengths")
    bad = np.flatnonzero((off < 0) | (ln < 0) | (off + ln > size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"run {i} [{int(off[i])}, {int(off[i]) + int(ln[i])}) lies outside the buffer of {size} "
                         f"bytes ({bad.size} such runs)")
    return off.astype(np.uint64), ln.astype(np.uint64)


def _hash_runs(base, size: int, offsets, lengths, impl: str) -> np.ndarray:
    lb = _lib()
    code = _impl(impl)
    off, ln = _runs(size, offsets, lengths)
    out = np.empty(off.size, dtype=np.uint32)   # [runs]
    if off.size:
        lb.pd_crc32c_runs(base, ffi.from_buffer("uint64_t[]", off), ffi.from_buffer("uint64_t[]", ln), off.size,
                          ffi.from_buffer("uint32_t[]", out), code)
    return out


def crc32c_runs(buf, offsets, lengths, *, impl: str = "auto") -> np.ndarray:
    """[len(offsets)] uint32: CRC32C of buf[offsets[i] : offsets[i] + lengths[i]] (byte offsets) for each i."""
    _lib()
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("crc32c_runs needs a C-contiguous buffer")
    return _hash_runs(ffi.from_buffer("uint8_t[]", mv), mv.nbytes, offsets, lengths, impl)


def crc32c_runs_at(address: int, size: int, offsets, lengths, *, impl: str = "auto") -> np.ndarray:
    """`crc32c_runs` over raw memory [address, address + size) the caller keeps alive (a registered region)."""
    _lib()
    if address <= 0 or size < 0:
        raise ValueError(f"bad memory range: address {address:#x}, size {size}")
    return _hash_runs(ffi.cast("const uint8_t *", address), size, offsets, lengths, impl)


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC32C bit by bit in Python: the definition the C code is tested against (slow: tests only)."""
    s = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        s ^= byte
        for _ in range(8):
            s = (s >> 1) ^ CRC32C_POLY if s & 1 else s >> 1
    return s ^ 0xFFFFFFFF


# --- a transfer's checksums (S7) ----------------------------------------------------------------

SIDES = ("K", "V")


def kv_runs(layout, pages) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets and lengths ([num_layers * 2 * len(pages)] uint64 each) of every KV run a
    transfer between two TP 1 nodes writes into `pages` (page ids, token order), in the canonical
    order (layer, K/V, page) of a one-run plan (`ShardPlan.entries`), in a region laid out as
    `layout` (a KvLayout). Under tensor parallelism the plan's own `entries` give the runs."""
    ids = np.asarray(pages, dtype=np.int64).reshape(-1)
    out = np.empty((layout.num_layers, 2, ids.size), dtype=np.uint64)   # [layer, side, page]
    for layer in range(layout.num_layers):
        out[layer, 0], out[layer, 1] = layout.page_offsets(layer, ids)
    return out.reshape(-1), np.full(out.size, layout.page_nbytes, dtype=np.uint64)


def pack(values) -> bytes:
    """uint32 values as the little-endian bytes of PrefillResponse.kv_checksums."""
    return np.ascontiguousarray(values, dtype="<u4").tobytes()


def unpack(raw: bytes, count: int) -> np.ndarray:
    """[count] uint32 from PrefillResponse.kv_checksums; ValueError if the sizes disagree."""
    if len(raw) != 4 * count:
        raise ValueError(f"kv_checksums holds {len(raw)} bytes, {count} values need {4 * count}")
    return np.frombuffer(raw, dtype="<u4").astype(np.uint32)


@dataclass(frozen=True)
class Mismatch:
    """The first run whose checksum differs, and how many differ."""

    run: int             # index in the canonical order
    what: str            # "layer 3 page 5 (id 812) V" (ShardPlan.describe_entry) or "context record"
    expected: int        # the sender's value
    actual: int          # ours
    bad_runs: int        # how many runs differ in all

    def describe(self) -> str:
        return (f"{self.bad_runs} run(s) differ, first run {self.run}: {self.what}: sender crc32c "
                f"{self.expected:#010x}, landed {self.actual:#010x}")


def first_mismatch(expected: np.ndarray, actual: np.ndarray, describe: Callable[[int], str]) -> Mismatch | None:
    """Compare a transfer's checksums (canonical order, context last); None when they agree.
    `describe(i)` names KV run i (`ShardPlan.describe_entry`)."""
    if expected.shape != actual.shape:
        raise ValueError(f"{expected.size} checksums from the sender, {actual.size} runs here")
    bad = np.flatnonzero(expected != actual)
    if not bad.size:
        return None
    i = int(bad[0])
    what = "context record" if i == expected.size - 1 else describe(i)
    return Mismatch(i, what, int(expected[i]), int(actual[i]), int(bad.size))
