"""The context handed from prefill to decode (D12, D17, D19): the target's hidden state of the last
prefilled position and the top-k of its next-token distribution, and optionally the hidden states
of the positions before it (a draft head's history, E20), in a fixed-size slot, as a versioned
record that names its transfer and carries a checksum.

slot (little-endian; record version 3, "ctx3" in NodeInfo.build's KV layout):

    header  HEADER_NBYTES = 64 bytes (HEADER):
        magic b"PDCX" | version u16 | header_nbytes u16 | hidden_size u32 | top_k u32 |
        hidden_dtype u8 | hidden_kind u8 | history u16 | identity 16 bytes | attempt u32 |
        imm_tag u32 | position u32 | body_nbytes u32 | checksum u32 | 8 bytes zero
    body    [hidden_size float32 hidden][top_k int32 token ids][top_k float32 logprobs]
            [history_rows x hidden_size float32: the hidden states of positions position - history
             .. position - 1 in its first `history` rows, zeros after]

- history_rows: the slot's capacity for earlier rows, a layout constant both sides configure (0:
  none, the version 2 body); history: how many this record holds (fewer for a short prompt).
  A decode node whose engine drafts with a head (spec_decode.proposers.eagle.EagleDrafts) writes the head's rows
  for those positions from them, so its first drafts attend over the end of the prompt as they
  would on a colocated node.

- hidden_dtype: HIDDEN_DTYPES (1 = float32: the body always holds float32); hidden_kind: which
  state of the target it is, HIDDEN_KINDS (1 = "final_norm": the output of the target's final
  norm, what the runner's ModelOutput.hidden holds and the head (pdserve/model/eagle_head.py) drafts from).
- identity: blake2b-128 of (request id, the decode node's fabric engine id) -- the transfer's
  TransferKey without the attempt, which travels beside it with the imm tag (D20).
- position: the prompt position the hidden state is of: num_prefill_tokens - 1 (the prefill
  excludes the last prompt token, D17), i.e. prompt tokens - 2.
- checksum: zlib.crc32 of the header (checksum field excluded) and the body.

The prefill side encodes from its ticket (`encode_into`); the decode side decodes AND checks
(`decode`) against what it expects (`ExpectedRecord`: its own layout, the attempt's identity and
position); any difference raises ContextRecordError naming the field and both values. Order of the
checks: magic, version (another version's fields may sit elsewhere), checksum (a flipped byte
anywhere past them), then the layout fields, then identity, attempt, imm tag and position.

The sender's staging slots are a bounded pool (`SlotPool`): a prefill that finds it full fails on
its own with StagingFullError (RESOURCE_EXHAUSTED), never the engine step that finished it (S8).
Nothing here blocks.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np
import torch

from fabric import MemoryRegion
from pdserve.engine.cache.hostmem import HostBuffer, alloc_buffer
from pdserve_api.servers import StatusError

if TYPE_CHECKING:  # the engine class needs the compiled extension; this module does not
    from fabric import TransferEngine

MAGIC = b"PDCX"
RECORD_VERSION = 3                 # pdserve.serving.build_identity.CONTEXT_RECORD_VERSION states it
HIDDEN_KIND = "final_norm"         # the only kind written today (build_identity.HIDDEN_KIND states it)
HIDDEN_DTYPES = {"float32": 1}     # name -> code in the header
HIDDEN_KINDS = {"final_norm": 1}   # name -> code in the header
# magic, version, header_nbytes, hidden_size, top_k, hidden_dtype, hidden_kind, history, identity,
# attempt, imm_tag, position, body_nbytes, checksum, 8 pad bytes
HEADER = struct.Struct("<4sHHIIBBH16sIIIII8x")
HEADER_NBYTES = HEADER.size        # 64
_ID_AT = 20                        # byte offset of the identity field in the header
_CRC_AT = HEADER_NBYTES - 12       # byte offset of the checksum field in the header
assert HEADER_NBYTES == 64 and _CRC_AT == 52 and struct.calcsize("<4sHHIIBBH") == _ID_AT


@dataclass(frozen=True)
class Context:
    hidden: torch.Tensor          # [hidden_size] float32, of the record's position
    top_ids: torch.Tensor         # [k] int32
    top_logprobs: torch.Tensor    # [k] float32
    history: torch.Tensor | None = None  # [n, hidden_size] float32, positions position - n .. position - 1


@dataclass(frozen=True)
class TransferIdentity:
    """Which transfer a record belongs to (D20): the request, the decode node's fabric engine,
    the attempt and its imm tag."""

    request_id: str
    decode_engine_id: str
    attempt: int
    imm_tag: int

    def __post_init__(self) -> None:
        for name in ("attempt", "imm_tag"):
            if not 0 <= getattr(self, name) < 1 << 32:
                raise ValueError(f"request {self.request_id}: {name}={getattr(self, name)} outside 0..2**32-1")

    def digest(self) -> bytes:
        """16 bytes naming (request id, decode engine id); length-prefixed, so no two pairs collide."""
        rid, eng = self.request_id.encode(), self.decode_engine_id.encode()
        return hashlib.blake2b(len(rid).to_bytes(4, "little") + rid + eng, digest_size=16).digest()


@dataclass(frozen=True)
class ExpectedRecord:
    """What the decode side expects of one attempt's record (its layout is the codec's)."""

    identity: TransferIdentity
    position: int                 # num_prefill_tokens - 1


@dataclass(frozen=True)
class RecordHeader:
    """A record's header as it landed (nothing checked)."""

    magic: bytes
    version: int
    header_nbytes: int
    hidden_size: int
    top_k: int
    hidden_dtype: int
    hidden_kind: int
    history: int
    identity: bytes
    attempt: int
    imm_tag: int
    position: int
    body_nbytes: int
    checksum: int


