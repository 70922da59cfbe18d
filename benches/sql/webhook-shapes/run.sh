#!/usr/bin/env bash
# The write shapes of docs/adr/0052 ("measured before building it"), SQL only, on the
# bed's Postgres: 2,000 events x 5 endpoints (10,000 deliveries) per database.
#   today        fan-out of 500 events per statement, claims of 500 deliveries (a HOT
#                update each), outcomes in groups of 250 (a non-HOT update each)
#   from-events  claims of 100 events (a HOT lease on the event), then one statement per
#                50 events writes each delivery once, delivered, and stamps the events
#   from-events-lean  from-events without webhook_deliveries_finished (what partitioning by
#                time would let go)
#   preclaimed   the fan-out inserts each delivery already claimed (attempt 1, its lease;
#                docs/adr/0087), a read of them by id with their events and endpoints,
#                outcomes in groups of 250 as today
# HARDCOUNT_SHAPES picks shapes (default: all four).
# Prints, per round and shape: the shape's wall time in ms (one backend, one statement
# after another), WAL bytes per delivery, and deliveries written as delivered.
# Run from the repository root after a build:
#   scripts/bed run benches/sql/webhook-shapes/run.sh [ROUNDS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
q() { psql -X -q -h "$host" -p "$port" -U postgres "$@"; }
for round in $(seq 1 "${1:-3}"); do
  for shape in ${HARDCOUNT_SHAPES:-today from-events from-events-lean preclaimed}; do
    db="shapes_${round}_${shape//-/_}"
    q -d postgres -c "CREATE DATABASE $db" >/dev/null
    url="postgres://postgres@$host:$port/$db"
    DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
    q -d "$db" -f "$here/setup.sql" >/dev/null
    if [ "$shape" = from-events-lean ]; then
      q -d "$db" -c "DROP INDEX webhook_deliveries_finished" >/dev/null
    fi
    q -d "$db" -f "$here/enqueue.sql" >/dev/null
    file=$here/${shape%-lean}.sql
    out=$(q -d "$db" -At <<SQL
CHECKPOINT;
SELECT pg_current_wal_lsn() AS l0 \gset
SELECT clock_timestamp() AS t0 \gset
\o /dev/null
\i $file
\o
SELECT round(extract(epoch FROM clock_timestamp() - :'t0'::timestamptz) * 1000) || ' ms, '
       || round(pg_wal_lsn_diff(pg_current_wal_lsn(), :'l0') / 10000.0) || ' B of WAL per delivery, '
       || (SELECT count(*) FROM webhook_deliveries WHERE status = 'delivered') || ' delivered';
SQL
)
    echo "round $round, $shape: $out"
  done
done
