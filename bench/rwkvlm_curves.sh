#!/usr/bin/env bash
# The curves of bench/RESULTS.md's "Beside RWKV-LM's trainer" on one host with 4 GPUs, one run per
# GPU at a time (docs/rwkv-lm.md), for FAMILY=rwkv7 (default: RWKV-LM's x070 trainer,
# configs/rwkv7_rwkvlm_demo.toml) or FAMILY=rwkv6 (its x060 trainer, configs/rwkv6_rwkvlm_demo.toml):
#   L12-D768 demo recipe, 2000 steps: flame and RWKV-LM from RWKV-LM's init seeds 0 and 1, flame's own
#   init (job.seed 42 and 43); with LARGE=1 (the default for rwkv7) the 340M shape too (L24-D1024,
#   ctx 2048, batch 8), 500 steps, both trainers, and the parity table at 340M; and, unless
#   PARITY=0, the family's GPU parity tests (tests/bench/test_rwkvlm_parity.py -k FAMILY).
# SPEED=1 runs only the speed pairs instead: flame and RWKV-LM at L12-D768 and at the 340M shape, each
#   run alone on its GPU for SPEED_STEPS (default 100) updates, nothing else on the host, and the
#   table of their median tokens/s (after step 10) in OUT_DIR/report.txt.
# Needs the shards and the RWKV-LM checkout of docs/rwkv-lm.md, and RWKV-LM's extensions built
# (python -m bench.rwkvlm build --config configs/${FAMILY}_rwkvlm_demo.toml).
# Usage: [FAMILY=rwkv6] [LARGE=0|1] [PARITY=0|1] [SPEED=1] bash bench/rwkvlm_curves.sh OUT_DIR [SCRATCH_DIR]
# Each run writes OUT_DIR/<run>/metrics.jsonl as it goes, and OUT_DIR/<run>.log; OUT_DIR/queues.log
# says when each run ended; OUT_DIR/report.txt holds the table, OUT_DIR/curves*.png the plots; at
# the end, or when the script is stopped (SIGTERM, e.g. by `timeout`), OUT_DIR.tar.gz holds the
# whole folder (one file to bring back). SCRATCH_DIR (default
# /dev/shm) holds the initial weights (0.4 and 0.9 GB) and temporary files.
# Runs that need no initial weights start at once, beside the processes that write them; a run that
# needs one waits for its file. Each queue is one GPU: the two runs of a pair being timed (flame and
# RWKV-LM at one shape) are on different GPUs, each alone on its own.
set -u
out=${1:?usage: [FAMILY=rwkv6] [LARGE=0|1] [PARITY=0|1] [SPEED=1] bash bench/rwkvlm_curves.sh OUT_DIR [SCRATCH_DIR]}
scratch=${2:-/dev/shm}
family=${FAMILY:-rwkv7}
if [ "$family" = rwkv7 ]; then large=${LARGE:-1}; else large=${LARGE:-0}; fi
config=configs/${family}_rwkvlm_demo.toml
[ -f "$config" ] || { echo "no $config: FAMILY is rwkv7 or rwkv6" >&2; exit 2; }
mkdir -p "$out" "$scratch"
out=$(cd "$out" && pwd)
# Four queues share the host's cores: bound each process's CPU thread pools.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} TMPDIR=$scratch
# The 340M shape; its runs take batch 8 for 500 steps, its parity table batch 4 (one step of both
# trainers in one process).
model340="--model.num_layers 24 --model.hidden_size 1024 --training.seq_len 2048 --optimizer.lr 4e-4
  --lr_scheduler.lr_min 4e-5"
shape340="$model340 --training.batch_size 8 --training.steps 500"
log() { echo "$(date +%T) $*" | tee -a "$out/queues.log"; }
flame() { local name=$1; shift
  python3 -m flame.train --config $config --checkpoint.enable false --job.dump_folder "$out/$name" \
    --training.compile_cache_dir "$scratch/compile_cache" "$@" > "$out/$name.log" 2>&1
  log "$name exit $?"; }
rwkvlm() { local name=$1 init=$2; shift 2
  python3 -m bench.rwkvlm train --config $config --init "$init" --out "$out/$name" "$@" \
    > "$out/$name.log" 2>&1; log "$name exit $?"; }
init() { local seed=$1 file=$2; shift 2
  python3 -m bench.rwkvlm init --config $config --seed "$seed" --out "$file.part" "$@" \
    > "$out/init-$(basename "$file").log" 2>&1 && mv "$file.part" "$file"; log "init $file exit $?"; }
