"""The prefill node's connection generations per decode peer (kv_messenger.prefill_peers.ConnectionEpochs):
bounded, and a forgotten peer never reads a generation older than its failure (S5: a fence on a
connection newer than a transfer's must not confirm that transfer)."""

from __future__ import annotations

import pytest

from kv_messenger.prefill_peers import ConnectionEpochs


def test_a_failed_peer_gets_a_new_generation_and_others_keep_theirs():
    e = ConnectionEpochs(capacity=4)
    assert e.get("a") == e.get("b") == 0
    first = e.bump("a")
    assert e.get("a") == first > 0 and e.get("b") == 0
    assert e.bump("a") > first


def test_forgetting_a_peer_never_takes_its_generation_back():
    e = ConnectionEpochs(capacity=2)
    recorded = {"a": e.get("a")}          # a transfer to a starts: its tombstone keeps generation 0
    failed_a = e.bump("a")                 # then it fails: a's connection is closed
    e.bump("b")
    e.bump("c")                            # a is forgotten to keep the map at 2 peers
    assert len(e) == 2 and e.get("a") >= failed_a != recorded["a"]   # the old fence still proves nothing
    # a peer that never failed may now read the floor: its tombstones answer unconfirmed (conservative)
    assert e.get("never-failed") == e.floor >= failed_a
    for i in range(100):
        e.bump(f"p{i}")
    assert len(e) == 2


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity >= 1, got 0"):
        ConnectionEpochs(capacity=0)