MAX_HISTORY_ROWS = 4096            # a slot's capacity for earlier rows (the header counts them in a u16)


def _history_capacity(h: RecordHeader) -> object:
    """The history capacity a record's header implies (its body's size past the v2 body)."""
    extra = h.body_nbytes - h.hidden_size * 4 - h.top_k * 8
    if h.hidden_size < 1 or extra < 0 or extra % (h.hidden_size * 4):
        return f"none that fits (body of {h.body_nbytes} bytes)"
    return extra // (h.hidden_size * 4)


class ContextRecordError(ValueError):
    """A context record that is not the one expected: `field` names what differs, `expected` and
    `got` are both values (readable)."""

    def __init__(self, field: str, expected: object, got: object, detail: str = "") -> None:
        self.field, self.expected, self.got = field, expected, got
        super().__init__(f"context record {field}: got {got}, expected {expected}" + (f" ({detail})" if detail else ""))


class StagingFullError(StatusError):
    """Every context staging slot holds a context whose write has not completed: this prefill
    fails (RESOURCE_EXHAUSTED: the caller may retry elsewhere or later), the others go on."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ContextEncodeError(StatusError):
    """The engine handed over a hidden state or logits the record cannot hold (a bug, never the
    peer's fault): this transfer fails (INTERNAL), the others go on."""

    code = grpc.StatusCode.INTERNAL


class SlotPool:
    """`capacity` context slots, handed out and back (not thread-safe: the owner's lock guards it)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a context slot pool needs at least one slot, got {capacity}")
        self.capacity = capacity
        self._free: deque[int] = deque(range(capacity))

    def take(self, request_id: str) -> int:
        """A free slot; StagingFullError naming the request and the capacity when none is."""
        if not self._free:
            raise StagingFullError(f"request {request_id}: all {self.capacity} context staging slots hold "
                                   f"contexts still being written; retry later")
        return self._free.popleft()

    def give(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} outside 0..{self.capacity - 1}")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass
class Staging:
    buffer: HostBuffer            # owned here; the fabric registers its view
    region: MemoryRegion          # the registration of buffer.view
    array: np.ndarray             # uint8 view


def _code_name(codes: dict[str, int], code: int) -> str:
    return next((n for n, c in codes.items() if c == code), f"unknown code {code}")


def record_checksum(raw: np.ndarray | bytes | memoryview, nbytes: int) -> int:
    """zlib.crc32 of the first `nbytes` of a record: its header without the checksum field, then the body."""
    view = memoryview(raw).cast("B")
    return zlib.crc32(view[HEADER_NBYTES:nbytes], zlib.crc32(view[_CRC_AT + 4:HEADER_NBYTES],
                                                             zlib.crc32(view[:_CRC_AT])))


# TEST ONLY damages (kv_messenger.sender.TEST_BAD_CONTEXT_ENV)
DAMAGE_FLIP, DAMAGE_VERSION, DAMAGE_IDENTITY = "flip", "version", "identity"
DAMAGES = (DAMAGE_FLIP, DAMAGE_VERSION, DAMAGE_IDENTITY)


class ContextCodec:
    """The record of one model (hidden size) and top-k width: sizes, encoding, checked decoding."""

    def __init__(self, hidden_size: int, top_k: int = 32, hidden_kind: str = HIDDEN_KIND,
                 history_rows: int = 0) -> None:
        if hidden_size < 1 or top_k < 1:
            raise ValueError(f"context record: hidden_size {hidden_size} and top_k {top_k} must be >= 1")
        if not 0 <= history_rows <= MAX_HISTORY_ROWS:
            raise ValueError(f"context record: history_rows {history_rows} outside 0..{MAX_HISTORY_ROWS}")
        if hidden_kind not in HIDDEN_KINDS:
            raise ValueError(f"context record: hidden kind {hidden_kind!r} is not one of {sorted(HIDDEN_KINDS)}")
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.hidden_kind = hidden_kind
        self.hidden_dtype = "float32"
        self.version = RECORD_VERSION
        self.header_nbytes = HEADER_NBYTES
        self.history_rows = history_rows
        self.body_nbytes = hidden_size * 4 + top_k * 8 + history_rows * hidden_size * 4
        self.slot_nbytes = self.header_nbytes + self.body_nbytes

    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_nbytes

    def alloc_staging(self, fabric_engine: TransferEngine, slots: int) -> Staging:
        """A registered buffer of `slots` context slots (sender staging or receiver landing area)."""
        buf = alloc_buffer(slots * self.slot_nbytes, huge_pages=False)
        region = fabric_engine.register(buf.view)
        return Staging(buf, region, buf.numpy())

    def _slot(self, staging: Staging, slot: int) -> np.ndarray:
        """The slot's bytes in the staging array (a view): [slot_nbytes] uint8."""
        return staging.array[self.slot_offset(slot) : self.slot_offset(slot) + self.slot_nbytes]

    def encode_into(self, staging: Staging, slot: int, hidden: torch.Tensor, logits: torch.Tensor,
                    identity: TransferIdentity, position: int) -> None:
        """Write the record of `hidden` (the target's final-norm output at prompt position
        `position`: [hidden_size], or [n + 1, hidden_size] for positions position - n .. position,
        of which the last history_rows + 1 are kept) and the top-k of `logits` ([vocab]) for the
        transfer `identity`."""
        self._slot(staging, slot)[:] = np.frombuffer(self.encode(hidden, logits, identity, position), dtype=np.uint8)

    def encode(self, hidden: torch.Tensor, logits: torch.Tensor, identity: TransferIdentity, position: int) -> bytes:
        """The record's slot_nbytes bytes (see encode_into); ValueError naming a bad shape or position."""
        rows = hidden if hidden.dim() == 2 else hidden.view(1, -1)                # [n + 1, hidden_size]
        if rows.shape[0] < 1 or rows.shape[1] != self.hidden_size or hidden.dim() not in (1, 2):
            raise ValueError(f"request {identity.request_id}: hidden state of shape {tuple(hidden.shape)}, "
                             f"the record holds [{self.hidden_size}] (or [rows, {self.hidden_size}])")
        if rows.shape[0] - 1 > position:
            raise ValueError(f"request {identity.request_id}: {rows.shape[0]} hidden rows end at position "
                             f"{position}: more than the positions there are")
        history = rows[:-1][max(0, rows.shape[0] - 1 - self.history_rows):]     # [n, hidden_size]
        hidden = rows[-1]
        if logits.dim() != 1 or logits.shape[0] < self.top_k:
            raise ValueError(f"request {identity.request_id}: logits of shape {tuple(logits.shape)}, the record "
                             f"needs one row of at least top_k={self.top_k}")
        if not 0 <= position < 1 << 32:
            raise ValueError(f"request {identity.request_id}: position {position} outside 0..2**32-1")
        logprobs = torch.log_softmax(logits.float(), dim=-1)     # [vocab]
        top = torch.topk(logprobs, self.top_k)                   # [top_k] values / indices
        past = torch.zeros(self.history_rows, self.hidden_size)                 # [history_rows, hidden_size]
        past[: history.shape[0]] = history.detach().float()
        body = (hidden.detach().float().contiguous().numpy().tobytes()
                + top.indices.to(torch.int32).numpy().tobytes() + top.values.contiguous().numpy().tobytes()
                + past.numpy().tobytes())
        assert len(body) == self.body_nbytes
        raw = bytearray(self._header_bytes(identity, identity.digest(), position, 0, history.shape[0]) + body)
        struct.pack_into("<I", raw, _CRC_AT, record_checksum(raw, self.slot_nbytes))
        return bytes(raw)

    def _header_bytes(self, identity: TransferIdentity, digest: bytes, position: int, checksum: int,
                      history: int) -> bytes:
        return HEADER.pack(MAGIC, self.version, self.header_nbytes, self.hidden_size, self.top_k,
                           HIDDEN_DTYPES[self.hidden_dtype], HIDDEN_KINDS[self.hidden_kind], history, digest,
                           identity.attempt, identity.imm_tag, position, self.body_nbytes, checksum)

    @staticmethod
    def read_header(raw: np.ndarray | bytes) -> RecordHeader:
        """The header fields of a record's bytes, unchecked."""
        return RecordHeader(*HEADER.unpack_from(memoryview(raw).cast("B"), 0))

    def decode(self, staging: Staging, slot: int, expect: ExpectedRecord) -> Context:
        """The record in `slot`, checked against `expect` and this codec's layout (ContextRecordError)."""
        return self.decode_bytes(self._slot(staging, slot).copy(), expect)

    def decode_bytes(self, raw: np.ndarray | bytes, expect: ExpectedRecord) -> Context:
        """`raw` (slot_nbytes bytes) as a Context once every check passed; ContextRecordError naming
        the first field that differs (module docstring: the order) with both values."""
        raw = np.frombuffer(bytes(raw), dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        if raw.size != self.slot_nbytes:
            raise ContextRecordError("size", f"{self.slot_nbytes} bytes", f"{raw.size} bytes")
        h = self.read_header(raw)
        rid = expect.identity.request_id
        if h.magic != MAGIC:
            raise ContextRecordError("magic", MAGIC.hex(), h.magic.hex(),
                                     f"request {rid}: not a context record (never written, or damaged)")
        if h.version != self.version:
            raise ContextRecordError("version", self.version, h.version, f"request {rid}")
        # A layout that differs only reads as such once the bytes are known intact: the checksum
        # covers what the header says it wrote, where that fits in our slot.
        declared = h.header_nbytes + h.body_nbytes
        span = declared if h.header_nbytes == HEADER_NBYTES and declared <= raw.size else self.slot_nbytes
        crc = record_checksum(raw, span)
        if crc != h.checksum:
            raise ContextRecordError("checksum", f"0x{h.checksum:08x} (the header's)",
                                     f"0x{crc:08x} (over the {span} bytes that landed)",
                                     f"request {rid}: the record is damaged")
        for name, want, got in (("header_nbytes", self.header_nbytes, h.header_nbytes),
                                ("hidden_size", self.hidden_size, h.hidden_size),
                                ("top_k", self.top_k, h.top_k),
                                ("hidden_dtype", self.hidden_dtype, _code_name(HIDDEN_DTYPES, h.hidden_dtype)),
                                ("hidden_kind", self.hidden_kind, _code_name(HIDDEN_KINDS, h.hidden_kind)),
                                ("history_rows", self.history_rows, _history_capacity(h)),
                                ("body_nbytes", self.body_nbytes, h.body_nbytes)):
            if want != got:
                raise ContextRecordError(name, want, got, f"request {rid}")
        ident = expect.identity
        if h.identity != ident.digest():
            raise ContextRecordError("identity", f"{ident.digest().hex()} (request {rid} from decode engine "
                                     f"{ident.decode_engine_id[:8]})", h.identity.hex(),
                                     "another transfer's record")
        for name, want, got in (("attempt", ident.attempt, h.attempt), ("imm_tag", ident.imm_tag, h.imm_tag),
                                ("position", expect.position, h.position)):
            if want != got:
                raise ContextRecordError(name, want, got, f"request {rid}")
        if not h.history <= min(self.history_rows, expect.position):
            raise ContextRecordError("history", f"at most {min(self.history_rows, expect.position)} rows "
                                     f"(capacity {self.history_rows}, position {expect.position})", h.history,
                                     f"request {rid}")
        hs, k, at = self.hidden_size, self.top_k, HEADER_NBYTES
        past = at + hs * 4 + k * 8                       # the history rows' offset
        return Context(
            hidden=torch.from_numpy(raw[at : at + hs * 4].view(np.float32).copy()),
            top_ids=torch.from_numpy(raw[at + hs * 4 : at + hs * 4 + k * 4].view(np.int32).copy()),
            top_logprobs=torch.from_numpy(raw[at + hs * 4 + k * 4 : past].view(np.float32).copy()),
            history=torch.from_numpy(raw[past : past + h.history * hs * 4].view(np.float32).copy()).view(h.history, hs),
        )

    def damage(self, staging: Staging, slot: int, kind: str, other: TransferIdentity | None = None) -> str:
        """TEST ONLY (kv_messenger.sender.TEST_BAD_CONTEXT_ENV): damage the record in `slot` one way
        (DAMAGES) and say how: "flip" flips bit 6 of the body's fourth byte (the top byte of
        hidden[0]) and leaves the checksum; "version" writes version - 1; "identity" writes
        the identity of the transfer `other` (another request's) and seals it with a valid
        checksum, as a record that went to the wrong slot would be."""
        raw = self._slot(staging, slot)
        if kind == DAMAGE_FLIP:
            raw[HEADER_NBYTES + 3] ^= 0x40
            return f"flipped bit 6 of body byte 3 (of {self.body_nbytes})"
        if kind == DAMAGE_VERSION:
            struct.pack_into("<H", raw, 4, self.version - 1)
            return f"wrote version {self.version - 1}"
        if kind == DAMAGE_IDENTITY:
            if other is None:
                raise ValueError("context record damage 'identity' needs the other transfer's identity")
            raw[_ID_AT : _ID_AT + 16] = np.frombuffer(other.digest(), dtype=np.uint8)
            struct.pack_into("<I", raw, _CRC_AT, record_checksum(raw, self.slot_nbytes))
            return f"wrote request {other.request_id}'s identity (checksum resealed)"
        raise ValueError(f"context record damage {kind!r} is not one of {DAMAGES}")
