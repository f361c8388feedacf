"""The decode side's quarantine as a state machine (kv_messenger.decode.quarantine, issue 30 item 1;
docs/transfer-safety.md's diagram): its transitions on each event, the events it must refuse, and the
hold loop driving them from scripted AbortPrefill answers, a peer's death, a key rotation and a
cancellation, with fakes for the prefill node, the transport, the receiver and the engine thread."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from kv_messenger.decode import quarantine as qmod
from kv_messenger.decode.client import RpcError
from kv_messenger.decode.quarantine import (
    ABORT_CONFIRMED,
    ABORT_ENDED_UNFENCED,
    ABORT_NOT_YET,
    HoldState,
    HoldTransitionError,
    Quarantine,
    QuarantineHolds,
    Release,
)
from pdserve.engine.kv_connector import KvReleased
from pdserve_api.v1 import prefill_pb2

ENGINE = "prefill-engine-1"


def answer(confirmed: bool, state: int = prefill_pb2.TRANSFER_STATE_FINISHED, engine: str = ENGINE,
           fence_posted: bool = False) -> prefill_pb2.AbortPrefillResponse:
    return prefill_pb2.AbortPrefillResponse(confirmed=confirmed, prefill_engine_id=engine, state=state,
                                            fence_posted=fence_posted)


@dataclass
class FakeNode:
    """A PrefillTarget whose AbortPrefill answers are scripted (an exception is raised)."""

    answers: list
    address: str = "prefill-a:1"
    peer: object = "peer-a"
    tp_size: int = 1
    last_answer: float = 0.0
    sent_tokens: int = 0
    holds: int = 0
    asked: list = field(default_factory=list)

    async def prefill(self, req, timeout):
        raise AssertionError("a hold never sends a Prefill")

    async def abort(self, req, timeout):
        self.asked.append(req)
        a = self.answers.pop(0) if self.answers else answer(False, prefill_pb2.TRANSFER_STATE_ACTIVE)
        if isinstance(a, Exception):
            raise a
        return a


class FakeTransport:
    def __init__(self, gone_after_rounds: int | None = None) -> None:
        self.closes_connections = True
        self.writes_ordered = True
        self.closed: list = []
        self.gone_after_rounds = gone_after_rounds
        self.node: FakeNode | None = None

    def peer_gone(self, peer) -> bool:
        return (self.gone_after_rounds is not None and self.node is not None
                and len(self.node.asked) >= self.gone_after_rounds)

    def close_connection(self, peer) -> None:
        self.closed.append(peer)

    def progress_mark(self) -> int:
        return 1

    def progressed(self, mark: int) -> bool:
        return True


class FakeReceiver:
    def __init__(self) -> None:
        self.fences: list[int] = []
        self.retired: list[int] = []
        self.released: list[int] = []

    def expect_fence(self, on_landed, writer=None):
        self.fences.append(len(self.fences) + 100)
        return self.fences[-1], "region"

    def retire_fence(self, tag: int) -> None:
        self.retired.append(tag)

    def release_quarantined(self, tag: int) -> None:
        self.released.append(tag)


class FakeEngine:
    """The engine as the holds see it: the events of their posted work, applied at once."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def post(self, work) -> None:
        for event in work():
            assert isinstance(event, KvReleased), event
            self.released.append(event.hold_id)


class FakeRotation:
    def __init__(self) -> None:
        self.dead_below = 0

    def key_dead(self, key_gen: int) -> bool:
        return key_gen < self.dead_below


class FakeTelemetry:
    class _Gauge:
        def labels(self, **kw):
            return self

        def set(self, v) -> None:
            pass

        def remove(self, *labels) -> None:
            pass

    kv_quarantine_oldest = _Gauge()

    @staticmethod
    def bind_request_id(rid: str) -> None:
        pass


