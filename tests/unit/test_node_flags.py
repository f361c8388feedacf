"""Both node servers take the same node flags with defaults that pair (issue 14: started by hand
with their defaults, a prefill node and a decode node can talk), and the engine flags come from the
config dataclasses (their defaults are the configs')."""

from __future__ import annotations

import dataclasses

import pytest

from decode_node.__main__ import build_parser as decode_parser, make as make_decode
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.serving import engine_args
from pdserve.serving.node_server import DECODE_PORT, PREFILL_PORT
from prefill_node.__main__ import build_parser as prefill_parser, make as make_prefill


def test_default_nodes_pair_up():
    p = prefill_parser().parse_args([])
    d = decode_parser().parse_args(["--prefill", f"127.0.0.1:{PREFILL_PORT}"])
    assert p.provider == d.provider and p.fabric_node == d.fabric_node
    assert (p.port, d.port) == (PREFILL_PORT, DECODE_PORT)
    prefill, decode = make_prefill(p), make_decode(d)
    assert prefill.node_id == f"prefill-{PREFILL_PORT}" and decode.node_id == f"decode-{DECODE_PORT}"
    assert prefill.options.port == PREFILL_PORT and decode.options.port == DECODE_PORT


def test_node_flags_are_the_same_on_both_kinds():
    def node_flags(parser):
        (group,) = [g for g in parser._action_groups if g.title == "node"]
        return {a.option_strings[0]: a.default for a in group._group_actions if a.option_strings}

    prefill, decode = node_flags(prefill_parser()), node_flags(decode_parser())
    shared = {k: v for k, v in decode.items() if k in prefill}
    assert set(prefill) <= set(decode)
    assert {k: v for k, v in prefill.items() if k != "--port"} == {k: v for k, v in shared.items() if k != "--port"}


def test_engine_flags_default_to_the_configs():
    args = prefill_parser().parse_args([])
    assert engine_args.engine_config(args) == EngineConfig()
    for f in engine_args._FLAGS:
        field = f.field
        assert field.metadata.get("help"), f"{f.owner.__name__}.{f.name} has no help text"
        assert field.default is not dataclasses.MISSING


def test_engine_flags_set_the_config_fields():
    args = decode_parser().parse_args([
        "--colocated", "--page-size", "32", "--num-blocks", "99", "--max-batch-tokens", "64", "--scheduler",
        "prefill_first", "--no-prefix-cache", "--threads", "1", "--kv-cache-dtype", "bfloat16",
        "--cpu-offload-space", "0", "--small-batch-max-tokens", "8"])
    cfg = engine_args.engine_config(args)
    assert cfg.cache == CacheConfig(page_size=32, num_blocks=99, allow_block_sharing=False, kv_cache_dtype="bfloat16",
                                    cpu_offload_space=0)
    assert cfg.scheduler == SchedulerConfig(max_batch_tokens=64, scheduler_type="prefill_first")
    assert cfg.num_threads == 1 and cfg.small_batch_max_tokens == 8


def test_a_bad_engine_flag_is_refused_with_its_value():
    args = prefill_parser().parse_args(["--page-size", "24"])
    with pytest.raises(ValueError, match="page_size must be a power of two, got 24"):
        engine_args.engine_config(args)
