"""The suite's own helpers (tests/support): bounded waits, free ports, the native switch."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket

import pytest
from support import native
from support.net import free_port, free_ports
from support.paths import ROOT, TESTS, child_env
from support.wait import async_wait_until, wait_until


def test_wait_until_returns_the_first_truthy_value():
    counter = itertools.count()
    assert wait_until(lambda: max(next(counter) - 2, 0), 5, "the counter past 2", interval=0.001) == 1


def test_wait_until_names_what_it_waited_for_and_the_last_value():
    with pytest.raises(AssertionError, match=r"timed out after 0.05 s waiting for the moon; last value: \[\]"):
        wait_until(lambda: [], 0.05, "the moon", interval=0.01)


def test_wait_until_retries_only_the_named_exceptions():
    calls = itertools.count()

    def flaky() -> str:
        if next(calls) < 2:
            raise ConnectionError("not yet")
        return "up"

    assert wait_until(flaky, 5, "the server", interval=0.001, retry_on=(ConnectionError,)) == "up"
    with pytest.raises(AssertionError, match=r"last call raised ConnectionError\('down'\)"):
        wait_until(lambda: (_ for _ in ()).throw(ConnectionError("down")), 0.05, "x", interval=0.01,
                   retry_on=(ConnectionError,))
    with pytest.raises(KeyError):
        wait_until(lambda: {}["k"], 5, "a key", retry_on=(ConnectionError,))


@pytest.mark.parametrize("timeout, interval, match", [(0, 0.1, "timeout must be > 0"), (1, 0, "interval must be > 0")])
def test_wait_until_refuses_unbounded_or_busy_waits(timeout, interval, match):
    with pytest.raises(ValueError, match=match):
        wait_until(lambda: True, timeout, "x", interval=interval)


def test_async_wait_until_awaits_what_the_predicate_returns():
    async def main() -> int:
        state = {"n": 0}

        async def bump() -> int:
            state["n"] += 1
            return state["n"] >= 3 and state["n"]

        return await async_wait_until(bump, 5, "three calls", interval=0.001)

    assert asyncio.run(main()) == 3
    with pytest.raises(AssertionError, match="waiting for never; last value: 0"):
        asyncio.run(async_wait_until(lambda: 0, 0.05, "never", interval=0.01))


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    for port in [*ports, free_port()]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_paths_and_child_env():
    assert (ROOT / "pyproject.toml").is_file() and TESTS == ROOT / "tests"
    env = child_env(EXTRA="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT) and env["EXTRA"] == "1"


def test_native_switch_skips_without_it_and_fails_with_it():
    before = native.required()  # this run's --require-native, put back at the end
    try:
        native.set_required(False)
        assert native.skip_unless_built(False, "X", "not built").name == "skipif"
        assert native.with_cpu(False, "not built") == ["torch"]
        assert native.with_cpu(True, None) == ["torch", "cpu"]
        native.set_required(True)
        with pytest.raises(native.NativeMissing, match="X is not available under --require-native: not built"):
            native.skip_unless_built(False, "X", "not built")
        with pytest.raises(native.NativeMissing, match="the C attention backend"):
            native.with_cpu(False, "No module named '_cpu_kernels'")
    finally:
        native.set_required(before)