def quarantine(node: FakeNode, key_gen: int = 0) -> Quarantine:
    return Quarantine(request_id="r1", attempt=0, quarantine_id="r1#0", node=node, decode_engine_id="decode-1",
                      prefill_engine_id=ENGINE, peer=node.peer, since=0.0, tag=7, blocks=3, key_gen=key_gen)


def run_hold(q: Quarantine, transport: FakeTransport, close: bool = False, rotation: FakeRotation | None = None,
             cancel_after_s: float | None = None):
    receiver, engine = FakeReceiver(), FakeEngine()
    transport.node = q.node

    async def main():
        holds = QuarantineHolds(transport, receiver, rotation or FakeRotation(), FakeTelemetry(), close)
        holds.engine, holds.post, holds.loop = engine, engine.post, asyncio.get_running_loop()
        task = asyncio.create_task(holds._hold(q))
        if cancel_after_s is None:
            await asyncio.wait_for(task, 10)
        else:
            await asyncio.sleep(cancel_after_s)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    asyncio.run(main())
    return receiver, engine


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    monkeypatch.setattr(qmod, "HOLD_BACKOFF_S", 0.01)
    monkeypatch.setattr(qmod, "HOLD_POLL_S", 0.005)
    monkeypatch.setattr(qmod, "DRAIN_GRACE_S", 0.0)
    monkeypatch.setattr(qmod, "remote_to_bytes", lambda region: b"fence-region")


def test_transitions_follow_the_diagram():
    q = quarantine(FakeNode([]))
    assert q.state is HoldState.HELD and not q.ended_unfenced
    q.answered(ABORT_NOT_YET)
    assert q.state is HoldState.HELD
    q.answered(ABORT_ENDED_UNFENCED)
    assert q.state is HoldState.ENDED_UNFENCED and q.ended_unfenced
    q.answered(ABORT_NOT_YET)   # sticky: a later answer that proves nothing keeps it ended-unfenced
    assert q.state is HoldState.ENDED_UNFENCED
    q.connection_closed()
    assert q.state is HoldState.RELEASED and q.released_by is Release.CONNECTION_CLOSED
    for event in (q.peer_gone, q.key_rotated, q.left_held, q.connection_closed, lambda: q.answered(ABORT_CONFIRMED)):
        with pytest.raises(HoldTransitionError):
            event()


def test_events_a_held_quarantine_must_refuse():
    q = quarantine(FakeNode([]))
    with pytest.raises(HoldTransitionError):
        q.connection_closed()   # only an unfenced end may be released by a close
    with pytest.raises(ValueError):
        q.answered("maybe")
    q.left_held()
    assert q.state is HoldState.LEFT_HELD
    with pytest.raises(HoldTransitionError):
        q.answered(ABORT_CONFIRMED)   # a hold left held is never released later


@pytest.mark.parametrize("start", [HoldState.HELD, HoldState.ENDED_UNFENCED])
@pytest.mark.parametrize("event,why", [("peer_gone", Release.PEER_GONE), ("key_rotated", Release.KEY_ROTATED)])
def test_peer_gone_and_rotation_release_from_either_held_state(start, event, why):
    q = quarantine(FakeNode([]))
    if start is HoldState.ENDED_UNFENCED:
        q.answered(ABORT_ENDED_UNFENCED)
    getattr(q, event)()
    assert (q.state, q.released_by) == (HoldState.RELEASED, why)


def test_hold_released_once_the_abort_is_confirmed():
    node = FakeNode([RpcError("UNAVAILABLE", "down"),                          # round 1: not yet
                     answer(True, engine="another-engine"),                    # round 2: another process answered
                     answer(False, prefill_pb2.TRANSFER_STATE_ACTIVE),        # round 3: still running
                     answer(True)])                                            # round 4: confirmed, no fence
    q = quarantine(node)
    receiver, engine = run_hold(q, FakeTransport())
    assert (q.state, q.released_by) == (HoldState.RELEASED, Release.ABORT_CONFIRMED)
    assert len(node.asked) == 4 and q.rounds == 3
    assert all(r.prefill_engine_id == ENGINE and r.attempt == 0 for r in node.asked)
    assert engine.released == ["r1#0"] and receiver.released == [7]
    assert receiver.retired == receiver.fences   # every fence tag retired
    assert node.holds == 0


