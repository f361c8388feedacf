"""The versioned context record (D19, kv_messenger.context): a round trip gives back the hidden
state and the top-k of the logits; every field the decode side checks (version, layout, hidden
kind, transfer identity, position) is detected with a ContextRecordError naming it and both values;
a flipped byte anywhere is detected (as the checksum past magic and version); the TEST-ONLY damages
(kv_messenger.sender.TEST_BAD_CONTEXT_ENV) are each detected as what they are; and the record
layout the nodes announce (pdserve.serving.build_identity) states the codec's version and kind."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kv_messenger.context import (
    DAMAGES,
    HEADER_NBYTES,
    HIDDEN_KIND,
    RECORD_VERSION,
    ContextCodec,
    ContextRecordError,
    ExpectedRecord,
    Staging,
    TransferIdentity,
    record_checksum,
)
from kv_messenger.sender import TEST_BAD_CONTEXT_ENV, BadContext, parse_bad_contexts
from pdserve.serving import build_identity
from pdserve.serving.build_identity import KvLayoutKey

H, K = 16, 4
IDENT = TransferIdentity("req-1", "e" * 32, attempt=2, imm_tag=77)
POSITION = 41
EXPECT = ExpectedRecord(IDENT, POSITION)


def _record(codec: ContextCodec | None = None, ident: TransferIdentity = IDENT, position: int = POSITION,
            seed: int = 0) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    codec = codec or ContextCodec(H, K)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(codec.hidden_size, generator=g)   # [H]
    logits = torch.randn(50, generator=g)                   # [vocab]
    return codec.encode(hidden, logits, ident, position), hidden, logits


def _reseal(raw: bytearray) -> bytes:
    """A forged record with a valid checksum (what a peer of another layout would write)."""
    struct.pack_into("<I", raw, 52, record_checksum(raw, len(raw)))
    return bytes(raw)


def _error(raw: bytes, codec: ContextCodec | None = None, expect: ExpectedRecord = EXPECT) -> ContextRecordError:
    with pytest.raises(ContextRecordError) as info:
        (codec or ContextCodec(H, K)).decode_bytes(raw, expect)
    return info.value


def test_a_record_round_trips_with_its_header_before_the_body():
    codec = ContextCodec(H, K)
    assert codec.slot_nbytes == HEADER_NBYTES + H * 4 + K * 8 == 64 + 96
    raw, hidden, logits = _record(codec)
    assert len(raw) == codec.slot_nbytes and raw[:4] == b"PDCX"
    ctx = codec.decode_bytes(raw, EXPECT)
    top = torch.topk(torch.log_softmax(logits, dim=-1), K)
    assert torch.equal(ctx.hidden, hidden)
    assert torch.equal(ctx.top_ids, top.indices.to(torch.int32)) and torch.equal(ctx.top_logprobs, top.values)
    h = codec.read_header(raw)
    assert (h.version, h.header_nbytes, h.hidden_size, h.top_k, h.attempt, h.imm_tag, h.position) == \
        (RECORD_VERSION, 64, H, K, 2, 77, POSITION)
    assert h.identity == IDENT.digest() and h.checksum == record_checksum(raw, len(raw))
    # through a staging slot (the sender's and receiver's path), at a slot other than 0
    staging = Staging(buffer=None, region=None, array=np.zeros(3 * codec.slot_nbytes, dtype=np.uint8))
    codec.encode_into(staging, 1, hidden, logits, IDENT, POSITION)
    assert bytes(staging.array[codec.slot_offset(1):codec.slot_offset(2)]) == raw
    assert not staging.array[:codec.slot_offset(1)].any() and not staging.array[codec.slot_offset(2):].any()
    assert torch.equal(codec.decode(staging, 1, EXPECT).hidden, hidden)


def test_encoding_refuses_shapes_the_record_cannot_hold():
    codec = ContextCodec(H, K)
    with pytest.raises(ValueError, match=r"hidden state of shape \(8,\), the record holds \[16\]"):
        codec.encode(torch.zeros(8), torch.zeros(50), IDENT, 0)
    with pytest.raises(ValueError, match="at least top_k=4"):
        codec.encode(torch.zeros(H), torch.zeros(3), IDENT, 0)
    with pytest.raises(ValueError, match="position -1"):
        codec.encode(torch.zeros(H), torch.zeros(50), IDENT, -1)
    with pytest.raises(ValueError, match="hidden kind 'pre_norm'"):
        ContextCodec(H, K, hidden_kind="pre_norm")


@pytest.mark.parametrize(("expect", "field"), [
    (ExpectedRecord(TransferIdentity("req-2", "e" * 32, 2, 77), POSITION), "identity"),    # another request
    (ExpectedRecord(TransferIdentity("req-1", "f" * 32, 2, 77), POSITION), "identity"),    # another decode node
    (ExpectedRecord(TransferIdentity("req-1", "e" * 32, 3, 77), POSITION), "attempt"),
    (ExpectedRecord(TransferIdentity("req-1", "e" * 32, 2, 78), POSITION), "imm_tag"),
    (ExpectedRecord(IDENT, POSITION + 1), "position"),
])
def test_a_record_of_another_transfer_or_position_is_named_by_its_field(expect, field):
    raw, _, _ = _record()
    err = _error(raw, expect=expect)
    assert err.field == field and f"context record {field}: got " in str(err)
    if field == "attempt":
        assert (err.got, err.expected) == (2, 3) and "got 2, expected 3" in str(err)
    if field == "position":
        assert "got 41, expected 42" in str(err)
    if field == "identity":
        assert IDENT.digest().hex() in str(err) and expect.identity.digest().hex() in str(err)


def test_a_record_of_another_layout_version_or_kind_is_named_by_its_field():
    # another hidden size with the same slot size (8 * 4 + 8 * 8 == 16 * 4 + 4 * 8)
    raw, _, _ = _record(ContextCodec(8, 8))
    err = _error(raw)
    assert err.field == "hidden_size" and "got 8, expected 16" in str(err)
    # another top-k width (a smaller record in our slot: its checksum spans what it declares)
    small, _, _ = _record(ContextCodec(H, 2))
    err = _error(small + bytes(ContextCodec(H, K).slot_nbytes - len(small)))
    assert err.field == "top_k" and "got 2, expected 4" in str(err)
    # a dtype or kind code this node does not know, correctly sealed
    for offset, field in ((16, "hidden_dtype"), (17, "hidden_kind")):
        forged = bytearray(_record()[0])
        forged[offset] = 9
        err = _error(_reseal(forged))
        assert err.field == field and "got unknown code 9, expected" in str(err), err
    # another version (v1 had no header; a later one may put its fields elsewhere): before the checksum
    forged = bytearray(_record()[0])
    struct.pack_into("<H", forged, 4, RECORD_VERSION + 1)
    err = _error(bytes(forged))
    assert err.field == "version" and f"got {RECORD_VERSION + 1}, expected {RECORD_VERSION}" in str(err)
    # nothing written (an all-zero slot)
    err = _error(bytes(ContextCodec(H, K).slot_nbytes))
    assert err.field == "magic" and "not a context record" in str(err)
    # a slot of the wrong size
    assert _error(_record()[0][:-1]).field == "size"


def test_a_flipped_byte_anywhere_is_detected():
    raw, _, _ = _record()
    for offset in range(len(raw)):
        for bit in (0, 6):
            bad = bytearray(raw)
            bad[offset] ^= 1 << bit
            err = _error(bytes(bad))
            # magic and version are read first (they say how to read the rest); past them, the checksum
            want = "magic" if offset < 4 else "version" if offset < 6 else "checksum"
            assert err.field == want, (offset, bit, str(err))


def test_each_test_only_damage_is_detected_as_what_it_is():
    codec = ContextCodec(H, K)
    raw, _, _ = _record(codec)
    other = TransferIdentity("req-1~other", IDENT.decode_engine_id, IDENT.attempt, IDENT.imm_tag)
    fields = {}
    for kind in DAMAGES:
        staging = Staging(buffer=None, region=None, array=np.frombuffer(raw, dtype=np.uint8).copy())
        codec.damage(staging, 0, kind, other)
        with pytest.raises(ContextRecordError) as info:
            codec.decode(staging, 0, EXPECT)
        fields[kind] = info.value.field
        if kind == "identity":   # a well-formed record of another request: only its identity tells
            assert codec.decode(staging, 0, ExpectedRecord(other, POSITION)).hidden.shape == (H,)
    assert fields == {"flip": "checksum", "version": "version", "identity": "identity"}
    with pytest.raises(ValueError, match="not one of"):
        codec.damage(Staging(None, None, np.frombuffer(raw, dtype=np.uint8).copy()), 0, "truncate")


def test_the_test_only_hook_parses_prefix_kind_attempts_and_names_a_bad_entry():
    assert parse_bad_contexts("") == ()
    assert parse_bad_contexts("ctx-flip-:flip:1, a:b:identity:2") == (BadContext("ctx-flip-", "flip", 1),
                                                                      BadContext("a:b", "identity", 2))
    for bad in ("ctx:flip", "ctx:scramble:1", ":version:1", "ctx:version:x"):
        with pytest.raises(ValueError, match=TEST_BAD_CONTEXT_ENV):
            parse_bad_contexts(bad)


def test_the_announced_record_layout_is_the_codecs():
    assert build_identity.CONTEXT_RECORD_VERSION == RECORD_VERSION
    assert build_identity.HIDDEN_KIND == HIDDEN_KIND == ContextCodec(H, K).hidden_kind
    key = KvLayoutKey(num_layers=2, kv_heads=2, head_dim=16, page_size=16, dtype="float32", hidden_size=H,
                      context_top_k=K)
    assert f"ctx3=v{RECORD_VERSION}header,hidden{H}xf32:final_norm,top{K}xi32,top{K}xf32,crc32" in key.describe()
    # history rows are part of the layout: nodes that disagree on them do not pair
    longer = KvLayoutKey(num_layers=2, kv_heads=2, head_dim=16, page_size=16, dtype="float32", hidden_size=H,
                         context_top_k=K, context_history=128)
    assert f"crc32,history128x{H}xf32" in longer.describe() and longer.digest() != key.digest()


def test_history_rows_round_trip_and_a_short_prompt_sends_fewer():
    """Version 3: the hidden states of the positions before the record's (a decode node's draft head
    writes its history from them) follow the v2 body; the header counts those present."""
    codec = ContextCodec(H, K, history_rows=5)
    assert codec.slot_nbytes == HEADER_NBYTES + H * 4 + K * 8 + 5 * H * 4
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(8, H, generator=g)           # positions POSITION - 7 .. POSITION
    logits = torch.randn(50, generator=g)
    raw = codec.encode(rows, logits, IDENT, POSITION)
    ctx = codec.decode_bytes(raw, EXPECT)
    assert torch.equal(ctx.hidden, rows[-1]) and torch.equal(ctx.history, rows[-6:-1])   # the last 5 before it
    assert codec.read_header(raw).history == 5
    # a prompt with 2 positions before the record's: 2 rows, the rest of the slot zeros
    short = codec.encode(rows[:3], logits, IDENT, 2)
    ctx = codec.decode_bytes(short, ExpectedRecord(IDENT, 2))
    assert torch.equal(ctx.history, rows[:2]) and torch.equal(ctx.hidden, rows[2])
    assert not any(short[-3 * H * 4:])
    # one row: as without history
    assert codec.decode_bytes(codec.encode(rows[-1], logits, IDENT, POSITION), EXPECT).history.shape == (0, H)
    assert ContextCodec(H, K).decode_bytes(_record()[0], EXPECT).history.shape == (0, H)
    with pytest.raises(ValueError, match="more than the positions there are"):
        codec.encode(rows, logits, IDENT, 6)        # 8 rows cannot end at position 6
    with pytest.raises(ValueError, match="history_rows 5000"):
        ContextCodec(H, K, history_rows=5000)


def test_the_engine_config_bounds_history_rows_as_the_record_does():
    """EngineConfig.context_history_rows (the engine's room cannot import kv_messenger) states the
    record's capacity limit again: the two must agree."""
    from kv_messenger.context import MAX_HISTORY_ROWS
    from pdserve.engine.config import EngineConfig

    assert EngineConfig(context_history_rows=MAX_HISTORY_ROWS).context_history_rows == MAX_HISTORY_ROWS
    with pytest.raises(ValueError, match="context_history_rows"):
        EngineConfig(context_history_rows=MAX_HISTORY_ROWS + 1)


def test_a_record_of_another_history_capacity_or_a_count_past_it_is_refused():
    # a smaller record in a slot of the decoder's size (the rest of the slot as it was: zeros)
    theirs, ours = ContextCodec(H, K, history_rows=4), ContextCodec(H, K, history_rows=8)
    raw = _record(theirs)[0] + bytes(ours.slot_nbytes - theirs.slot_nbytes)
    err = _error(raw, ours)
    assert err.field == "history_rows" and "got 4, expected 8" in str(err)
    ours = ContextCodec(H, K, history_rows=2)
    err = _error(_record()[0] + bytes(ours.slot_nbytes - ContextCodec(H, K).slot_nbytes), ours)
    assert err.field == "history_rows" and "got 0, expected 2" in str(err)
    # a sealed header claiming more rows than the slot holds (or than precede the position)
    codec = ContextCodec(H, K, history_rows=4)
    forged = bytearray(codec.encode(torch.randn(3, H), torch.randn(50), IDENT, 2))
    struct.pack_into("<H", forged, 18, 4)
    err = _error(_reseal(forged), codec, ExpectedRecord(IDENT, 2))
    assert err.field == "history" and "got 4" in str(err)
