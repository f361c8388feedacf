"""Routing policies (R3): block hashes of the leading prompt blocks, the prefix index, the load cap, and
the exact node each policy chooses. Pure functions and small objects: no servers (the router with
the prefix policy in front of fake nodes is in test_router.py)."""

from __future__ import annotations

import argparse
from array import array

import pytest

from pdserve.serving.prefix_index import (
    Candidate,
    LoadCap,
    PrefixIndex,
    chain_hashes,
    choose,
    text_blocks,
    token_blocks,
)
from pdserve_api.v1 import generate_pb2
from router.policy import (
    LeastLoadedPolicy,
    PrefixPolicy,
    RoutingConfig,
    add_routing_args,
    make_policy,
    prompt_hashes,
    routing_from_args,
)


def text_request(text: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=text)


def ids_request(ids: list[int]) -> generate_pb2.GenerateRequest:
    r = generate_pb2.GenerateRequest()
    r.token_ids.ids.extend(ids)
    return r


# ---- blocks and hashes -----------------------------------------------------------------------------


def test_blocks_are_complete_and_bounded():
    assert token_blocks(list(range(10)), 4, 100) == [array("q", [0, 1, 2, 3]).tobytes(),
                                                     array("q", [4, 5, 6, 7]).tobytes()]
    assert len(token_blocks(list(range(10)), 4, 1)) == 1      # max_blocks
    assert token_blocks([1, 2, 3], 4, 10) == []               # no complete block
    assert text_blocks("abcdefghij", 4, 10) == [b"abcd", b"efgh"]
    assert text_blocks("é" * 4, 2, 10) == ["éé".encode(), "éé".encode()]  # characters, not bytes
    with pytest.raises(ValueError, match="block_tokens must be >= 1"):
        token_blocks([1], 0, 1)
    with pytest.raises(ValueError, match="block_chars must be >= 1"):
        text_blocks("a", 0, 1)


def test_chained_hashes_name_whole_prefixes():
    a = chain_hashes([b"x", b"y", b"z"])
    b = chain_hashes([b"x", b"y", b"w"])
    c = chain_hashes([b"q", b"y", b"z"])
    assert len(a) == 3 and len(set(a)) == 3
    assert a[:2] == b[:2] and a[2] != b[2]        # same first two blocks, different third
    assert not set(a) & set(c)                     # a different first block changes every later hash
    assert chain_hashes([b"x", b"y", b"z"]) == a   # deterministic
    assert a == (chain_hashes([b"x"])[0], *chain_hashes([b"x", b"y", b"z"])[1:])


def test_prompt_hashes_of_each_prompt_kind():
    cfg = RoutingConfig(policy="prefix", block_chars=4, block_tokens=2)
    assert prompt_hashes(text_request("abcdefgh!"), cfg) == chain_hashes([b"abcd", b"efgh"])
    assert prompt_hashes(ids_request([5, 6, 7, 8, 9]), cfg) == chain_hashes(token_blocks([5, 6, 7, 8, 9], 2, 128))
    chat = generate_pb2.GenerateRequest()
    chat.messages.messages.add(role="system", content="be brief")
    chat.messages.messages.add(role="user", content="hello")
    split = generate_pb2.GenerateRequest()
    split.messages.messages.add(role="system", content="be brie")
    split.messages.messages.add(role="user", content="fhello")
    h, g = prompt_hashes(chat, cfg), prompt_hashes(split, cfg)
    assert len(h) == len("\x1esystem\x1fbe brief\x1euser\x1fhello") // 4
    assert h[0] == g[0] and h != g  # same leading characters, turns split differently
    assert prompt_hashes(text_request("abc"), cfg) == ()


# ---- the index -------------------------------------------------------------------------------------


def test_index_matches_deepest_recorded_block_per_node():
    index = PrefixIndex(capacity=100)
    fam = chain_hashes([b"a", b"b", b"c", b"d"])
    other = chain_hashes([b"a", b"b", b"x"])
    index.record(fam, "n0")
    index.record(other[:2], "n1")
    assert index.matches(fam) == {"n0": 4, "n1": 2}
    assert index.matches(other) == {"n0": 2, "n1": 2}
    assert index.matches(chain_hashes([b"z"])) == {}
    assert index.forget("n0") == 4 and index.matches(fam) == {"n1": 2}
    assert len(index) == 2


