"""The injected fault plan (pdserve.engine.faults): parsed once from the TEST ONLY variables at an
entry point, empty by default, malformed entries refused naming the variable."""

import pytest

from pdserve.engine.faults import (
    BAD_CONTEXT_ENV,
    BAD_SHARD_KEY_ENV,
    CORRUPT_KV_ENV,
    ENGINE_DEATH_FILE_ENV,
    NO_FAULTS,
    FaultPlan,
)

pytestmark = pytest.mark.unit


def test_no_variables_is_no_faults():
    plan = FaultPlan.from_env({})
    assert plan == NO_FAULTS
    assert not plan.corrupts_kv("r", 0) and plan.context_damage("r", 0) is None and plan.bad_key_ranks("r", 0) == ()


def test_entries_select_by_prefix_and_attempt():
    plan = FaultPlan.from_env({CORRUPT_KV_ENV: "ck-:1", BAD_CONTEXT_ENV: "bc:a:magic:2",
                               BAD_SHARD_KEY_ENV: "tp-bad:1:2, tp-bad:0:1", ENGINE_DEATH_FILE_ENV: "/t/die-{pid}"},
                              pid=42)
    assert plan.corrupts_kv("ck-7", 0) and not plan.corrupts_kv("ck-7", 1) and not plan.corrupts_kv("x", 0)
    assert plan.context_damage("bc:a-1", 1) == "magic" and plan.context_damage("bc:a-1", 2) is None
    assert plan.bad_key_ranks("tp-bad-3", 0) == (1, 0) and plan.bad_key_ranks("tp-bad-3", 1) == (1,)
    assert plan.engine_death_file == "/t/die-42" and plan != NO_FAULTS


@pytest.mark.parametrize("name,raw", [(CORRUPT_KV_ENV, "nocolon"), (CORRUPT_KV_ENV, "p:x"),
                                      (BAD_CONTEXT_ENV, "p:2"), (BAD_SHARD_KEY_ENV, "p:r:2"),
                                      (BAD_SHARD_KEY_ENV, "::")])
def test_a_malformed_entry_names_the_variable(name, raw):
    with pytest.raises(ValueError, match=name):
        FaultPlan.from_env({name: raw})
