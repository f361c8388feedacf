"""Nodes never mutate engine state directly (issue 30): the way in is EngineThread (generate, abort,
call, submit, wake, shutdown) and the connectors (pdserve.engine.kv_connector: hooks out, typed
events back); an `LLMEngine` itself is only read.

Every module of the rooms that serve an engine (kv_messenger, decode_node, prefill_node, router,
pdserve/serving) is read with `ast`. An engine reference is `<x>.engine.engine` (EngineThread's
engine), a name or attribute assigned one, or a parameter annotated `LLMEngine`; on it only the
read-only members below may be used. And no call in those rooms names one of LLMEngine's own
mutating methods on anything at all (which catches an engine passed around under another name).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_ROOMS = ("kv_messenger", "decode_node", "prefill_node", "router", "pdserve/serving")

# what a node may read of an engine (queries and frozen snapshots; none changes its state)
READ_ONLY = frozenset({
    "info", "metrics", "load", "last_load", "get_request", "unfinished_requests", "block_table", "tokenize",
    "has_unfinished_requests", "has_schedulable_work", "quarantined_blocks", "holds_pages", "check_integrity",
    "num_unfinished_requests", "num_held_requests", "num_quarantines", "num_quarantined_blocks",
    "num_soft_resets", "num_offloads", "num_steps", "num_generated_tokens", "num_prompt_tokens_computed",
    "tokenizer", "eos_token_ids", "max_model_len", "config", "source", "arch", "kv_cache", "tp_plan",
})


def engine_methods() -> frozenset[str]:
    """LLMEngine's public methods and properties, read from its source."""
    tree = ast.parse((ROOT / "pdserve/engine/llm_engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    return frozenset(n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))


MUTATORS = engine_methods() - READ_ONLY


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _is_engine_thread_engine(node: ast.AST) -> bool:
    """`engine.engine`, `self.engine.engine`, `node.engine.engine`: an EngineThread's engine."""
    if not (isinstance(node, ast.Attribute) and node.attr == "engine"):
        return False
    owner = _dotted(node.value)
    return owner is not None and owner.split(".")[-1] == "engine"


def violations(source: str) -> list[str]:
    """Each use of an engine internal in `source`: 'line: what'."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):   # names and attributes that hold an engine
        if isinstance(node, ast.Assign) and _is_engine_thread_engine(node.value):
            aliases.update(d for d in map(_dotted, node.targets) if d is not None)
        if isinstance(node, ast.arg) and node.annotation is not None and "LLMEngine" in ast.unparse(node.annotation):
            aliases.add(node.arg)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            ref = _is_engine_thread_engine(node.value) or _dotted(node.value) in aliases
            if ref and node.attr not in READ_ONLY:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            found.append(f"{node.lineno}: {ast.unparse(node.func)}()")
    return sorted(set(found))


def node_modules() -> list[Path]:
    return sorted(p for room in NODE_ROOMS for p in (ROOT / room).rglob("*.py"))


def test_the_engine_has_mutators_to_guard():
    assert {"add_request", "abort_request", "step", "apply_kv_events"} <= MUTATORS


@pytest.mark.parametrize("path", node_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_node_module_mutates_an_engine(path: Path):
    assert violations(path.read_text()) == [], f"{path.relative_to(ROOT)} reaches into an LLMEngine"


@pytest.mark.parametrize("snippet, what", [
    ("self.engine.engine.scheduler.waiting.clear()", "self.engine.engine.scheduler"),
    ("llm = self.engine.engine\nllm.cache_manager.free(r)", "llm.cache_manager"),
    ("self.llm = node.engine.engine\nself.llm._tracked.pop(rid)", "self.llm._tracked"),
    ("def f(e: LLMEngine):\n    e.pool.free([1])", "e.pool"),
    ("def f(anything):\n    anything.apply_kv_events()", "anything.apply_kv_events()"),
    ("self.engine.engine.step()", "self.engine.engine.step"),
    ("async def f(engine):\n    engine.engine.preemptor.relieve([])", "engine.engine.preemptor"),
])
def test_the_checker_catches_a_node_reaching_into_the_engine(snippet, what):
    assert any(what in v for v in violations(textwrap.dedent(snippet))), violations(snippet)


def test_the_code_before_the_connector_events_fails_it():
    """Before issue 30's events, the decode side freed and re-admitted requests itself."""
    old = """
    def _checksum_failed(self, rid):
        llm = self.engine.engine
        r = llm.get_request(rid)
        llm.kv_retry(rid)
    def _release(self, q):
        self.engine.engine.release_quarantine(q.quarantine_id)
    """
    assert violations(textwrap.dedent(old)) == ["5: llm.kv_retry", "7: self.engine.engine.release_quarantine"]


def test_reads_and_the_engine_thread_pass():
    ok = """
    llm = self.engine.engine
    info, n = llm.info(), llm.num_quarantines
    async def f(self):
        await self.engine.call(self.rotate)
        self.engine.submit(lambda: None)
        async for out in self.engine.generate(ids, params, rid):
            pass
    """
    assert violations(textwrap.dedent(ok)) == []