def test_unfenced_end_is_released_by_a_close_only_when_enabled():
    node = FakeNode([answer(False, prefill_pb2.TRANSFER_STATE_CONNECTION_FAILED)])
    q = quarantine(node)
    transport = FakeTransport()
    run_hold(q, transport, close=True)
    assert (q.state, q.released_by) == (HoldState.RELEASED, Release.CONNECTION_CLOSED)
    assert transport.closed == [node.peer]

    node = FakeNode([answer(False, prefill_pb2.TRANSFER_STATE_CONNECTION_FAILED)])
    q = quarantine(node)
    transport = FakeTransport()
    receiver, engine = run_hold(q, transport, close=False, cancel_after_s=0.2)
    assert q.state is HoldState.LEFT_HELD and transport.closed == []
    assert engine.released == [] and receiver.released == []   # never released unproven


def test_confirmed_fence_that_never_lands_is_an_unfenced_end(monkeypatch):
    monkeypatch.setattr(qmod, "FENCE_WAIT_S", 0.01)
    node = FakeNode([answer(True, fence_posted=True), answer(True)])
    q = quarantine(node)
    run_hold(q, FakeTransport())
    assert q.released_by is Release.ABORT_CONFIRMED and len(node.asked) == 2
    assert q.rounds == 1   # the first round ended unfenced (sticky until the second confirmed)


def test_peer_gone_releases_after_the_drain():
    node = FakeNode([])   # never confirms
    q = quarantine(node)
    receiver, engine = run_hold(q, FakeTransport(gone_after_rounds=2))
    assert (q.state, q.released_by) == (HoldState.RELEASED, Release.PEER_GONE)
    assert engine.released == ["r1#0"]


def test_another_engine_at_the_address_is_an_unfenced_end_that_a_rotation_releases(monkeypatch):
    """Issue 33: a prefill process restarted in place (another engine answers at its address; on
    another host or pid namespace peer_gone cannot tell) was counted as not-yet for ever. It is an
    unfenced end: never released on that answer, but a key rotation (on by default) releases it."""
    rotation = FakeRotation()
    node = FakeNode([answer(False, prefill_pb2.TRANSFER_STATE_UNKNOWN, engine="prefill-engine-2")] * 3)
    q = quarantine(node, key_gen=0)
    transport = FakeTransport()

    async def rotate_later():
        await asyncio.sleep(0.3)
        assert q.state is HoldState.ENDED_UNFENCED and q.ended_unfenced   # what asks for a rotation
        rotation.dead_below = 1

    async def main():
        receiver, engine = FakeReceiver(), FakeEngine()
        holds = QuarantineHolds(transport, receiver, rotation, FakeTelemetry(), False)
        holds.engine, holds.post, holds.loop = engine, engine.post, asyncio.get_running_loop()
        await asyncio.gather(asyncio.wait_for(holds._hold(q), 10), rotate_later())
        return engine

    monkeypatch.setattr(qmod, "HOLD_BACKOFF_S", 0.05)
    engine = asyncio.run(main())
    assert (q.state, q.released_by) == (HoldState.RELEASED, Release.KEY_ROTATED)
    assert engine.released == ["r1#0"] and transport.closed == []


def test_rotated_key_releases_without_asking():
    rotation = FakeRotation()
    rotation.dead_below = 1
    node = FakeNode([])
    q = quarantine(node, key_gen=0)
    run_hold(q, FakeTransport(), rotation=rotation)
    assert (q.state, q.released_by) == (HoldState.RELEASED, Release.KEY_ROTATED)
    assert node.asked == []
