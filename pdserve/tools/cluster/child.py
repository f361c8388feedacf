"""Starting a child process of a local cluster: it dies with the launcher and pins itself (K1).

Spawning (`spawn`): no preexec_fn. A preexec_fn makes subprocess run the launcher's Python at-fork
handlers around a real fork(), and gRPC's (with GRPC_ENABLE_FORK_SUPPORT) can block there for good
in a process whose gRPC threads are busy (a cluster test once hung inside Popen). Instead the child
sets itself up: it starts as `python -m pdserve.tools.launcher --parent-pid P [--cpus C] -m MODULE ARGS`
(`child_command`), which asks for PR_SET_PDEATHSIG, exits if the launcher is already gone, pins
itself with sched_setaffinity, and only then runs MODULE as __main__ (`child_main`), before any
thread of the child exists. Without a preexec_fn, Popen runs no Python code between fork and exec
(vfork where CPython can), so the launcher's gRPC state, fork support on or off, is never involved.
On Linux a child so gets SIGTERM when the launcher dies, and a killed test run leaves no orphans.

Threads: `spawn` and `child_command` run on the launcher's calling thread; `child_main` on the
child's main thread, before any other thread of it exists. No blocking waits.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.serving.channels import TOKEN_ENV


def child_env() -> dict[str, str]:
    """The environment of a child: unbuffered output, and this source tree importable (router,
    prefill_node and decode_node live beside pdserve/ and may postdate an editable install)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(TOKEN_ENV, None)   # a cluster's token is its own (auth_token), never one inherited by accident
    # The checkout this launcher runs from (pdserve/tools/cluster/child.py -> its parents[3]) goes
    # first on the children's path, so that a cluster started from a checkout (a worktree, a second
    # tree beside an editable install) runs that checkout's nodes and router. (It named pdserve/, the
    # launcher's parents[1], since the launcher moved into pdserve/tools/: never a checkout.)
    root = str(Path(__file__).resolve().parents[3])
    if (Path(root) / "router").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


PR_SET_PDEATHSIG = 1
CHILD_ENTRY = "pdserve.tools.launcher"  # `python -m pdserve.tools.launcher ...` runs child_main


def child_command(argv: Sequence[str], parent_pid: int, cpus: Sequence[int] = ()) -> list[str]:
    """The command line that runs `argv` ([python, "-m", MODULE, ARGS...] or [python, "-c", CODE,
    ARGS...]) as a child of the process `parent_pid`: the same interpreter starts `child_main`,
    which dies with that parent (Linux), runs on `cpus` when given, then runs MODULE (or CODE)."""
    if len(argv) < 3 or argv[1] not in ("-m", "-c"):
        raise ValueError(f"a child command must be [python, '-m', MODULE, ...] or [python, '-c', CODE, ...], "
                         f"got {list(argv)[:3]}")
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ValueError(f"cpus must be non-negative core numbers, got {list(cpus)}")
    wrapper = [argv[0], "-m", CHILD_ENTRY, "--parent-pid", str(parent_pid)]
    if cpus:
        wrapper += ["--cpus", ",".join(map(str, cpus))]
    return [*wrapper, *argv[1:]]


def spawn(argv: Sequence[str], cpus: Sequence[int] = (), **popen: object) -> subprocess.Popen:
    """Start `argv` (see child_command) as a child of this process that dies with it and runs on
    `cpus`; `popen` are subprocess.Popen's keyword arguments (never preexec_fn: see Spawning above)."""
    if "preexec_fn" in popen:
        raise ValueError("spawn sets the child up in the child itself; preexec_fn is not accepted")
    return subprocess.Popen(child_command(argv, os.getpid(), cpus), **popen)  # type: ignore[call-overload]


def _die_with_parent(parent_pid: int) -> None:
    """Child side (Linux): SIGTERM this process when its parent dies, even by SIGKILL, so a killed
    test run or `pdserve up` leaves no orphan nodes behind. (Tied to the parent's thread that
    spawned it: start clusters from a thread that outlives them.) If the parent died before the
    request took effect, no signal will come: exit now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, SIGTERM) failed: {os.strerror(err)}")
    if os.getppid() != parent_pid:
        raise SystemExit(f"pdserve child: launcher pid {parent_pid} exited before this child started "
                         f"(parent is now pid {os.getppid()}); exiting")


def child_main(argv: Sequence[str]) -> None:
    """`python -m pdserve.tools.launcher --parent-pid P [--cpus C1,C2] (-m MODULE | -c CODE) ARGS...`:
    set this process up (die with P on Linux; run on cores C), then run MODULE as __main__ (or
    CODE) with sys.argv as `python -m MODULE ARGS` would have it. Runs before any other thread of
    the child exists, so the affinity holds for every thread started later (torch's included)."""
    args = list(argv)
    parent_pid: int | None = None
    cpus: tuple[int, ...] = ()
    while args and args[0] in ("--parent-pid", "--cpus"):
        if len(args) < 2:
            raise SystemExit(f"pdserve child: {args[0]} needs a value")
        flag, value, args = args[0], args[1], args[2:]
        try:
            if flag == "--parent-pid":
                parent_pid = int(value)
            else:
                cpus = tuple(int(c) for c in value.split(","))
        except ValueError:
            raise SystemExit(f"pdserve child: {flag} {value!r} is not a number (list)") from None
    if parent_pid is None or len(args) < 2 or args[0] not in ("-m", "-c"):
        raise SystemExit("usage: python -m pdserve.tools.launcher --parent-pid PID [--cpus C1,C2] "
                         "(-m MODULE | -c CODE) [ARGS...]")
    if sys.platform == "linux":
        _die_with_parent(parent_pid)
    if cpus:
        os.sched_setaffinity(0, cpus)
    kind, target, rest = args[0], args[1], args[2:]
    if kind == "-m":
        sys.argv = [target, *rest]  # run_module puts the module's path in argv[0], as `python -m` does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
