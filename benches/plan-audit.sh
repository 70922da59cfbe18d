#!/usr/bin/env bash
# Which statements of a run planned a read of more than their batch (docs/adr/0060).
# Runs CMD on a bed whose Postgres logs, through auto_explain, every statement slower
# than BOUND (default 20ms) with its plan, then lists those statements by total time:
# calls, total and slowest ms, and the plan nodes that read, hash or sort beyond a
# batch (Seq Scan, Hash Join, Bitmap, Sort, Materialize). A Seq Scan of a table of a
# few rows is harmless; the plan itself is kept in the copied log. From the
# repository root, after a release build:
#   benches/plan-audit.sh [--bound 20ms] -- target/release/billing --subscriptions 30000 --out-dir /tmp/x
# The log is copied to ${PLAN_AUDIT_LOG:-/tmp/plan-audit.log}.
set -euo pipefail
cd "$(dirname "$0")/.."
bound=20ms
if [ "${1:-}" = --bound ]; then bound=$2; shift 2; fi
[ "${1:-}" = -- ] && shift
[ $# -gt 0 ] || { echo "usage: benches/plan-audit.sh [--bound 20ms] -- CMD [ARGS...]" >&2; exit 2; }
out=${PLAN_AUDIT_LOG:-/tmp/plan-audit.log}
HARDCOUNT_BED_PG_OPTS="${HARDCOUNT_BED_PG_OPTS:-} -c session_preload_libraries=auto_explain -c auto_explain.log_min_duration=$bound" \
  scripts/bed run bash -c '"$@"; status=$?; cp "$HARDCOUNT_BED_PG_LOG" "'"$out"'"; exit $status' plan-audit "$@"
python3 - "$out" <<'PY'
import collections, re, sys
log = open(sys.argv[1], errors="replace").read()
entries = re.split(r"\n(?=\S.*LOG:  duration: )", log)
stats = collections.defaultdict(list)
for e in entries:
    m = re.search(r"duration: ([0-9.]+) ms\s+plan:\s*\n\s*Query Text: (.*)", e)
    if not m:
        continue
    nodes = sorted({n for n in ("Seq Scan", "Hash Join", "Bitmap", "Sort", "Materialize") if n in e})
    stats[(m.group(2)[:100], ", ".join(nodes))].append(float(m.group(1)))
print(f"{'calls':>6} {'total ms':>9} {'max ms':>7}  nodes | statement")
for (text, nodes), ds in sorted(stats.items(), key=lambda kv: -sum(kv[1])):
    print(f"{len(ds):>6} {sum(ds):>9.0f} {max(ds):>7.0f}  {nodes or '-'} | {text}")
PY
