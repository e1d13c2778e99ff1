#!/usr/bin/env bash
# Run a command with a Cloud Spanner emulator: start gateway_main (which
# starts emulator_main) on free ports in its own process group, wait until
# both answer, export where they are, run the command, and stop the whole
# group by pid on exit, also when the command fails.
#
#   tests/with-spanner-emulator.sh cargo test --profile bench
#
# Exports SPANNER_EMULATOR_HOST (gRPC, read by Google's client) and
# ONCEQ_SPANNER_ADMIN_ENDPOINT (REST admin, gateway_main).
set -euo pipefail

dir="${SPANNER_EMULATOR_DIR:-}"
if [ -z "$dir" ]; then
  main=$(dpkg -L google-cloud-cli-spanner-emulator 2>/dev/null | grep '/emulator_main$' | head -n1 || true)
  [ -n "$main" ] || { echo "error: the Cloud Spanner emulator is not installed (Debian package google-cloud-cli-spanner-emulator)" >&2; exit 1; }
  dir=$(dirname "$main")
fi

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
grpc=$(free_port)
http=$(free_port)
log="${TMPDIR:-/tmp}/onceq-spanner-emulator.$$.log"

setsid "$dir/gateway_main" --hostname 127.0.0.1 --grpc_port "$grpc" --http_port "$http" \
  --grpc_binary "$dir/emulator_main" ${SPANNER_EMULATOR_ARGS:-} >"$log" 2>&1 &
pid=$!
stop() {
  kill -TERM -- "-$pid" 2>/dev/null || true
  sleep 0.2
  kill -KILL -- "-$pid" 2>/dev/null || true
}
trap stop EXIT

for port in "$grpc" "$http"; do
  for _ in $(seq 1 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
    if ! kill -0 "$pid" 2>/dev/null; then echo "error: the emulator exited; log:" >&2; cat "$log" >&2; exit 1; fi
    sleep 0.1
  done
done
echo "spanner emulator: grpc 127.0.0.1:$grpc, admin http://127.0.0.1:$http (pid $pid, log $log)" >&2

export SPANNER_EMULATOR_HOST="127.0.0.1:$grpc"
export ONCEQ_SPANNER_ADMIN_ENDPOINT="http://127.0.0.1:$http"
"$@"
