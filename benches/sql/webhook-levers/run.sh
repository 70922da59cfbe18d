#!/usr/bin/env bash
# The levers of docs/adr/0126 (and deliveries-ff100, docs/adr/0127's addendum), SQL only,
# on the bed's Postgres: per round and lever, a freshly migrated database (setup.sql),
# the dispatched stamp of 2,000 events (stamp.sql), then 10,000 deliveries inserted
# delivered (insert.sql). Prints the stamp's time per event and the insert's per
# delivery, with WAL bytes, one backend.
#   shipped        the insert as INSERT_OUTCOMES makes it (no conflict clause), the
#                  tenant check as migration 0054 plans it
#   conflict       with ON CONFLICT (event_id, endpoint_id) DO NOTHING (INSERT_OUTCOMES_TOLERANT)
#   notexists      with WHERE NOT EXISTS instead
#   execute-check  the tenant check planned at every insert (migration 0017)
#   no-check       without the tenant check's trigger
#   no-finished    without webhook_deliveries_finished
#   fillfactor-50  the events at fillfactor 50
#   deliveries-ff100  the deliveries at fillfactor 100 (50 since migration 0011, room
#                  for the claim's HOT update of a pending row)
# HARDCOUNT_LEVERS picks levers (default: all). Run from the repository root after a build:
#   scripts/bed run benches/sql/webhook-levers/run.sh [ROUNDS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
q() { psql -X -q -v ON_ERROR_STOP=1 -h "$host" -p "$port" -U postgres "$@"; }
for round in $(seq 1 "${1:-3}"); do
  for lever in ${HARDCOUNT_LEVERS:-shipped conflict notexists execute-check no-check no-finished fillfactor-50 deliveries-ff100}; do
    db="levers_${round}_${lever//-/_}"
    q -d postgres -c "CREATE DATABASE $db" >/dev/null
    url="postgres://postgres@$host:$port/$db"
    DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
    form=plain
    case $lever in
      conflict|notexists) form=$lever ;;
      execute-check) q -d "$db" -f "$here/execute-check.sql" >/dev/null ;;
      no-check) q -d "$db" -c "DROP TRIGGER webhook_deliveries_same_tenant ON webhook_deliveries" >/dev/null ;;
      no-finished) q -d "$db" -c "DROP INDEX webhook_deliveries_finished" >/dev/null ;;
      fillfactor-50) q -d "$db" -c "ALTER TABLE webhook_events SET (fillfactor = 50)" >/dev/null ;;
      deliveries-ff100) q -d "$db" -c "ALTER TABLE webhook_deliveries SET (fillfactor = 100)" >/dev/null ;;
    esac
    q -d "$db" -f "$here/setup.sql" >/dev/null
    out=$(q -d "$db" -At <<SQL
SET lever.insert = '$form';
SELECT pg_current_wal_lsn() AS l0 \gset
SELECT clock_timestamp() AS t0 \gset
\i $here/stamp.sql
SELECT pg_current_wal_lsn() AS l1 \gset
SELECT clock_timestamp() AS t1 \gset
\i $here/insert.sql
SELECT 'stamp ' || round(extract(epoch FROM :'t1'::timestamptz - :'t0'::timestamptz) * 1e6 / 2000, 1)
       || ' us/event, ' || round(pg_wal_lsn_diff(:'l1', :'l0') / 2000.0) || ' B; insert '
       || round(extract(epoch FROM clock_timestamp() - :'t1'::timestamptz) * 1e6 / 10000, 2)
       || ' us/delivery, ' || round(pg_wal_lsn_diff(pg_current_wal_lsn(), :'l1') / 10000.0) || ' B';
SQL
)
    echo "round $round, $lever: $out"
    q -d postgres -c "DROP DATABASE $db" >/dev/null
  done
done