def test_index_drops_least_recently_recorded_hashes_beyond_capacity():
    index = PrefixIndex(capacity=3)
    h = chain_hashes([b"1", b"2", b"3", b"4"])
    index.record(h[:2], "a")        # h0, h1
    index.record(h[2:3], "b")       # h2
    index.record(h[:1], "c")        # h0 again: now the newest
    index.record(h[3:], "d")        # h3 pushes out the oldest: h1
    assert len(index) == 3
    assert index.matches(h) == {"d": 4, "b": 3, "a": 1, "c": 1}
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        PrefixIndex(0)


# ---- choose and the load cap -----------------------------------------------------------------------


def test_load_cap_limit():
    cap = LoadCap(slack_tokens=100, ratio=0.5)
    assert cap.limit(0) == 100 and cap.limit(100) == 200 and cap.limit(400) == 600
    with pytest.raises(ValueError, match="slack_tokens >= 0"):
        LoadCap(-1, 0.5)


def test_choose_deepest_match_under_the_cap():
    cap = LoadCap(slack_tokens=100, ratio=0.5)
    nodes = [Candidate("a", 50, 0), Candidate("b", 120, 1), Candidate("c", 0, 2)]
    # limit = 0 + max(100, 0) = 100: b (120) is over it
    c = choose(nodes, {"a": 2}, cap)
    assert (c.key, c.reason, c.matched_blocks) == ("a", "prefix", 2)
    c = choose(nodes, {"a": 2, "b": 5}, cap)
    assert (c.key, c.reason, c.matched_blocks) == ("a", "load_cap", 2)   # b matches deeper but is over
    c = choose(nodes, {"b": 5}, cap)
    assert (c.key, c.reason, c.matched_blocks) == ("c", "load_cap", 0)   # least loaded under the cap
    c = choose(nodes, {}, cap)
    assert (c.key, c.reason, c.matched_blocks) == ("c", "least_loaded", 0)
    # equal depth: less load wins; equal load: lower rank
    c = choose([Candidate("a", 80, 0), Candidate("b", 60, 1)], {"a": 3, "b": 3}, cap)
    assert c.key == "b"
    c = choose([Candidate("a", 60, 1), Candidate("b", 60, 0)], {}, cap)
    assert c.key == "b"
    with pytest.raises(ValueError, match="at least one candidate"):
        choose([], {}, cap)


# ---- the policies ----------------------------------------------------------------------------------


FAMILY_A = "You are a tax assistant. " * 8     # 200 characters: 3 blocks of 64
FAMILY_B = "You are a poet of the sea. " * 8   # 216 characters: 3 blocks of 64


def test_prefix_policy_sends_a_family_to_the_node_that_got_its_prefix():
    policy = make_policy(RoutingConfig(policy="prefix"))
    assert isinstance(policy, PrefixPolicy)
    idle = [Candidate("n0", 0, 0), Candidate("n1", 0, 1)]
    first_a = policy.choose(text_request(FAMILY_A + "question 1"), idle)
    assert (first_a.address, first_a.reason, first_a.matched_blocks) == ("n0", "least_loaded", 0)
    assert len(first_a.hashes) == 3
    policy.sent(first_a)
    first_b = policy.choose(text_request(FAMILY_B + "question 1"), [Candidate("n0", 300, 1), Candidate("n1", 0, 0)])
    assert (first_b.address, first_b.reason) == ("n1", "least_loaded")
    policy.sent(first_b)
    # n0 now carries more work, but within the cap (0 + 1024): family A stays on n0, B on n1
    loaded = [Candidate("n0", 600, 0), Candidate("n1", 200, 1)]
    for family, node in ((FAMILY_A, "n0"), (FAMILY_B, "n1")):
        route = policy.choose(text_request(family + "another question"), loaded)
        assert (route.address, route.reason, route.matched_blocks) == (node, "prefix", 3)
    # over the cap (200 + max(1024, 100) = 1224): family A goes to the least loaded node
    route = policy.choose(text_request(FAMILY_A + "q"), [Candidate("n0", 1300, 0), Candidate("n1", 200, 1)])
    assert (route.address, route.reason, route.matched_blocks) == ("n1", "load_cap", 0)
    policy.sent(route)  # now both nodes were sent family A's prefix
    route = policy.choose(text_request(FAMILY_A + "q"), [Candidate("n0", 10, 0), Candidate("n1", 20, 1)])
    assert (route.address, route.reason) == ("n0", "prefix")
    # a node that left the rotation is forgotten
    policy.forget("n0")
    route = policy.choose(text_request(FAMILY_A + "q"), [Candidate("n0", 10, 0), Candidate("n1", 20, 1)])
    assert (route.address, route.reason) == ("n1", "prefix")


