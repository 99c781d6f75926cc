#!/usr/bin/env bash
# The long fuzz of the server (issue 34): Schemathesis reads the server's own /openapi.json and
# runs every check (no 5xx, status codes, content types, headers, response schemas, schema-valid
# requests accepted and invalid ones refused, undeclared methods) with EXAMPLES generated cases per
# operation phase, on the demo model, on loopback. CI runs a short one (tests/python/test_openapi.py).
#     bash benches/fuzz_server.sh                 # EXAMPLES=1500: some 5,000 requests
#     EXAMPLES=2000 bash benches/fuzz_server.sh --seed 7
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8799}
LOG=${LOG:-$(mktemp -t fuzz_server.XXXXXX.log)}
"$PY" -m neo_rs.serve --model demo --port "$PORT" --num-gpu-blocks 1024 --max-model-len 128 \
    --max-num-seqs 16 >"$LOG" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
"$PY" - "$PORT" <<'PY'
import sys, time, urllib.request
deadline = time.monotonic() + 120
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1) as r:
            if r.status == 200:
                break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the server did not become ready")
    time.sleep(0.5)
PY
"$(dirname "$PY")/st" --config-file benches/schemathesis.toml run "http://127.0.0.1:$PORT/openapi.json" \
    --checks all --max-examples "${EXAMPLES:-1500}" --request-timeout 60 --no-color "$@"
# What the server answered (the health polls before it was ready aside), from its access log.
echo "server log: $LOG; responses by status:"
grep -v 'path=/health status=503' "$LOG" | grep -o ' status=[0-9]*' | sort | uniq -c
