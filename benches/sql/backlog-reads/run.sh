#!/usr/bin/env bash
# Postgres CPU of one backlog read per role with 1,000,000 rows waiting in each queue,
# none due (docs/adr/0138): each read as the role sends it, ten runs, before and after a
# VACUUM, autovacuum off on the three tables so that only the VACUUM sets their
# visibility maps. CPU is summed over every Postgres process from /proc, parallel workers
# included through their parent's reaped-children times. Prints ms of Postgres CPU and
# of wall time per read.
# Run from the repository root after a build:
#   scripts/bed run benches/sql/backlog-reads/run.sh
set -euo pipefail
hc=${HARDCOUNT_BIN:-${CARGO_TARGET_DIR:-target}/debug/hardcount}
host=${HARDCOUNT_TEST_PG%:*}
port=${HARDCOUNT_TEST_PG#*:}
q() { psql -X -q -h "$host" -p "$port" -U postgres "$@"; }
db=backlog_reads
runs=10
q -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null
q -d postgres -c "CREATE DATABASE $db" >/dev/null
trap 'q -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null' EXIT
url="postgres://postgres@$host:$port/$db"
DATABASE_URL=$url MIGRATION_DATABASE_URL=$url "$hc" migrate >/dev/null
q -d $db >/dev/null <<'SQL'
\set ON_ERROR_STOP on
ALTER TABLE webhook_events SET (autovacuum_enabled = off);
ALTER TABLE webhook_deliveries SET (autovacuum_enabled = off);
ALTER TABLE email_outbox SET (autovacuum_enabled = off);
INSERT INTO webhook_endpoints (tenant_id, url, secret)
SELECT 't', 'http://127.0.0.1/' || g, 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw' FROM generate_series(1, 5) g;
-- The outbox's backlog: 1,000,000 events not dispatched.
INSERT INTO webhook_events (tenant_id, event_type, payload)
SELECT 't', 'invoice.paid', jsonb_build_object('invoice', g, 'amount', 1999) FROM generate_series(1, 1000000) g;
-- The delivery role's: 1,000,000 deliveries (200,000 events x 5 endpoints) pending, due
-- in an hour or more.
INSERT INTO webhook_deliveries (tenant_id, event_id, endpoint_id, next_attempt_at, attempts, created_at)
SELECT 't', e.id, p.id, now() + interval '1 hour' + (e.id % 3600) * interval '1 second', 3,
       now() - interval '2 hours'
FROM webhook_events e CROSS JOIN webhook_endpoints p WHERE e.id > 2000 AND e.id <= 202000;
-- The email role's: 1,000,000 emails queued, due in an hour or more.
INSERT INTO email_outbox (tenant_id, message_id, sender, recipients, subject, text_body,
                          html_body, next_attempt_at, created_at)
SELECT 't', '<' || g || '@x>', 'billing@example.com', ARRAY['a' || g || '@example.org'],
       'Receipt ' || g, repeat('x', 600), repeat('y', 900),
       now() + interval '1 hour' + (g % 3600) * interval '1 second', now() - interval '1 hour'
FROM generate_series(1, 1000000) g;
ANALYZE;
SQL
# The three reads as crates/*/src/store (backlog) send them; the outbox's under the planner
# settings of db::Db::begin_index_driven.
delivery="SELECT p.pending, (SELECT count(*) FROM webhook_deliveries WHERE status = 'dead') AS dead, coalesce(extract(epoch FROM now() - p.oldest_created), 0)::float8 AS oldest, coalesce(extract(epoch FROM now() - p.oldest_due), 0)::float8 AS oldest_due, extract(epoch FROM now())::float8 AS read_at FROM (SELECT count(*) AS pending, min(created_at) AS oldest_created, min(next_attempt_at) FILTER (WHERE next_attempt_at <= now() AND (claimed_until IS NULL OR claimed_until <= now())) AS oldest_due FROM webhook_deliveries WHERE status = 'pending') p"
email="SELECT (SELECT count(*) FROM email_outbox WHERE status = 'queued') AS queued, (SELECT count(*) FROM email_outbox WHERE status = 'failed') AS failed, coalesce(extract(epoch FROM now() - (SELECT min(created_at) FROM email_outbox WHERE status = 'queued')), 0)::float8 AS oldest, extract(epoch FROM now())::float8 AS read_at"
outbox="SET enable_bitmapscan = off; SET enable_hashjoin = off; SET enable_mergejoin = off; SET enable_material = off; SET jit = off; SELECT count(*) AS waiting, coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest, extract(epoch FROM now())::float8 AS read_at FROM webhook_events WHERE dispatched_at IS NULL"
ticks=$(getconf CLK_TCK)
cpu() { { cat /proc/[0-9]*/stat 2>/dev/null || true; } | awk '$2=="(postgres)" {s+=$14+$15+$16+$17} END {print s}'; }
for state in "not vacuumed" "vacuumed"; do
  if [ "$state" = vacuumed ]; then q -d $db -c "VACUUM" >/dev/null; fi
  for r in delivery email outbox; do
    stmt=${!r}
    q -d $db -At -c "$stmt" >/dev/null
    c0=$(cpu); t0=$(date +%s%N)
    for _ in $(seq 1 $runs); do q -d $db -At -c "$stmt" >/dev/null; done
    c1=$(cpu); t1=$(date +%s%N)
    echo "$state, $r: per read Postgres CPU $(( (c1 - c0) * 1000 / ticks / runs )) ms, wall $(( (t1 - t0) / 1000000 / runs )) ms"
  done
done