await() { while [ ! -f "$1" ]; do sleep 2; done; }
parity_test() {
  python3 -m pytest -q -s -p no:cacheprovider --basetemp "$scratch/pytest_$family" -m gpu \
    -k "$family" tests/bench/test_rwkvlm_parity.py > "$out/parity_test.log" 2>&1; log "parity test exit $?"; }
# The parity tests run after the curve runs of the queue with the least else to do: GPU 0 with the
# 340M runs, GPU 3 without them.
if [ "${PARITY:-1}" = 0 ]; then parity_queue=none; elif [ "$large" = 1 ]; then parity_queue=0; else parity_queue=3; fi
pack() { tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "wrote $out.tar.gz"; }
trap 'log "stopped"; kill $(jobs -p) 2>/dev/null; pack; exit 143' TERM INT
# The init files are the family's: RWKV7 and RWKV6 weights in one scratch folder never mix.
s0=$scratch/${family}_init_s0.pth s1=$scratch/${family}_init_s1.pth s340=$scratch/${family}_init340.pth

if [ "${SPEED:-0}" = 1 ]; then
  steps=${SPEED_STEPS:-100}
  log "start $family speed pairs, $steps updates each"
  (export CUDA_VISIBLE_DEVICES=0; flame speed_flame --training.steps "$steps") &
  (export CUDA_VISIBLE_DEVICES=1; init 0 "$s0"; rwkvlm speed_rwkvlm "$s0" --steps "$steps") &
  (export CUDA_VISIBLE_DEVICES=2; flame speed_flame_340M $model340 --training.batch_size 8 --training.steps "$steps") &
  (export CUDA_VISIBLE_DEVICES=3; init 0 "$s340" $shape340; rwkvlm speed_rwkvlm_340M "$s340" $shape340 --steps "$steps") &
  wait
  log "all runs ended"
  python3 -m bench.rwkvlm report "$out"/speed_rwkvlm "$out"/speed_flame "$out"/speed_rwkvlm_340M "$out"/speed_flame_340M \
    > "$out/report.txt" 2>&1
  cat "$out/report.txt"
  pack
  exit 0
fi
log "start $family (340M shape: $large)"
(export CUDA_VISIBLE_DEVICES=0
 flame flame_owninit_s42 --job.seed 42
 await "$s0"; flame flame_rwkvinit_s0 --checkpoint.initial_load_path "$s0"
 if [ "$parity_queue" = 0 ]; then parity_test; fi) &
(export CUDA_VISIBLE_DEVICES=1
 init 0 "$s0"; rwkvlm rwkvlm_s0 "$s0"
 if [ "$large" = 1 ]; then await "$s340"; flame flame_340M --checkpoint.initial_load_path "$s340" $shape340; fi) &
(export CUDA_VISIBLE_DEVICES=2
 if [ "$large" = 1 ]; then init 0 "$s340" $shape340 & fi
 flame flame_owninit_s43 --job.seed 43
 await "$s1"; flame flame_rwkvinit_s1 --checkpoint.initial_load_path "$s1"
 if [ "$large" = 1 ]; then
   python3 -m bench.rwkvlm parity --config $config $model340 --training.batch_size 4 --json "$out/parity340.json" \
     > "$out/parity340.log" 2>&1; log "parity 340M exit $?"
 fi; wait) &
(export CUDA_VISIBLE_DEVICES=3
 init 1 "$s1"; rwkvlm rwkvlm_s1 "$s1"
 if [ "$large" = 1 ]; then await "$s340"; rwkvlm rwkvlm_340M "$s340" $shape340; fi
 if [ "$parity_queue" = 3 ]; then parity_test; fi) &
wait
log "all runs ended"
python3 -m bench.rwkvlm report "$out"/rwkvlm_s0 "$out"/flame_rwkvinit_s0 "$out"/rwkvlm_s1 "$out"/flame_rwkvinit_s1 \
  "$out"/flame_owninit_s42 "$out"/flame_owninit_s43 --out "$out/curves.png" > "$out/report.txt" 2>&1
if [ "$large" = 1 ]; then
  python3 -m bench.rwkvlm report "$out"/rwkvlm_340M "$out"/flame_340M --out "$out/curves_340M.png" >> "$out/report.txt" 2>&1
fi
cat "$out/report.txt"
pack
