#!/usr/bin/env bash
# Dunning's batch writes and billing's retry claim on tables never analyzed, SQL only, on
# the bed's Postgres (docs/adr/0066): the dunning benchmark's state at N runs, one batch
# of 500, each statement as the role ran it (today), with the batch's ids also bound as
# the target's condition (keyed), and with each row of the batch reaching its row in a
# LATERAL subquery (lateral, what the roles now run). Prints, per size and round, the EXPLAIN ANALYZE
# execution time in ms of the recover update and of the retry claim's locking read, on
# the tables never analyzed and then after an ANALYZE.
# From the repository root after a build:
#   scripts/bed run benches/sql/batch-joins/run.sh [ROUNDS] [SIZES]
# With PLANS=1 it prints the plans as well.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
rounds=${1:-3}
sizes=${2:-1000 10000 100000}
q() { psql -X -q -h "$host" -p "$port" -U postgres "$@"; }
times() { # db, shape: "recover ms, retry ms"
  local keyed=(); [ "$2" = keyed ] && keyed=(-v keyed=1); [ "$2" = lateral ] && keyed=(-v lateral=1)
  local out; out=$(q -d "$1" "${keyed[@]}" -f "$here/shapes.sql")
  [ "${PLANS:-}" = 1 ] && echo "$out" >&2
  echo "$out" | awk '/Execution Time/ { t[n++] = $3 } END { printf "recover %.1f ms, retry %.1f ms", t[0], t[1] }'
}
for n in $sizes; do
  db="batch_joins_$n"
  q -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null
  q -d postgres -c "CREATE DATABASE $db" >/dev/null
  url="postgres://postgres@$host:$port/$db"
  DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
  q -d "$db" -v n="$n" -f "$here/seed.sql" >/dev/null
  for stats in never-analyzed analyzed; do
    [ "$stats" = analyzed ] && q -d "$db" -c ANALYZE
    analyzed=$(q -d "$db" -At -c "SELECT count(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL OR last_autoanalyze IS NOT NULL")
    for round in $(seq 1 "$rounds"); do
      echo "$n runs, $stats ($analyzed tables analyzed), round $round:" \
        "today $(times "$db" today); keyed $(times "$db" keyed); lateral $(times "$db" lateral)"
    done
  done
  q -d postgres -c "DROP DATABASE $db" >/dev/null
done
