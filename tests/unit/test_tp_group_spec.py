"""A tensor-parallel group's one config (GroupSpec, pdserve/parallel/worker.py): validated when
built, naming the offending value, and carried whole inside each rank's WorkerSpec over JSON."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.parallel.group import GroupSpec as GroupSpecOfTheLeader
from pdserve.parallel.worker import GroupSpec, WorkerSpec

GOOD = dict(model_path="/m", dtype="float32", kv_dtype="bfloat16", max_model_len=128, small_batch_max_tokens=0,
            tp_invariant=True, attention_backend="torch", num_blocks=8, page_size=16, num_layers=2, head_dim=16,
            kv_element_size=2, kv_populate=True, message_timeout_s=2.5)


def test_the_leader_and_the_workers_share_one_group_config():
    assert GroupSpecOfTheLeader is GroupSpec
    per_rank = {f.name for f in dataclasses.fields(WorkerSpec)} - {"group"}
    assert per_rank.isdisjoint(f.name for f in dataclasses.fields(GroupSpec))   # no field twice


def test_a_worker_spec_round_trips_through_json_with_its_group():
    ws = WorkerSpec(group=GroupSpec(**GOOD), rank=1, tp_size=2, port=1234, timeout_s=60.0, leader_pid=7,
                    pool_name="pdserve-kv-7-1-ab", pool_nbytes=4096, cpus=(0, 1), num_threads=2, ctrl_fd=5,
                    status_fd=6)
    back = WorkerSpec.from_json(ws.to_json())
    assert back == ws and isinstance(back.group, GroupSpec) and back.cpus == (0, 1)


@pytest.mark.parametrize("field,value,message", [
    ("dtype", "float8", r"dtype='float8', expected one of \['bfloat16', 'float16', 'float32'\]"),
    ("kv_dtype", "int8", r"kv_dtype='int8'"),
    ("num_blocks", 0, r"num_blocks=0, expected a positive int"),
    ("page_size", True, r"page_size=True, expected a positive int"),
    ("head_dim", 16.0, r"head_dim=16.0"),
    ("small_batch_max_tokens", -1, r"small_batch_max_tokens=-1, expected an int >= 0"),
    ("message_timeout_s", 0, r"message_timeout_s=0, expected > 0 s"),
])
def test_a_bad_group_config_is_refused_naming_the_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        GroupSpec(**{**GOOD, field: value})
