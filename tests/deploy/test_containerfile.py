"""deploy/Containerfile (K3): linted always (it installs through the README's setup script, runs as a
non-root user, keeps the model cache on a volume, has `pdserve` as entrypoint, matches the
manifests' user and cache path); built only where a container builder answers."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve.tools import deploy

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):   # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Containerfile ends inside a continued line"
    return out


def values(ins: list[tuple[str, str]], word: str) -> list[str]:
    return [rest for w, rest in ins if w == word]


def env_of(ins: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in values(ins, "ENV"):
        for item in rest.split():
            name, sep, value = item.partition("=")
            assert sep, f"ENV {rest!r}: write ENV NAME=VALUE"
            env[name] = value
    return env


def test_the_containerfile_installs_as_the_readme_does_and_runs_unprivileged():
    ins = instructions(CONTAINERFILE.read_text())
    words = [w for w, _ in ins]
    assert words[0] in ("ARG", "FROM") and "FROM" in words
    assert values(ins, "FROM") == ["${BASE}"]
    assert any(a.startswith("BASE=debian:") for a in values(ins, "ARG")), "the default base is Debian (CPU)"
    assert any(a.startswith("TORCH=torch==") for a in values(ins, "ARG"))
    runs = values(ins, "RUN")
    assert any("bash scripts/setup.sh" in r for r in runs), "the image installs through scripts/setup.sh"
    for script in ("run.sh", "test.sh"):   # the README's two commands install through the same script
        assert "bash scripts/setup.sh" in (ROOT / "scripts" / script).read_text()
    # the torch the README names is the default the setup script installs, and the image's default
    default_torch = next(a for a in values(ins, "ARG") if a.startswith("TORCH=")).split("=", 1)[1]
    assert f'PDSERVE_TORCH:-{default_torch}' in (ROOT / "scripts" / "setup.sh").read_text()
    assert env_of(ins)["PDSERVE_TORCH"] == "${TORCH}"
    (user,) = values(ins, "USER")
    uid = user.split(":")[0]
    assert uid not in ("root", "0") and uid.isdigit(), f"USER {user}: run as a numeric non-root user"
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), "USER comes after every RUN"
    assert int(uid) == 10001   # the manifests' runAsUser
    (entrypoint,) = values(ins, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["pdserve"]
    env = env_of(ins)
    assert env["PDSERVE_CACHE_DIR"] == deploy.MODEL_CACHE
    assert json.loads(values(ins, "VOLUME")[0]) == [deploy.MODEL_CACHE]
    assert env["PATH"].startswith("/opt/pdserve/.venv/bin:"), "`python` in the manifests is the venv's"
    exposed = {int(p) for p in values(ins, "EXPOSE")[0].split()}
    assert {deploy.ROUTER_PORT, deploy.ROUTER_HTTP_PORT, deploy.NODE_METRICS_PORT, *deploy.ROLE_PORTS.values()} \
        <= exposed


def test_the_build_context_leaves_the_venv_and_git_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def _builder() -> str | None:
    for tool in ("podman", "docker"):
        if shutil.which(tool):
            try:
                ok = subprocess.run([tool, "info"], capture_output=True, timeout=30).returncode == 0
            except subprocess.TimeoutExpired:
                ok = False
            if ok:
                return tool
    return None


@pytest.mark.slow
def test_the_image_builds_and_its_entrypoint_runs():
    tool = _builder()
    if tool is None:
        pytest.skip("no container builder here (neither podman nor docker answers `info`)")
    tag = "pdserve-test:ci"
    build = subprocess.run([tool, "build", "-f", str(CONTAINERFILE), "-t", tag, str(ROOT)], capture_output=True,
                           text=True, timeout=3600)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([tool, "run", "--rm", tag, "deploy", "render", "--overlay", "1p1d"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "kind: LeaderWorkerSet" not in run.stdout and "kind: Deployment" in run.stdout
    whoami = subprocess.run([tool, "run", "--rm", "--entrypoint", "id", tag, "-u"], capture_output=True, text=True,
                            timeout=300)
    assert whoami.stdout.strip() == "10001"
