"""The kustomize tree of a deployment: a base rendering and one overlay per spec, each overlay the
base plus RFC 6902 JSON patches computed from the two renderings, so `kubectl kustomize
deploy/k8s/overlays/NAME` gives exactly `render(OVERLAYS[NAME])` (pdserve deploy tree; the specs are
pdserve.tools.deploy's). Threads: none; no blocking waits (it reads and writes files under a root).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from pdserve.tools.k8s.objects import render, to_yaml
from pdserve.tools.k8s.spec import DeploySpec

HEADER = "# Rendered by `pdserve deploy tree` from pdserve/tools/deploy.py: edit the spec there, not this file.\n"


def object_key(o: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name): what identifies an object in one namespace."""
    return (o["apiVersion"], o["kind"], o["metadata"]["name"])


def _file_name(o: Mapping[str, Any]) -> str:
    return f"{o['kind'].lower()}-{o['metadata']['name']}.yaml"


def _pointer(path: Sequence[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def json_patch(old: Any, new: Any, path: tuple[str | int, ...] = ()) -> list[dict[str, Any]]:
    """RFC 6902 operations that turn `old` into `new` (lists of equal length element by element,
    other lists replaced whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        ops: list[dict[str, Any]] = []
        for k in old:
            if k not in new:
                ops.append({"op": "remove", "path": _pointer((*path, k))})
        for k, v in new.items():
            if k not in old:
                ops.append({"op": "add", "path": _pointer((*path, k)), "value": v})
            else:
                ops += json_patch(old[k], v, (*path, k))
        return ops
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [op for i, (a, b) in enumerate(zip(old, new, strict=True)) for op in json_patch(a, b, (*path, i))]
    if old == new and type(old) is type(new):
        return []
    return [{"op": "replace", "path": _pointer(path), "value": new}]


def _target(o: Mapping[str, Any]) -> dict[str, str]:
    group, _, version = o["apiVersion"].rpartition("/")
    target = {"version": version, "kind": o["kind"], "name": o["metadata"]["name"]}
    if group:
        target = {"group": group, **target}
    return target


def render_tree(base_spec: DeploySpec, overlays: Mapping[str, DeploySpec]) -> dict[str, str]:
    """Relative path under deploy/k8s -> file text: base/ (`base_spec`) and overlays/NAME/ (one per
    `overlays` entry, see the module docstring)."""
    files: dict[str, str] = {}
    base = render(base_spec)
    for o in base:
        files[f"base/{_file_name(o)}"] = HEADER + to_yaml([o])
    files["base/kustomization.yaml"] = HEADER + yaml.safe_dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
         "resources": [_file_name(o) for o in base]}, sort_keys=False)
    base_by_key = {object_key(o): o for o in base}
    for name, spec in overlays.items():
        files.update(_overlay_files(name, base_by_key, render(spec)))
    return files


def _overlay_files(name: str, base_by_key: Mapping[tuple[str, str, str], Mapping[str, Any]],
                   objects: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """overlays/NAME/: the objects the base lacks, a patch per changed object, a delete per object
    only the base has, and the kustomization naming them."""
    files: dict[str, str] = {}
    by_key = {object_key(o): o for o in objects}
    resources: list[str] = ["../../base"]
    patches: list[dict[str, Any]] = []
    for key, o in base_by_key.items():
        if key not in by_key:
            patches.append({"patch": yaml.safe_dump({"$patch": "delete", "apiVersion": o["apiVersion"],
                                                     "kind": o["kind"], "metadata": {
                                                         "name": o["metadata"]["name"],
                                                         "namespace": o["metadata"]["namespace"]}},
                                                    sort_keys=False)})
    for key, o in by_key.items():
        if key not in base_by_key:
            files[f"overlays/{name}/{_file_name(o)}"] = HEADER + to_yaml([o])
            resources.append(_file_name(o))
            continue
        ops = json_patch(base_by_key[key], o)
        if ops:
            patch_file = f"patch-{_file_name(o)}"
            files[f"overlays/{name}/{patch_file}"] = HEADER + yaml.safe_dump(ops, sort_keys=False, width=120)
            patches.append({"path": patch_file, "target": _target(o)})
    kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                                     "resources": resources}
    if patches:
        kustomization["patches"] = patches
    files[f"overlays/{name}/kustomization.yaml"] = HEADER + yaml.safe_dump(kustomization, sort_keys=False,
                                                                            width=120)
    return files


def files_drift(root: Path, want: Mapping[str, str]) -> list[str]:
    """Files under `root` that differ from `want` (missing, changed, or not rendered any more)."""
    drift = [p for p, text in want.items() if not (root / p).is_file() or (root / p).read_text() != text]
    for sub in ("base", "overlays"):
        for path in sorted((root / sub).rglob("*.yaml")) if (root / sub).is_dir() else ():
            rel = path.relative_to(root).as_posix()
            if rel not in want:
                drift.append(rel)
    return sorted(drift)


def write_files(root: Path, want: Mapping[str, str]) -> list[str]:
    """Write `want` under `root`, removing rendered files no longer rendered; returns what changed."""
    changed = files_drift(root, want)
    for rel in changed:
        path = root / rel
        if rel in want:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(want[rel])
        else:
            path.unlink()
    return changed
