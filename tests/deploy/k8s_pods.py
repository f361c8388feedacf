"""What the kubelet does with a rendered container, done here: its environment (literal values,
ConfigMap keys, the downward API), `$(VAR)` expansion in command and args, and the real argparse
parser of the module the command runs (so a flag renamed in the code but not in the manifests fails).
And what the LeaderWorkerSet controller adds to a group's leader pod: its labels (name, group
index, group key, worker index 0) and its environment (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE,
LWS_WORKER_INDEX), as kubernetes-sigs/lws's pod webhook sets them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.tools import deploy

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
MODULES = ("prefill_node", "decode_node", "router")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion: $(NAME) becomes NAME's value when defined (else stays as written), $$ is $."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)
    return _VAR.sub(sub, text)


def config_maps(objects: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


def container_env(container: Mapping[str, Any], objects: Sequence[Mapping[str, Any]],
                  fields: Mapping[str, str], injected: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it, in order (later entries may use earlier
    ones); `injected`: what a controller's webhook put first (lws_env)."""
    maps = config_maps(objects)
    env: dict[str, str] = dict(injected or {})
    for e in container.get("env", ()):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        source = e["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in maps, f"{e['name']}: no ConfigMap {ref['name']!r} in the manifests"
            assert ref["key"] in maps[ref["name"]], f"{e['name']}: ConfigMap {ref['name']} has no key {ref['key']!r}"
            env[e["name"]] = maps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in fields, f"{e['name']}: no value for the downward API field {path}"
            env[e["name"]] = fields[path]
        else:
            raise AssertionError(f"{e['name']}: unsupported env source {sorted(source)}")
    return env


@dataclass(frozen=True)
class Invocation:
    """One container's process: `python -m module args...` with its environment."""

    module: str
    args: tuple[str, ...]
    env: dict[str, str]


def invocation(container: Mapping[str, Any], objects: Sequence[Mapping[str, Any]],
               fields: Mapping[str, str], injected: Mapping[str, str] | None = None) -> Invocation:
    env = container_env(container, objects, fields, injected)
    command = [expand(c, env) for c in container["command"]]
    assert len(command) == 3 and command[1] == "-m" and command[2] in MODULES, \
        f"container {container['name']}: command {command} is not `python -m <{'|'.join(MODULES)}>`"
    args = tuple(expand(a, env) for a in container.get("args", ()))
    unexpanded = [a for a in args if "$(" in a]
    assert not unexpanded, f"container {container['name']}: args reference undefined variables: {unexpanded}"
    return Invocation(command[2], args, env)


def parser_of(module: str) -> argparse.ArgumentParser:
    return importlib.import_module(f"{module}.__main__").build_parser()


def parse(inv: Invocation) -> argparse.Namespace:
    """The module's real parser on the args; AssertionError with argparse's message if it refuses them."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser_of(inv.module).parse_args(list(inv.args))
        except SystemExit:
            pass
    raise AssertionError(f"python -m {inv.module} refuses {list(inv.args)}: {err.getvalue().strip()}")


def pod_templates(objects: Sequence[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(where, pod template) of every pod a workload makes: a Deployment's; a LeaderWorkerSet's leader
    (leaderTemplate, else workerTemplate) and, were its groups larger than 1, its workers'."""
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Deployment":
            yield name, o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            yield f"{name} leader", deploy.leader_template(o)
            if lwt.get("size", 1) > 1:
                yield f"{name} worker", lwt["workerTemplate"]


def lws_leader_name(lws: Mapping[str, Any], group: int) -> str:
    """A group's leader pod: the leader StatefulSet's pod of ordinal `group`."""
    return f"{lws['metadata']['name']}-{group}"


def lws_leader_labels(lws: Mapping[str, Any], group: int) -> dict[str, str]:
    """The labels of a group's leader pod: its template's and the controller's."""
    name = lws_leader_name(lws, group)
    return {**deploy.leader_template(lws)["metadata"]["labels"], deploy.LWS_NAME: lws["metadata"]["name"],
            deploy.LWS_GROUP_INDEX: str(group), deploy.LWS_WORKER_INDEX: "0",
            deploy.LWS_GROUP_KEY: hashlib.sha1(f"{lws['metadata']['namespace']}/{name}".encode()).hexdigest()}


def lws_env(lws: Mapping[str, Any], group: int) -> dict[str, str]:
    """The variables the controller puts in every container of a group's leader pod."""
    meta = lws["metadata"]
    return {"LWS_LEADER_ADDRESS": f"{lws_leader_name(lws, group)}.{meta['name']}.{meta['namespace']}",
            "LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"].get("size", 1)), "LWS_WORKER_INDEX": "0"}
