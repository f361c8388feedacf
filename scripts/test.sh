#!/usr/bin/env bash
# Install everything (see setup.sh), then run the whole test suite. Extra arguments go to pytest
# (`bash scripts/test.sh -k cluster`, `bash scripts/test.sh -m unit`).
# First the linter (ruff, configured in pyproject.toml), then pytest.
# --require-native: setup.sh builds the C extensions, so a missing one is a failure here, never a
# quietly skipped C backend (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check --quiet .
exec .venv/bin/python -m pytest --require-native "$@"
