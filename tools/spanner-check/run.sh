#!/usr/bin/env bash
# The real-Spanner check kit (docs/src/spanner-check.md): onceq's payments
# example on a Cloud Spanner instance, several hosts killed and restarted at
# random while a producer sends, then drained and audited from the database,
# with Spanner's own lock and transaction statistics of the run.
#
#   DATABASE=projects/P/instances/I/databases/onceq-check \
#     tools/spanner-check/run.sh
#
# Settings (environment): HOSTS (3), SECONDS_TO_RUN (1800), RATE (orders a
# second the producer sends, 2000), ACCOUNTS (10000), SHARDS (32),
# KILL_EVERY (a host is SIGKILLed after up to this many seconds, 120),
# ONCEQ (the binary, target/release/onceq), GUEST (the payments component),
# WORK (a scratch folder). The database must not exist; it is created here
# and left for inspection (drop it with `gcloud spanner databases delete`).
#
# On the emulator (SPANNER_EMULATOR_HOST set, as tests/with-spanner-emulator.sh
# does) the same run works, without Spanner's statistics tables: `make test`
# runs it that way, briefly, so the kit does not rot.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
: "${DATABASE:?set DATABASE=projects/P/instances/I/databases/D (a database that does not exist yet)}"
HOSTS=${HOSTS:-3}
SECONDS_TO_RUN=${SECONDS_TO_RUN:-1800}
RATE=${RATE:-2000}
ACCOUNTS=${ACCOUNTS:-10000}
SHARDS=${SHARDS:-32}
KILL_EVERY=${KILL_EVERY:-120}
ONCEQ=${ONCEQ:-$root/target/release/onceq}
GUEST=${GUEST:-$root/guest-examples/target/wasm32-wasip2/release/payments.wasm}
WORK=${WORK:-$(mktemp -d -t onceq-spanner-check.XXXXXX)}
BALANCE=1000000

IFS=/ read -r _ project _ instance _ database <<<"$DATABASE"
if [[ -z "$project" || -z "$instance" || -z "$database" ]]; then
    echo "DATABASE must be projects/P/instances/I/databases/D, got $DATABASE" >&2
    exit 2
fi
for f in "$ONCEQ" "$GUEST"; do
    [[ -f "$f" ]] || { echo "missing $f (make build guests)" >&2; exit 2; }
done

emulator=""
if [[ -n "${SPANNER_EMULATOR_HOST:-}" ]]; then
    emulator=1
    # gcloud against the emulator's REST gateway, without credentials.
    export CLOUDSDK_AUTH_DISABLE_CREDENTIALS=true
    export CLOUDSDK_API_ENDPOINT_OVERRIDES_SPANNER="${ONCEQ_SPANNER_ADMIN_ENDPOINT:?}/"
    export CLOUDSDK_CORE_PROJECT="$project"
    # A configuration of its own, no update checks or usage reports.
    export CLOUDSDK_CONFIG="$WORK/gcloud"
    export CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK=true
    export CLOUDSDK_CORE_DISABLE_USAGE_REPORTING=true
fi

say() { printf '%s  %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# One SQL statement's rows, a line each, columns separated by commas.
sql() {
    timeout 120 gcloud spanner databases execute-sql "$database" --instance="$instance" --project="$project" \
        --format=json --sql="$1" |
        python3 -c 'import json, sys
for row in json.load(sys.stdin).get("rows", []):
    print(",".join("" if v is None else str(v) for v in row))'
}

# The one number a query returns.
number() {
    local n
    n=$(sql "$1" | tr -d '[:space:]')
    echo "${n:-0}"
}

say "work folder: $WORK"
mkdir -p "$WORK"
for i in $(seq 1 "$HOSTS"); do
    mkdir -p "$WORK/host-$i"
    cat >"$WORK/host-$i/onceq.toml" <<EOF
store = "spanner://$DATABASE"
schema = "$root/guest-examples/payments/schema.spanner.sql"

[spanner]
shards = $SHARDS

[[queue]]
name = "payments"
handler = "$GUEST"
tables = ["accounts", "orders"]
connectors = ["charge"]

[[connector]]
name = "charge"
kind = "file"
path = "charges.jsonl"

[admin]
listen = "127.0.0.1:0"
EOF
done
cd "$WORK/host-1"

say "creating $DATABASE"
"$ONCEQ" init
say "seeding $ACCOUNTS accounts"
step=5000
for ((from = 0; from < ACCOUNTS; from += step)); do
    to=$((from + step < ACCOUNTS ? from + step : ACCOUNTS))
    sql "INSERT INTO accounts (id, balance) SELECT CONCAT('acct-', CAST(x AS STRING)), $BALANCE FROM UNNEST(GENERATE_ARRAY($from, $((to - 1)))) AS x" >/dev/null
done

started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
deadline=$((SECONDS + SECONDS_TO_RUN))
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; pkill -P $$ 2>/dev/null || true; }
trap cleanup EXIT

