#!/usr/bin/env bash
# The main job: install everything (see setup.sh), start a local cluster (router + 1 prefill node
# + 1 decode node, default model, KV moved over libfabric shm), send it one gRPC request and one
# OpenAI-compatible HTTP request to show it answering, then keep serving until Ctrl-C: gRPC on
# 127.0.0.1:${PDSERVE_PORT:-50051}, HTTP on http://127.0.0.1:${PDSERVE_HTTP_PORT:-8000}/v1.
# Arguments are passed to `pdserve up` (e.g. --prefill 1 --decode 2, --colocated 2); set the ports
# with PDSERVE_PORT and PDSERVE_HTTP_PORT rather than --port / --http-port.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT="${PDSERVE_PORT:-50051}"
HTTP_PORT="${PDSERVE_HTTP_PORT:-8000}"
.venv/bin/pdserve up --port "$PORT" --http-port "$HTTP_PORT" "$@" &
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
echo "--- an OpenAI-compatible HTTP request: POST http://127.0.0.1:$HTTP_PORT/v1/chat/completions"
BODY='{"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
       "max_tokens": 48, "temperature": 0}'
if command -v curl >/dev/null; then
  curl -sS "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" -H "Content-Type: application/json" -d "$BODY"
else  # no curl on this machine: the same request with Python's standard library
  .venv/bin/python - "$HTTP_PORT" "$BODY" <<'PY'
import sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", data=sys.argv[2].encode(),
                             headers={"Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=300).read().decode())
PY
fi
echo
echo "--- the cluster keeps serving: gRPC on 127.0.0.1:$PORT, HTTP on http://127.0.0.1:$HTTP_PORT/v1 (Ctrl-C to stop)"
wait $UP
