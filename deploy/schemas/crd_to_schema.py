"""Convert a CustomResourceDefinition's openAPIV3Schema into a strict JSON Schema (draft 2020-12).

    python deploy/schemas/crd_to_schema.py CRD.yaml VERSION OUT.json

Strict as `kubernetes-validate --strict` is for built-in kinds: every object that lists its
properties refuses unknown ones (`additionalProperties: false`) unless the CRD says
`x-kubernetes-preserve-unknown-fields`; `nullable` becomes a null type; `description` text is
dropped (the schemas stay small; the CRD itself has it). apiVersion and kind are pinned to the
CRD's group/version and kind. deploy/schemas/SOURCES.md says which upstream file each came from.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

_DROP = ("description", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type",
         "x-kubernetes-validations", "x-kubernetes-embedded-resource")


def strict(node: Any) -> Any:
    """The JSON Schema of one openAPIV3Schema node (recursively)."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = strict(value)
        elif key in ("nullable", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string"):
            continue
        else:
            out[key] = value
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in out and "additionalProperties" not in out and not node.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def convert(crd: dict[str, Any], version: str) -> dict[str, Any]:
    names = crd["spec"]["names"]
    group = crd["spec"]["group"]
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = strict(v["schema"]["openAPIV3Schema"])
            break
    else:
        raise SystemExit(f"{names['kind']} has no version {version!r}")
    schema.setdefault("properties", {})
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": names["kind"]}
    schema["properties"]["metadata"] = {"type": "object"}   # ObjectMeta: checked by the tests' own rules
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
    schema["additionalProperties"] = False
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": f"{names['kind']} {group}/{version}",
            **schema}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    source, version, out = argv
    with open(source) as f:
        crd = yaml.safe_load(f)
    with open(out, "w") as f:
        json.dump(convert(crd, version), f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
