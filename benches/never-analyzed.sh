#!/usr/bin/env bash
# The money statements on tables never analyzed, over several sizes (docs/adr/0066).
# For each size runs the billing benchmark (close, charge with a third of the
# customers without a card, activate as many ended trials) and the dunning
# benchmark (retry as many runs), once with the tables analyzed after the seed
# and once with every table left unanalyzed (`--never-analyzed`), each under
# benches/plan-audit.sh. Prints, per run, the rates the benchmark measured and
# the statements slower than BOUND with the plan nodes that read beyond a batch;
# a statement that runs far slower unanalyzed than analyzed at some size is a
# plan the planner picked without statistics (as docs/adr/0065's charge claim
# did at 1,000 customers). From the repository root, after
#   cargo build --release -p benches --bins -p fake_provider
# run
#   benches/never-analyzed.sh [--bound 10ms] [--sizes "2 100 1000 10000"] [--tenants N] [--out DIR]
# (--tenants spreads billing's subscriptions over N tenants; dunning's runs stay one tenant's).
# Each run's audit and log are kept in DIR (default /tmp/never-analyzed).
set -euo pipefail
cd "$(dirname "$0")/.."
bound=10ms
sizes="2 100 1000 10000"
out=/tmp/never-analyzed
tenants=1
while [ $# -gt 0 ]; do
  case $1 in
    --bound) bound=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --tenants) tenants=$2; shift 2 ;;
    *) echo "usage: benches/never-analyzed.sh [--bound 10ms] [--sizes \"2 100\"] [--tenants N] [--out DIR]" >&2; exit 2 ;;
  esac
done
bin=${CARGO_TARGET_DIR:-target}/release
for b in billing dunning fake_provider; do
  [ -x "$bin/$b" ] || { echo "no $bin/$b: build with cargo build --release -p benches --bins -p fake_provider" >&2; exit 2; }
done
mkdir -p "$out"

run() { # name, then the benchmark and its arguments
  local name=$1; shift
  echo "== $name ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))"
  if ! PLAN_AUDIT_LOG="$out/$name.pg.log" benches/plan-audit.sh --bound "$bound" -- \
      "$@" --out-dir "$out/$name" > "$out/$name.txt" 2>&1; then
    echo "FAILED: see $out/$name.txt"; tail -5 "$out/$name.txt"; return 0
  fi
  grep -E 'billed|charged|activated|runs in' "$out/$name.txt" | sed 's/^/  /'
  sed -n '/^ *calls /,$p' "$out/$name.txt" | head -12 | sed 's/^/  /'
}

for n in $sizes; do
  for mode in analyzed never-analyzed; do
    flag=(); [ "$mode" = never-analyzed ] && flag=(--never-analyzed)
    run "billing-$n-$mode" "$bin/billing" --subscriptions "$n" --without-card $((n / 3)) \
      --ended-trials "$n" --tenants "$tenants" --provider-bin "$bin/fake_provider" "${flag[@]}"
    run "dunning-$n-$mode" "$bin/dunning" --runs "$n" "${flag[@]}"
  done
done
