#!/usr/bin/env bash
# The main job: install everything (see setup.sh), then generate with the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pdserve generate --max-tokens 48 --chat "${@:-What is the capital of France? Answer in one sentence.}"
