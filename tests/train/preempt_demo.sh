#!/usr/bin/env bash
# A preempted-and-resumed run on one CUDA GPU against an uninterrupted one; prints PASS or FAIL.
#
#   bash tests/train/preempt_demo.sh [OUT_DIR]      # default OUT_DIR: /tmp/flame-preempt-demo
#
# DEVICE=cpu STEPS=80 runs the same check on a CPU (slower; the default is cuda and 300 steps).
#
# 1. configs/tiny.toml, STEPS steps, uninterrupted, twice: the GPU's run-to-run noise.
# 2. The same run in the background, sent SIGUSR1 once it has logged step 40 (step 60 sleeps 5 s,
#    a test hook, so that the signal lands before the run ends): it must exit with 75 and leave a
#    COMPLETE checkpoint at the step where it stopped.
# 3. The same command again: it must resume from that step, finish, and log the losses of the
#    uninterrupted run: within 1e-5 relative, or 3x the gap between the two uninterrupted runs when
#    the device is not deterministic ("bitwise" is reported too).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${1:-/tmp/flame-preempt-demo}
rm -rf "$OUT" && mkdir -p "$OUT"
ARGS=(--config configs/tiny.toml --training.device "${DEVICE:-cuda}" --training.steps "${STEPS:-300}"
      --checkpoint.interval 100 --metrics.log_freq 1 --metrics.val_freq 0)
fail() { echo "FAIL: $*"; exit 1; }

for run in straight again; do
  python -m flame.train "${ARGS[@]}" --job.dump_folder "$OUT/$run" > "$OUT/$run.log" 2>&1 \
    || fail "the uninterrupted run failed, see $OUT/$run.log"
done

FLAME_FAULT_INJECT=forward:60:sleep=5 python -m flame.train "${ARGS[@]}" \
  --job.dump_folder "$OUT/preempted" > "$OUT/preempted-1.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  logged=$( (wc -l < "$OUT/preempted/metrics.jsonl") 2>/dev/null || echo 0)
  [[ $logged -ge 40 ]] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
kill -USR1 "$pid" 2>/dev/null || fail "the run ended before the signal, see $OUT/preempted-1.log"
wait "$pid"
rc=$?
[[ $rc -eq 75 ]] || fail "exit code $rc after SIGUSR1, expected 75 (see $OUT/preempted-1.log)"
stop=$(python -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['step'])" \
       "$OUT/preempted/metrics.jsonl")
[[ -f "$OUT/preempted/checkpoint/step-$stop/COMPLETE" ]] \
  || fail "no complete checkpoint at step $stop, where the run stopped"
echo "stopped by SIGUSR1 at step $stop with exit code 75, checkpoint step-$stop complete"

python -m flame.train "${ARGS[@]}" --job.dump_folder "$OUT/preempted" > "$OUT/preempted-2.log" 2>&1 \
  || fail "the resumed run failed, see $OUT/preempted-2.log"
grep -q "resumed from .*step-$stop: step $stop" "$OUT/preempted-2.log" \
  || fail "the second run did not resume from step $stop (see $OUT/preempted-2.log)"

python - "$OUT"/{straight,again,preempted}/metrics.jsonl <<'EOF' || exit 1
import json, sys
def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}
def gap(x, y):
    return max(abs(x[s] - y[s]) / abs(x[s]) for s in x)
straight, again, resumed = map(losses, sys.argv[1:])
if sorted(resumed) != sorted(straight):
    sys.exit(f"FAIL: the preempted run logged steps {min(resumed)}..{max(resumed)}, "
             f"not {min(straight)}..{max(straight)}")
noise, worst = gap(straight, again), gap(straight, resumed)
allowed = max(1e-5, 3 * noise)
print(f"{len(straight)} steps: largest relative loss gap, resumed vs uninterrupted {worst:.2e} "
      f"(bitwise: {all(straight[s] == resumed[s] for s in straight)}); between two uninterrupted "
      f"runs {noise:.2e}")
print("PASS" if worst <= allowed else f"FAIL: the resumed losses differ by more than {allowed:.1e}")
sys.exit(0 if worst <= allowed else 1)
EOF
