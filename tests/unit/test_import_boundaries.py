"""The layering law (DESIGN §2, issue 14): which room may import which, checked on every module.

Every `import` / `from ... import` statement of every module of ours is read with `ast`, wherever it
stands (module level, inside functions, under `if TYPE_CHECKING:`), and each edge between rooms must
be allowed below. A new room must be added here, with the rooms it may import.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# room -> the top-level module prefixes that belong to it (longest prefix wins)
ROOMS: dict[str, tuple[str, ...]] = {
    "api": ("pdserve",),                 # the package root: `from pdserve import LLM, SamplingParams`
    "engine": ("pdserve.engine",),
    "model": ("pdserve.model",),
    "kernels": ("pdserve.kernels",),
    "parallel": ("pdserve.parallel",),
    "serving": ("pdserve.serving",),
    "tools": ("pdserve.tools",),
    "fabric": ("fabric",),
    "kv_messenger": ("kv_messenger",),
    "prefill_node": ("prefill_node",),
    "decode_node": ("decode_node",),
    "router": ("router",),
    "wire": ("pdserve_api",),
}

# room -> rooms it may import (its own room is always allowed)
ALLOWED: dict[str, frozenset[str]] = {
    "kernels": frozenset(),
    "model": frozenset({"kernels"}),
    "parallel": frozenset({"model", "kernels"}),           # tensor-parallel ranks: never the engine
    "engine": frozenset({"model", "kernels", "parallel"}),  # never fabric, kv_messenger, the wire, nodes
    "api": frozenset({"engine"}),
    "serving": frozenset({"engine", "model", "wire"}),
    "fabric": frozenset(),                                 # knows nothing of ours
    "wire": frozenset(),                                   # the .proto contract, stubs, server helpers
    "kv_messenger": frozenset({"engine", "fabric", "wire"}),
    "prefill_node": frozenset({"engine", "serving", "kv_messenger", "wire"}),   # fabric only via kv_messenger
    "decode_node": frozenset({"engine", "serving", "kv_messenger", "wire"}),    # fabric only via kv_messenger
    "router": frozenset({"serving", "wire"}),              # holds no model and runs no engine
    "tools": frozenset(ROOMS) - {"tools"},                 # the outermost room; nothing imports it
}

SOURCE_DIRS = ("pdserve", "fabric", "kv_messenger", "prefill_node", "decode_node", "router", "proto/pdserve_api")


def room_of(module: str) -> str | None:
    best, best_len = None, -1
    for room, prefixes in ROOMS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = room, len(p)
    return best


@dataclass(frozen=True)
class Edge:
    path: str
    line: int
    source: str     # importing module
    target: str     # imported module


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "proto":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, path: str) -> list[Edge]:
    """Every import statement of a module's source (anywhere in it) as edges to absolute modules."""
    edges = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges += [Edge(path, node.lineno, module, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            edges.append(Edge(path, node.lineno, module, target))
            # `from pdserve import tools` names a submodule: count it too
            edges += [Edge(path, node.lineno, module, f"{target}.{a.name}") for a in node.names
                      if a.name != "*" and _is_our_module(f"{target}.{a.name}")]
    return edges


def _is_our_module(name: str) -> bool:
    for d in ("", "proto"):
        base = ROOT / d / Path(*name.split("."))
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def violations(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = room_of(e.source), room_of(e.target)
        if src is None or dst is None or src == dst:
            continue
        if src == "api" and e.target == "pdserve":
            continue
        if dst not in ALLOWED[src]:
            bad.append(f"{e.path}:{e.line}: {e.source} ({src}) imports {e.target} ({dst})")
    return bad


def all_edges() -> list[Edge]:
    edges = []
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if "_pb2" in path.name:   # generated stubs (they import only each other and protobuf)
                continue
            edges += imports_of(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py",
                                str(path.relative_to(ROOT)))
    return edges


def test_every_module_belongs_to_a_room():
    homeless = sorted({e.source for e in all_edges() if room_of(e.source) is None})
    assert not homeless, f"modules outside every room (add them to ROOMS): {homeless}"


def test_no_import_crosses_a_forbidden_boundary():
    bad = violations(all_edges())
    assert not bad, "imports that the layering forbids:\n" + "\n".join(bad)


def test_the_checker_sees_function_local_and_relative_imports():
    src = textwrap.dedent("""
        import torch
        def f():
            import fabric
            from kv_messenger.sender import KvSender
        class C:
            def g(self):
                from .. import tools
    """)
    edges = imports_of(src, "pdserve.engine.llm_engine", False, "pdserve/engine/llm_engine.py")
    bad = violations(edges)
    assert {int(b.split(":")[1]) for b in bad} == {4, 5, 8}, bad
    assert any("imports fabric (fabric)" in b for b in bad)
    assert any("kv_messenger.sender" in b for b in bad)
    assert any("pdserve.tools (tools)" in b for b in bad)


@pytest.mark.parametrize("source,target", [
    ("fabric.engine", "pdserve.engine.cache.hostmem"),         # fabric never allocates KV
    ("pdserve_api.servers", "kv_messenger.ticket"),            # the wire never depends on the messenger
    ("prefill_node.server", "decode_node.service"),            # the nodes meet only through the wire
    ("decode_node.service", "prefill_node.service"),
    ("prefill_node.service", "fabric"),                         # nodes reach the transport only through kv_messenger
    ("prefill_node.authz", "fabric.descriptors"),
    ("decode_node.service", "fabric.engine"),
    ("kv_messenger.sender", "prefill_node.service"),           # the messenger is used by nodes, not the reverse
    ("router.service", "pdserve.model.llama"),                 # the router holds no model
    ("router.service", "pdserve.engine.llm_engine"),
    ("pdserve.engine.llm_engine", "pdserve_api.v1.prefill_pb2"),
    ("pdserve.engine.runner", "pdserve.serving.metrics"),
    ("pdserve.kernels.ops.linear", "pdserve.model.layers"),
])
def test_forbidden_edges_are_caught(source, target):
    assert violations([Edge("x.py", 1, source, target)]), f"{source} -> {target} should be forbidden"


def _layout_table() -> dict[str, str]:
    """README's Layout table: folder cell -> its 'may import' cell."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in cells[0].replace("`", "").split(","):
                rows[name.strip().rstrip("/")] = cells[-1]
    return rows


def test_the_readme_layout_table_matches_the_tree():
    rows = _layout_table()
    for name in rows:
        assert (ROOT / name).exists(), f"README's Layout table names {name!r}, which is not in the tree"
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and any(p.rglob("*.py"))}
    rooms = {f"pdserve/{p.name}" for p in (ROOT / "pdserve").iterdir() if (p / "__init__.py").is_file()}
    missing = sorted((top - {"pdserve"} | rooms) - set(rows))
    assert not missing, f"folders with code that README's Layout table does not describe: {missing}"
    # the "may import" column says what ALLOWED says, for every room that is a folder
    folder_room = {"pdserve/engine": "engine", "pdserve/model": "model", "pdserve/kernels": "kernels",
                   "pdserve/parallel": "parallel", "pdserve/serving": "serving", "pdserve/tools": "tools",
                   "fabric": "fabric", "kv_messenger": "kv_messenger", "router": "router", "proto": "wire",
                   "prefill_node": "prefill_node", "decode_node": "decode_node"}
    assert set(folder_room.values()) == set(ROOMS) - {"api"}, "a room without a folder row here"
    names = {"engine": "engine", "model": "model", "kernels": "kernels", "parallel": "parallel",
             "serving": "serving", "wire": "wire", "fabric": "fabric", "kv_messenger": "kv_messenger"}
    for folder, room in folder_room.items():
        cell = rows[folder]
        if cell.strip() == "anything":
            assert ALLOWED[room] == frozenset(ROOMS) - {room}, (folder, cell, sorted(ALLOWED[room]))
            continue
        listed = {r for r, word in names.items() if word in cell.replace("nothing of ours", "")}
        assert listed == set(ALLOWED[room]) & set(names), (folder, cell, sorted(ALLOWED[room]))
