"""A receiving peer process for the fabric tests.

``PeerProcess`` starts an engine in a fresh interpreter (multiprocessing,
spawn) with a zeroed registered pool, and answers commands over a pipe:
expect tags, report which tags fired, digest ranges of the pool. Every call
has a timeout so that a broken peer fails the test instead of hanging it.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from fabric import FabricConfig, PageWrites, PeerDescriptor, RemoteDescriptor

CALL_TIMEOUT_S = 30.0


def digest(buf: memoryview, offset: int, length: int) -> str:
    return hashlib.blake2b(buf[offset : offset + length], digest_size=16).hexdigest()


def _serve(conn: Any, config: FabricConfig, pool_bytes: int, netns: str | None) -> None:
    from fabric import open_backend
    from pdserve.engine.cache.hostmem import alloc_buffer

    engine = open_backend(config)
    pool = alloc_buffer(pool_bytes)
    region = engine.register(pool.view)
    fired: dict[int, int] = {}
    fired_lock = threading.Lock()

    def on_complete(tag: int) -> None:
        with fired_lock:
            fired[tag] = fired.get(tag, 0) + 1

    conn.send((engine.peer_descriptor, region.descriptor, os.getpid()))
    while True:
        cmd, args = conn.recv()
        if cmd == "expect":
            for tag, count in args:
                engine.imm_counter.expect(tag, count, on_complete)
            conn.send(None)
        elif cmd == "fired":
            with fired_lock:
                conn.send(dict(fired))
        elif cmd == "wait_fired":
            tags, timeout = args
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with fired_lock:
                    if all(t in fired for t in tags):
                        break
                time.sleep(0.002)
            with fired_lock:
                conn.send(dict(fired))
        elif cmd == "landed":
            conn.send({t: engine.imm_counter.landed(t) for t in args})
        elif cmd == "cancel":
            conn.send(engine.imm_counter.cancel(args))
        elif cmd == "wait_peer_gone":
            peer, timeout = args
            conn.send(engine.wait_peer_gone(peer, timeout))
        elif cmd == "digests":
            with pool.view[:] as view:
                conn.send([digest(view, off, length) for off, length in args])
        elif cmd == "fill":
            seed = args
            rnd = hashlib.shake_256(str(seed).encode()).digest(1 << 16)
            for off in range(0, len(pool), len(rnd)):
                pool[off : off + len(rnd)] = rnd[: len(pool) - off]
            conn.send(None)
        elif cmd == "write":
            dst, src_offs, dst_offs, lens, tag = args
            done = threading.Event()
            result: list[Any] = []

            # bound now: a write that outlives its wait must not report into the next command's
            def ok(result: list[Any] = result, done: threading.Event = done) -> None:
                result.append("done")
                done.set()

            def failed(err: Exception, result: list[Any] = result, done: threading.Event = done) -> None:
                result.append(err)
                done.set()

            engine.write(PageWrites(region, src_offs, dst, dst_offs, lens, tag), ok, failed)
            conn.send(result[0] if done.wait(20) else TimeoutError("write did not complete"))
        elif cmd == "send":
            peer, payloads = args
            for payload in payloads:
                engine.send(peer, payload)
            conn.send(None)
        elif cmd == "deregister":
            engine.deregister(region)
            conn.send(None)
        elif cmd == "close_engine":
            engine.close()
            conn.send(None)
        elif cmd == "zero":
            pool[:] = bytes(len(pool))
            conn.send(None)
        elif cmd == "close":
            engine.close()
            conn.send(None)
            return
        else:
            conn.send(ValueError(f"unknown command {cmd!r}"))


@dataclass
class PeerProcess:
    """Handle on a receiving peer process."""

    process: Any
    conn: Any
    peer: PeerDescriptor
    descriptor: RemoteDescriptor
    pid: int

    @classmethod
    def start(cls, config: FabricConfig, pool_bytes: int) -> "PeerProcess":
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, config, pool_bytes, None), daemon=True)
        proc.start()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not parent.poll(0.05):
            if not proc.is_alive():
                raise RuntimeError(f"peer process exited with code {proc.exitcode} before starting")
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("peer process did not start")
        peer, desc, pid = parent.recv()
        return cls(proc, parent, peer, desc, pid)

    def call(self, cmd: str, args: Any = None, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.conn.send((cmd, args))
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"peer exited with code {self.process.exitcode} during {cmd!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer did not answer {cmd!r} within {timeout}s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.call("close", timeout=15)
            except (TimeoutError, EOFError, BrokenPipeError, ConnectionResetError):
                pass  # the process is killed below either way
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
