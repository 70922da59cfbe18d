#!/usr/bin/env bash
# Dunning's enrolment statements at a steady state, SQL only, on the bed's Postgres
# (docs/adr/0063): N invoices in dunning (a declined attempt and a run each) and M open
# automatic invoices never attempted, so nothing is enrollable. Prints, per round, the
# EXPLAIN ANALYZE execution time in ms of each shape (inside a rolled-back transaction):
#   before         the two statements before docs/adr/0063
#   counted        the same with `attempt_count > 0` (what enrol.rs runs)
#   one-statement  the candidates read once in a CTE (measured, not kept)
# The statements are enrol.rs's with the fence left out and the defaults inlined.
# From the repository root after a build:
#   scripts/bed run benches/sql/enrolment/run.sh [ROUNDS]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
rounds=${1:-3}
q() { psql -X -q -h "$host" -p "$port" -U postgres "$@"; }
# counted: before.sql with the filter enrol.rs adds to both statements.
sed "s/AND i.collection_method = 'automatic'$/& AND i.attempt_count > 0/" "$here/before.sql" \
  > /tmp/enrolment-counted.sql
path() { [ "$1" = counted ] && echo /tmp/enrolment-counted.sql || echo "$here/$1.sql"; }
ms() { q -d "$1" -f "$(path "$2")" | awk '/Execution Time/ { s += $3 } END { printf "%.1f", s }'; }
for nm in "20000 0" "20000 100000" "100000 100000" "1000 200000"; do
  set -- $nm
  db="enrol_$1_$2"
  q -d postgres -c "CREATE DATABASE $db" >/dev/null
  url="postgres://postgres@$host:$port/$db"
  DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
  q -d "$db" -v n="$1" -v m="$2" -f "$here/seed.sql" >/dev/null
  for round in $(seq 1 "$rounds"); do
    echo "$1 in dunning, $2 never attempted, round $round:" \
      "before $(ms "$db" before) ms, counted $(ms "$db" counted) ms," \
      "one-statement $(ms "$db" one-statement) ms"
  done
  q -d postgres -c "DROP DATABASE $db" >/dev/null
done
