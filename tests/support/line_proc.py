"""Talking to a helper process that answers one JSON line per JSON line it is sent (the fabric
fault tests' writers: tests/fabric/close_peer.py and the like).

    proc = subprocess.Popen([...], stdin=PIPE, stdout=PIPE, stderr=PIPE, text=True)
    ask(proc, {"warm": 1 << 20})          # -> {"warm": True}

Every read is bounded (`timeout`, seconds): TimeoutError when no line came, RuntimeError with the
tail of its stderr when the process exited instead.
"""

from __future__ import annotations

import json
import selectors
import subprocess


def read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line the process writes, within `timeout` seconds."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise TimeoutError(f"helper process {proc.pid}: no answer within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"helper process exited ({proc.wait(5)}): {proc.stderr.read()[-2000:]}")
    return json.loads(line)


def ask(proc: subprocess.Popen, cmd: dict, timeout: float = 30.0) -> dict:
    """Send one command line and read its answer."""
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    return read_line(proc, timeout)


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """End the helper: close its stdin (it exits on EOF), wait up to `timeout` s, then kill it."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