def test_least_loaded_policy_ignores_prefixes():
    policy = make_policy(RoutingConfig())
    assert isinstance(policy, LeastLoadedPolicy)
    route = policy.choose(text_request(FAMILY_A), [Candidate("n0", 10, 0), Candidate("n1", 5, 1)])
    assert (route.address, route.reason, route.hashes) == ("n1", "least_loaded", ())
    policy.sent(route)
    route = policy.choose(text_request(FAMILY_A), [Candidate("n0", 5, 1), Candidate("n1", 5, 0)])
    assert route.address == "n1"  # equal load: rank


def test_routing_flags_and_config_errors():
    p = argparse.ArgumentParser()
    add_routing_args(p)
    cfg = routing_from_args(p.parse_args(["--routing", "prefix", "--prefix-load-slack", "300"]))
    assert (cfg.policy, cfg.load_slack_tokens, cfg.block_chars) == ("prefix", 300, 64)
    assert routing_from_args(p.parse_args([])).policy == "least-loaded"
    with pytest.raises(SystemExit):
        p.parse_args(["--routing", "random"])
    for kwargs, match in ((dict(policy="random"), "routing policy must be one of"),
                          (dict(block_chars=0), "block_chars must be >= 1"),
                          (dict(load_ratio=-1.0), "ratio >= 0")):
        with pytest.raises(ValueError, match=match):
            RoutingConfig(**kwargs)


# ---- a decode node's choice of prefill node -----------------------------------------------------------


def test_prefill_pool_prefers_the_node_sent_the_prefix_under_the_load_cap():
    import asyncio

    from decode_node.prefill_pool import PrefillPool, PrefixAffinity

    async def go():
        pool = PrefillPool(["127.0.0.1:1", "127.0.0.1:2"], PrefixAffinity(block_tokens=4, cap=LoadCap(100, 0.5)))
        plain = PrefillPool(["127.0.0.1:1", "127.0.0.1:2"])
        try:
            a, b = pool.nodes
            for n in pool.nodes + plain.nodes:   # choose() offers only nodes whose fabric engine is known
                n.peer = object()
            fam_x, fam_y = list(range(100, 112)), list(range(200, 212))  # 3 blocks each
            assert pool.choose(token_ids=fam_x + [1]) is a          # nothing known: least loaded (tie: first)
            b.reported_tokens = 0
            a.sent_tokens = 50
            assert pool.choose(token_ids=fam_y + [2]) is b          # least loaded
            assert pool.choose(token_ids=fam_x + [3, 4]) is a       # a holds x: 50 <= 0 + 100
            assert pool.choose(token_ids=fam_y + [5]) is b
            a.sent_tokens = 150                                     # over the cap: 0 + max(100, 0)
            assert pool.choose(token_ids=fam_x + [6]) is b
            assert pool.choose(token_ids=fam_x[:3]) is b            # no complete block: least loaded
            assert pool.choose(exclude={b.address}, token_ids=fam_y) is a
            pool.mark_down(a, "test")                               # a forgotten, and out for a while
            assert pool.index.matches(chain_hashes(token_blocks(fam_x, 4, 10))) == {b.address: 3}
            assert pool.choose(exclude={b.address}, token_ids=fam_x) is None
            plain.nodes[0].sent_tokens = 10
            assert plain.choose(token_ids=fam_x) is plain.nodes[1] and plain.index is None
        finally:
            await pool.close()
            await plain.close()

    asyncio.run(go())
    with pytest.raises(ValueError, match="block_tokens, max_blocks and capacity >= 1"):
        PrefixAffinity(block_tokens=0)
