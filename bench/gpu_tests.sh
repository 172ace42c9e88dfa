#!/usr/bin/env bash
# The kernel and model tests on the real Triton compiler, in parallel groups (on a GPU machine the
# suite's time is Triton compile time, one CPU core per pytest process), from the repository root:
#   bash bench/gpu_tests.sh NAME GROUPS LIMIT_S PYTEST_ARGS...
#   e.g. bash bench/gpu_tests.sh gsa 8 300 tests/ops/test_gsa_triton.py tests/models/test_gpu.py
# Collects the test ids of PYTEST_ARGS, splits them into GROUPS pytest processes (each killed after
# LIMIT_S seconds), and writes a summary to $OUT/NAME.log (default /tmp/out): per group its pytest
# summary line, or "TIMED OUT" with the ids it did not finish, and the first error lines. Exit
# status 0 only when every collected test passed or was skipped.
set -uo pipefail
NAME=$1; GROUPS_N=$2; LIMIT=$3; shift 3
OUTDIR=${OUT:-/tmp/out}
WORK=$(mktemp -d)
mkdir -p "$OUTDIR"
python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep "::" > "$WORK/ids"
TOTAL=$(wc -l < "$WORK/ids")
if [[ $TOTAL -eq 0 ]]; then
  echo "== $NAME: no tests collected from: $*" | tee "$OUTDIR/$NAME.log"
  exit 1
fi
# round robin: a file's slow GPU-only tests sit next to each other, and a contiguous split put them
# all in one group
split -n "r/$GROUPS_N" "$WORK/ids" "$WORK/ids."
for ids in "$WORK"/ids.*; do
  [[ -s $ids ]] || continue
  # ids are read by Python: parametrized ids may hold spaces and brackets
  timeout "$LIMIT" python3 -c "import sys, pytest; sys.exit(pytest.main(['-q', '-rf', '--tb=short', '-p', 'no:cacheprovider'] + open(sys.argv[1]).read().splitlines()))" "$ids" \
    > "${ids/ids./log.}" 2>&1 &
done
wait
STATUS=0
{
  echo "== $NAME: $TOTAL tests in $GROUPS_N groups, ${LIMIT}s each"
  for ids in "$WORK"/ids.*; do
    [[ -s $ids ]] || continue
    log=${ids/ids./log.}
    line=$(grep -E "^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|error).* =+$|no tests ran" "$log" | tail -1)
    if [[ -z $line ]]; then
      echo "TIMED OUT ($(wc -l < "$ids") tests): $(tr '\n' ' ' < "$ids")"
      STATUS=1
    else
      echo "$line"
      grep -qE "failed|error" <<< "$line" && STATUS=1
    fi
    grep -E "^(FAILED|ERROR) " "$log"
  done
  for log in "$WORK"/log.*; do grep -E "^E " "$log" | head -5; done
} > "$OUTDIR/$NAME.log"
cat "$OUTDIR/$NAME.log"
rm -rf "$WORK"
exit $STATUS
