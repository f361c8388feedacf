"""Generate the Python stubs of the pdserve wire contract, reproducibly.

    python proto/generate.py          # rewrite the committed stubs next to the .proto files
    python proto/generate.py --check  # regenerate into a temporary folder; exit 1 listing stale files

Every ``proto/pdserve_api/v<N>/*.proto`` is compiled by ``grpc_tools.protoc`` with fixed flags,
paths relative to ``proto/`` (so the generated imports read ``from pdserve_api.v1 import ...`` and
never touch the ``pdserve`` package), in sorted order. The output is ``*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py``, committed; nothing is post-processed. Re-running gives byte-identical files as
long as the grpcio-tools version is the pinned one (the generated code names it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root: imports read "pdserve_api/v1/x.proto"
PACKAGE = "pdserve_api"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# The stubs in the repository were generated with this version; another one may produce other bytes.
GRPCIO_TOOLS_VERSION = "1.85.1"


def proto_files() -> list[Path]:
    """Every .proto of the package, relative to PROTO_ROOT, in a fixed order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE).rglob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """Generated files found under root/PACKAGE, relative to root."""
    found = [p for p in (root / PACKAGE).rglob("*") if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)]
    return sorted(p.relative_to(root) for p in found)


def generate(out_dir: Path) -> None:
    """Compile every .proto into out_dir (which mirrors PROTO_ROOT's layout)."""
    from grpc_tools import protoc

    well_known = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    protos = [p.as_posix() for p in proto_files()]
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE}")
    args = [
        "grpc_tools.protoc",
        "--proto_path=.",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    # Relative paths keep absolute paths of this machine out of the generated files.
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        rc = protoc.main(args)
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def _tools_version() -> str:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check() -> list[str]:
    """Regenerate into a temporary folder; return what differs from the committed stubs."""
    with tempfile.TemporaryDirectory(prefix="pdserve-proto-") as tmp:
        tmp_root = Path(tmp)
        generate(tmp_root)
        fresh = set(generated_files(tmp_root))
        committed = set(generated_files(PROTO_ROOT))
        stale = []
        for rel in sorted(fresh | committed):
            if rel not in committed:
                stale.append(f"{rel} (missing)")
            elif rel not in fresh:
                stale.append(f"{rel} (no .proto generates it any more)")
            elif (tmp_root / rel).read_bytes() != (PROTO_ROOT / rel).read_bytes():
                stale.append(f"{rel} (differs)")
        return stale


def write() -> list[Path]:
    """Regenerate in place, removing generated files that no .proto produces any more."""
    with tempfile.TemporaryDirectory(prefix="pdserve-proto-") as tmp:
        tmp_root = Path(tmp)
        generate(tmp_root)
        fresh = generated_files(tmp_root)
        for rel in set(generated_files(PROTO_ROOT)) - set(fresh):
            (PROTO_ROOT / rel).unlink()
        for rel in fresh:
            dst = PROTO_ROOT / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp_root / rel, dst)
        return fresh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args(argv)
    version = _tools_version()
    if version != GRPCIO_TOOLS_VERSION:
        print(
            f"warning: grpcio-tools {version} installed, the stubs are pinned to {GRPCIO_TOOLS_VERSION}; "
            f"install grpcio-tools=={GRPCIO_TOOLS_VERSION} for byte-identical output",
            file=sys.stderr,
        )
    if args.check:
        stale = check()
        if stale:
            print("stale generated stubs (run: python proto/generate.py):", file=sys.stderr)
            for line in stale:
                print(f"  {line}", file=sys.stderr)
            return 1
        print(f"stubs are current ({len(proto_files())} .proto files)")
        return 0
    for rel in write():
        print(f"wrote {(PROTO_ROOT / rel).relative_to(PROTO_ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
