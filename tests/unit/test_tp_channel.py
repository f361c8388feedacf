"""The leader -> rank control pipe's bounds (pdserve/parallel/messages.py): a message the reader does
not take in time, or a body that stops mid-way, raises ChannelTimeout naming the rank and the
bound instead of blocking for ever; whole messages, written in parts, still arrive whole."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

from pdserve.parallel.messages import ChannelTimeout, read_message, write_message

BOUND_S = 0.3


def _pipe_capacity(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)


def test_a_message_nobody_reads_times_out_naming_the_rank_and_the_bound():
    r, w = os.pipe()
    result: list[BaseException | None] = []

    def send() -> None:
        try:
            write_message(w, b"x" * (4 * _pipe_capacity(w)), 3, BOUND_S)
            result.append(None)
        except BaseException as exc:   # handed to the test thread below
            result.append(exc)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        t.join(10 * BOUND_S + 5)
        assert not t.is_alive(), "write_message blocked past its bound"
    finally:
        os.close(r)   # a writer still blocked gets EPIPE and ends
        t.join(5)
        os.close(w)
    (exc,) = result
    assert isinstance(exc, ChannelTimeout)
    assert exc.rank == 3 and exc.timeout_s == BOUND_S
    assert "rank 3's control pipe" in str(exc) and f"within {BOUND_S:g} s" in str(exc)
    assert "was taken" in str(exc)


def test_a_body_that_stops_mid_way_times_out_and_end_of_file_is_none():
    r, w = os.pipe()
    try:
        os.write(w, (100).to_bytes(8, "little") + b"y" * 40)   # the length says 100, 40 came
        with pytest.raises(ChannelTimeout, match=r"rank 2's control pipe: 40 of a 100-byte message arrived "
                                                 r"within 0\.3 s"):
            read_message(r, 2, BOUND_S)
    finally:
        os.close(w)
    assert read_message(r, 2, BOUND_S) is None   # the writer is gone: end of file
    os.close(r)


def test_messages_larger_than_the_pipe_arrive_whole_while_the_reader_reads():
    r, w = os.pipe()
    payloads = [b"a" * 10, os.urandom(3 * _pipe_capacity(w) + 7), b""]
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.extend(read_message(r, 1, 10.0) for _ in payloads), daemon=True)
    reader.start()
    for p in payloads:
        write_message(w, p, 1, 10.0)
    reader.join(20)
    os.close(w)
    assert got == payloads
    assert read_message(r, 1, 10.0) is None
    os.close(r)
