#!/usr/bin/env bash
# The outcome insert planned once per session, measured and not built (docs/adr/0127,
# addendum of 2026-12-06): per round and variant, a freshly migrated database
# (setup.sql), then 20,400 deliveries inserted delivered by INSERT_OUTCOMES in groups
# of 510, one backend. Prints microseconds per row.
#   inline      the statement sent as the service sends it, planned at every call
#   fn_generic  the same statement in a PL/pgSQL function, its plan generic and kept
#   fn_auto     the same function, the plan cache left to choose
# HARDCOUNT_OUTCOME_VARIANTS picks variants (default: all three). From the repository root after a build:
#   scripts/bed run benches/sql/outcome-plans/run.sh [ROUNDS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
q() { psql -X -q -v ON_ERROR_STOP=1 -h "$host" -p "$port" -U postgres "$@"; }
for round in $(seq 1 "${1:-3}"); do
  for v in ${HARDCOUNT_OUTCOME_VARIANTS:-inline fn_generic fn_auto}; do
    db="outcome_plans_${round}_$v"
    q -d postgres -c "CREATE DATABASE $db" >/dev/null
    url="postgres://postgres@$host:$port/$db"
    DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
    q -d "$db" -f "$here/setup.sql" >/dev/null
    run=$here/run_inline.sql
    if [ "$v" != inline ]; then
      q -d "$db" -f "$here/fn_generic.sql" >/dev/null
      run=$here/run_fn.sql
    fi
    if [ "$v" = fn_auto ]; then
      q -d "$db" -c "ALTER FUNCTION hc_outcomes(text[], int8[], int8[], int4[], text[], float8[],
                       int4[], text[], int4[], text[], float8[]) SET plan_cache_mode = auto" >/dev/null
    fi
    out=$(q -d "$db" -At <<SQL
SELECT clock_timestamp() AS t0 \gset
\i $run
SELECT round(extract(epoch FROM clock_timestamp() - :'t0'::timestamptz) * 1e6 / 20400, 2)
       || ' us/row, ' || (SELECT count(*) FROM webhook_deliveries) || ' rows';
SQL
)
    echo "round $round, $v: $out"
    q -d postgres -c "DROP DATABASE $db" >/dev/null
  done
done
