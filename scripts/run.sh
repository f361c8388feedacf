#!/usr/bin/env bash
# The main job: install everything (see setup.sh), start a local cluster (router + 1 prefill node
# + 1 decode node, default model, KV moved over libfabric shm), send it one request to show it
# answering, then keep serving on 127.0.0.1:${PDSERVE_PORT:-50051} until Ctrl-C.
# Arguments are passed to `pdserve up` (e.g. --prefill 1 --decode 2, --colocated 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT="${PDSERVE_PORT:-50051}"
.venv/bin/pdserve up --port "$PORT" "$@" &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP' INT TERM
# Wait until the router answers (the launcher itself waits for every node to be SERVING first).
for _ in $(seq 1 600); do
  if .venv/bin/python - "$PORT" <<'PY' 2>/dev/null; then break; fi
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
ch = grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}")
r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pdserve.api.v1.GenerateService"), timeout=1)
sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
PY
  kill -0 $UP 2>/dev/null || { wait $UP; exit $?; }
  sleep 1
done
echo "--- a request through the cluster: pdserve generate --url 127.0.0.1:$PORT --chat ..."
.venv/bin/pdserve generate --url "127.0.0.1:$PORT" --max-tokens 48 --chat "What is the capital of France? Answer in one sentence."
echo "--- the cluster keeps serving on 127.0.0.1:$PORT (Ctrl-C to stop)"
wait $UP