# The producer: RATE orders a second, in one-second files.
producer() {
    local next=0
    while ((SECONDS < deadline)); do
        local t=$SECONDS
        awk -v from="$next" -v n="$RATE" -v accounts="$ACCOUNTS" 'BEGIN {
            for (i = from; i < from + n; i++)
                printf "{\"order_id\":\"o-%d\",\"account\":\"acct-%d\",\"amount\":%d}\n", i, i % accounts, 1 + i % 50
        }' >"$WORK/orders.part"
        "$ONCEQ" send -c "$WORK/host-1/onceq.toml" payments --jsonl "$WORK/orders.part" >/dev/null
        next=$((next + RATE))
        echo "$next" >"$WORK/sent"
        while ((SECONDS == t)); do sleep 0.1; done
    done
}

# A host: `onceq run`, SIGKILLed after a random time, started again.
host() {
    local dir=$1 kills=0
    cd "$dir"
    while ((SECONDS < deadline)); do
        "$ONCEQ" run >>host.log 2>&1 &
        local pid=$!
        local life=$((1 + RANDOM % KILL_EVERY))
        while ((life > 0 && SECONDS < deadline)) && kill -0 "$pid" 2>/dev/null; do
            sleep 1
            life=$((life - 1))
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        kills=$((kills + 1))
    done
    echo "$kills" >kills
}

say "running $HOSTS hosts for ${SECONDS_TO_RUN}s, $RATE orders/s, a SIGKILL every 1-${KILL_EVERY}s per host"
producer &
pids+=($!)
for i in $(seq 1 "$HOSTS"); do
    host "$WORK/host-$i" &
    pids+=($!)
done
wait "${pids[@]}"
pids=()
sent=$(cat "$WORK/sent" 2>/dev/null || echo 0)
say "sent $sent orders; draining with one host"
(cd "$WORK/host-1" && timeout 3600 "$ONCEQ" run --until-empty >>host.log 2>&1)
ended=$(date -u +%Y-%m-%dT%H:%M:%SZ)

say "auditing"
fail=0
check() { # name, got, want
    if [[ "$2" == "$3" ]]; then
        echo "  ok    $1: $2"
    else
        echo "  FAIL  $1: $2, expected $3"
        fail=1
    fi
}
orders=$(number "SELECT COUNT(*) FROM orders")
charged=$(number "SELECT COALESCE(SUM(amount), 0) FROM orders WHERE status = 'charged'")
balances=$(number "SELECT SUM(balance) FROM accounts")
check "orders, each once" "$orders" "$sent"
check "money: balances + charged" "$((balances + charged))" "$((ACCOUNTS * BALANCE))"
check "queues drained (outbox too)" "$(number "SELECT COUNT(*) FROM onceq_messages")" 0
check "dead letters" "$(number "SELECT COUNT(*) FROM onceq_dead_letters")" 0
sql "SELECT CONCAT('charge-', id) FROM orders WHERE status = 'charged'" | sort >"$WORK/charged"
# The delivered keys (a line torn by a SIGKILL has none).
cat "$WORK"/host-*/charges.jsonl 2>/dev/null | grep -o '"idempotency_key":"[^"]*"' | cut -d'"' -f4 | sort >"$WORK/delivered" || true
check "every charge delivered" "$(comm -23 "$WORK/charged" <(sort -u "$WORK/delivered") | wc -l)" 0
echo "  info  deliveries beyond one per charge (at least once): $(($(wc -l <"$WORK/delivered") - $(sort -u "$WORK/delivered" | wc -l)))"
echo "  info  hosts killed: $(cat "$WORK"/host-*/kills | awk '{ n += $1 } END { print n + 0 }')"

if [[ -z "$emulator" ]]; then
    say "Spanner's statistics for $started .. $ended (10-minute intervals)"
    echo "-- transactions: attempts, aborts, average commit latency, by transaction shape"
    sql "SELECT INTERVAL_END, FPRINT, COMMIT_ATTEMPT_COUNT, COMMIT_ABORT_COUNT, AVG_COMMIT_LATENCY_SECONDS, READ_COLUMNS, WRITE_CONSTRUCTIVE_COLUMNS
         FROM SPANNER_SYS.TXN_STATS_TOP_10MINUTE
         WHERE INTERVAL_END BETWEEN '$started' AND TIMESTAMP_ADD('$ended', INTERVAL 10 MINUTE)
         ORDER BY COMMIT_ATTEMPT_COUNT DESC LIMIT 20"
    echo "-- lock waits: the row ranges transactions waited on most"
    sql "SELECT INTERVAL_END, ROW_RANGE_START_KEY, LOCK_WAIT_SECONDS
         FROM SPANNER_SYS.LOCK_STATS_TOP_10MINUTE
         WHERE INTERVAL_END BETWEEN '$started' AND TIMESTAMP_ADD('$ended', INTERVAL 10 MINUTE)
         ORDER BY LOCK_WAIT_SECONDS DESC LIMIT 20"
    echo "-- compare: aborts per commit with make sim's (docs/src/spanner.md)"
fi

if ((fail)); then
    say "FAILED (work folder and hosts' logs: $WORK)"
    exit 1
fi
say "passed (work folder: $WORK)"
