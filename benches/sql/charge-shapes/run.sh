#!/usr/bin/env bash
# The charge shapes of docs/adr/0057 ("measured before building it"), SQL only, on the
# bed's Postgres: N open automatic invoices (default 20,480, 80 batches of 256) per
# database, each charged once.
#   today   the claim writes the attempt and a new invoice version (lease, count); the
#           settle a second invoice version and the attempt's outcome; two events and
#           a receipt email per charge
#   queue   the claim deletes the batch from a queue table and writes the attempt with
#           the lease on it; the settle writes the invoice once; the same events and
#           email. The queue's rows are inserted before the clock (in the redesign the
#           billing closing would insert them); that insert is timed on its own.
#   today-lean  today without invoices_tenant_created (migration 0040)
#   hot-FF  today-lean whose claim writes no indexed invoice column (the lease's index and
#           the never-attempted index dropped, the count moved to the settle), the
#           invoices at fillfactor FF, so that the claim's version can be HOT
#   today-nofk  today-lean without the attempts' foreign key to their invoice
#   today-nocheck  today-lean without the CHECK constraints of the four tables it writes
#   today-0051  today-lean without payment_attempts_one_paid_intent (the charge path's
#           schema before migration 0052, docs/adr/0122: 0051's index of operator-settled
#           attempts, which 0052 drops, takes no entry from a charge; today-lean is the
#           schema since)
# HARDCOUNT_SHAPES="today today-0051" picks the shapes (default: the first three).
# Prints, per round and shape: the wall time in ms (one backend, one statement after
# another, so about its CPU), WAL bytes per charge, and invoices paid. The order of the
# shapes rotates from round to round and each database is dropped after its run; with
# autovacuum on, the vacuum of the databases before made whichever shape ran last the
# slowest, so run it with autovacuum off. From the repository root after a build:
#   HARDCOUNT_BED_PG_OPTS="-c autovacuum=off" \
#     scripts/bed run benches/sql/charge-shapes/run.sh [ROUNDS] [N]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
n=${2:-20480}
q() { psql -X -q -h "$host" -p "$port" -U postgres "$@"; }
timed() { # database, file: "T ms, W B of WAL per charge"
  q -d "$1" -At <<SQL
CHECKPOINT;
SELECT pg_current_wal_lsn() AS l0 \gset
SELECT clock_timestamp() AS t0 \gset
\o /dev/null
\i $2
\o
SELECT round(extract(epoch FROM clock_timestamp() - :'t0'::timestamptz) * 1000) || ' ms, '
       || round(pg_wal_lsn_diff(pg_current_wal_lsn(), :'l0') / $n.0) || ' B of WAL per charge';
SQL
}
read -r -a shapes <<< "${HARDCOUNT_SHAPES:-today queue today-lean}"
for round in $(seq 1 "${1:-3}"); do
  for k in $(seq 0 $(( ${#shapes[@]} - 1 ))); do
    shape=${shapes[$(( (round + k - 1) % ${#shapes[@]} ))]}
    db="charges_${round}_${shape//-/_}"
    q -d postgres -c "CREATE DATABASE $db" >/dev/null
    url="postgres://postgres@$host:$port/$db"
    DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
    if [ "${shape%%-*}" = hot ]; then
      # hot-FF: the invoices' fillfactor FF (default 100), set before billing's rows
      ff=${shape#hot}; ff=${ff#-}
      q -d "$db" -c "ALTER TABLE invoices SET (fillfactor = ${ff:-100})" >/dev/null
    fi
    q -d "$db" -v n="$n" -f "$here/setup.sql" >/dev/null
    if [ "${shape%%-*}" = hot ]; then
      q -d "$db" -c "DROP INDEX invoices_auto_charge_claims, invoices_charge_pending" >/dev/null
    fi
    if [ "$shape" != today ] && [ "$shape" != queue ]; then
      q -d "$db" -c "DROP INDEX IF EXISTS invoices_tenant_created" >/dev/null
    else
      q -d "$db" -c "CREATE INDEX IF NOT EXISTS invoices_tenant_created ON invoices (tenant_id, created_at)" >/dev/null
    fi
    if [ "$shape" = today-0051 ]; then
      q -d "$db" -c "DROP INDEX payment_attempts_one_paid_intent" >/dev/null
    fi
    if [ "$shape" = today-nofk ]; then
      q -d "$db" -c "ALTER TABLE payment_attempts DROP CONSTRAINT payment_attempts_invoice_same_tenant" >/dev/null
    fi
    if [ "$shape" = today-nocheck ]; then
      q -d "$db" -At -c "SELECT format('ALTER TABLE %s DROP CONSTRAINT %I;', conrelid::regclass, conname)
                         FROM pg_constraint WHERE contype = 'c' AND conrelid IN
                         ('invoices'::regclass, 'payment_attempts'::regclass,
                          'webhook_events'::regclass, 'email_outbox'::regclass)" \
        | q -d "$db" >/dev/null
    fi
    fill=""
    if [ "$shape" = queue ]; then
      echo "INSERT INTO charge_queue SELECT id FROM invoices ORDER BY id;" > "/tmp/charge-queue-fill.sql"
      fill=" (queue filled before: $(timed "$db" /tmp/charge-queue-fill.sql))"
    fi
    out=$(timed "$db" "$here/${shape%%-*}.sql")
    paid=$(q -d "$db" -At -c "SELECT count(*) FROM invoices WHERE status = 'paid'")
    echo "round $round, $shape: $out, $paid paid$fill"
    q -d postgres -c "DROP DATABASE $db" >/dev/null
  done
done
