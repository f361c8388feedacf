"""Host memory the engine owns: anonymous mappings on transparent huge pages.

The engine's CPU KV pool (kv_cache._default_allocate) and the KV messenger's context staging
buffers come from here; the transport (fabric) only registers memory it is handed
(``TransferEngine.register(buf.view)``, or a tensor's ``data_ptr()`` / ``nbytes``) and never
allocates it.

Huge pages matter to the transports that copy through the kernel (shm moves
data with process_vm_writev, tcp with socket copies): with 2 MiB pages the
kernel pins and walks 512x fewer pages per byte, which raises shm bandwidth
on large writes (huge vs normal pages: bench/results/fabric/fabric.md).

``alloc_buffer`` maps anonymous memory, trims it to a 2 MiB aligned window,
advises MADV_HUGEPAGE and optionally faults it in. When the kernel refuses
(THP disabled, no madvise support), it falls back to normal pages and says
why, once, in the log and in ``HostBuffer.reason``. ``alloc_tensor`` returns
a torch tensor over such a buffer (for a KV cache pool).

Only the Python standard library is needed (numpy and torch are imported by
the methods that return arrays or tensors).
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 1024 * 1024
PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux 5.14; not exported by Python's mmap module
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "unavailable"."""
    try:
        with open(_THP_ENABLED, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


class HostBuffer:
    """Writable, page-aligned anonymous memory, 2 MiB aligned when huge.

    ``view`` is a writable memoryview of exactly ``nbytes`` bytes (buffer
    protocol: ``np.frombuffer(buf.view)``, ``torch.frombuffer(buf.view)``);
    the buffer itself also supports ``len``, slicing and slice assignment. A
    transport registers ``view`` (``TransferEngine.register(buf.view)``). The
    mapping lives as long as the buffer or any view, array or tensor made from it.

    huge_pages: MADV_HUGEPAGE was applied to a 2 MiB aligned window (the
        kernel may still back parts with small pages: see huge_page_bytes).
    reason: why huge pages were not requested or applied ("" when they were).
    """

    def __init__(self, nbytes: int, huge_pages: bool = True, populate: bool = False) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"nbytes={nbytes!r}: expected a positive int")
        self.nbytes = nbytes
        self.huge_pages = False
        self.reason = "" if huge_pages else "not requested"
        if huge_pages:
            mode = thp_mode()
            if mode in ("never", "unavailable"):
                self.reason = f"transparent huge pages are {mode} on this kernel"
                huge_pages = False
        align = HUGE_PAGE_BYTES if huge_pages else PAGE_BYTES
        size = _round_up(nbytes, align)
        # over-map by one alignment unit and use the aligned window inside it;
        # the unused head and tail are never touched, so they cost no memory
        self._map = mmap.mmap(-1, size + (align if align > PAGE_BYTES else 0),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = memoryview(self._map)
        base = _address_of(whole)
        self._offset = (-base) % align
        self.address = base + self._offset
        self.view = whole[self._offset : self._offset + nbytes]
        whole.release()
        self._span = size
        if huge_pages:
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self._offset, size)
                self.huge_pages = True
            except (OSError, AttributeError) as exc:  # AttributeError: no MADV_HUGEPAGE on this build
                self.reason = f"madvise(MADV_HUGEPAGE) refused: {exc}"
        if self.reason and self.reason != "not requested":
            _log_fallback_once(self.reason)
        if populate:
            self.populate()

    def populate(self) -> None:
        """Fault every page in now (MADV_POPULATE_WRITE, else one write per page)."""
        try:
            self._map.madvise(MADV_POPULATE_WRITE, self._offset, self._span)
            return
        except OSError:
            pass  # kernel older than 5.14: touch the pages ourselves
        import numpy as np

        arr = np.frombuffer(self.view, dtype=np.uint8)
        arr[::PAGE_BYTES] = arr[::PAGE_BYTES]

    def huge_page_bytes(self) -> int:
        """Bytes of this buffer the kernel currently backs with huge pages (from /proc/self/smaps)."""
        return min(self._span, anon_huge_bytes(self.address, self.address + self._span))

    def numpy(self, dtype: Any = "uint8") -> Any:
        """A 1-D numpy array over the whole buffer."""
        import numpy as np

        return np.frombuffer(self.view, dtype=dtype)

    def torch(self, dtype: Any, shape: tuple[int, ...] | None = None) -> Any:
        """A torch tensor over the buffer (shape: reshape of the flat tensor, must fit exactly)."""
        import torch

        flat = torch.frombuffer(self.view, dtype=dtype)
        return flat if shape is None else flat.view(shape)

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: Any) -> Any:
        return self.view[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.view[key] = value

    def __repr__(self) -> str:
        huge = "huge pages" if self.huge_pages else f"small pages ({self.reason})"
        return f"HostBuffer({self.nbytes} bytes at 0x{self.address:x}, {huge})"


def alloc_buffer(nbytes: int, huge_pages: bool = True, populate: bool = False) -> HostBuffer:
    """Anonymous memory for registration, on transparent huge pages where allowed.

    populate: fault every page in now (commits the memory; avoids page faults
    during the first transfers). Falls back to normal pages with a logged
    reason when the kernel does not allow huge pages.
    """
    return HostBuffer(nbytes, huge_pages=huge_pages, populate=populate)


def alloc_tensor(shape: tuple[int, ...], dtype: Any, huge_pages: bool = True, populate: bool = False) -> Any:
    """A zero-filled CPU torch tensor of ``shape``/``dtype`` on huge pages where allowed.

    The tensor owns its mapping (it is freed with the tensor), so a KV cache
    can allocate its pool with it and register ``(data_ptr(), nbytes)``.
    Anonymous memory reads as zeros until written: nothing is committed
    unless ``populate``.
    """
    import torch

    numel = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"shape={shape!r}: expected non-negative ints")
        numel *= d
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    buf = HostBuffer(numel * elem, huge_pages=huge_pages, populate=populate)
    return buf.torch(dtype, tuple(shape))


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _address_of(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_logged: set[str] = set()


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("registered memory falls back to normal pages: %s", reason)


def anon_huge_bytes(start: int, end: int) -> int:
    """Sum of AnonHugePages over the mappings of this process that overlap [start, end) (0 when
    /proc/self/smaps cannot be read). For any range, not only HostBuffers (tests check KV pools)."""
    return _smaps_sum(start, end, "AnonHugePages:")


def resident_bytes(start: int, end: int) -> int:
    """Sum of Rss (memory faulted in) over the mappings of this process that overlap [start, end)
    (0 when /proc/self/smaps cannot be read)."""
    return _smaps_sum(start, end, "Rss:")


def _smaps_sum(start: int, end: int, field: str) -> int:
    total = 0
    inside = False
    try:
        with open(f"/proc/{os.getpid()}/smaps", encoding="ascii", errors="replace") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and hi > start
                elif inside and head == field:
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total
