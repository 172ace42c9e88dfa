#!/usr/bin/env bash
# The curves of bench/RESULTS.md's "Beside RWKV-LM's trainer" on one host with 4 GPUs, one run per
# GPU at a time (docs/rwkv-lm.md):
#   L12-D768 demo recipe, 2000 steps: flame and RWKV-LM from RWKV-LM's init seeds 0 and 1, flame's own
#   init (job.seed 42 and 43); the 340M shape (L24-D1024, ctx 2048, batch 8), 500 steps, both trainers;
#   then the one-step parity test (tests/bench/test_rwkvlm_parity.py) and the parity table at 340M.
# Needs the shards and the RWKV-LM checkout of docs/rwkv-lm.md, and RWKV-LM's extensions built
# (python -m bench.rwkvlm build). Usage: bash bench/rwkvlm_curves.sh OUT_DIR [SCRATCH_DIR]
# Each run writes OUT_DIR/<run>/metrics.jsonl as it goes, and OUT_DIR/<run>.log; OUT_DIR/queues.log
# says when each run ended. SCRATCH_DIR (default /dev/shm) holds the initial weights (0.4 and 0.9 GB)
# and temporary files.
# Runs that need no initial weights start at once, beside the processes that write them; a run that
# needs one waits for its file. Each queue is one GPU: the two runs of a pair being timed (flame and
# RWKV-LM at one shape) are on different GPUs, each alone on its own.
set -u
out=${1:?usage: bash bench/rwkvlm_curves.sh OUT_DIR [SCRATCH_DIR]}
scratch=${2:-/dev/shm}
mkdir -p "$out" "$scratch"
out=$(cd "$out" && pwd)
# Four queues share the host's cores: bound each process's CPU thread pools.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} TMPDIR=$scratch
config=configs/rwkv7_rwkvlm_demo.toml
shape340="--model.num_layers 24 --model.hidden_size 1024 --training.seq_len 2048 --training.batch_size 8
  --training.steps 500 --optimizer.lr 4e-4 --lr_scheduler.lr_min 4e-5"
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

log "start"
(export CUDA_VISIBLE_DEVICES=0
 flame flame_owninit_s42 --job.seed 42
 await "$scratch/init_s0.pth"; flame flame_rwkvinit_s0 --checkpoint.initial_load_path "$scratch/init_s0.pth"
 python3 -m pytest -q -s -p no:cacheprovider --basetemp "$scratch/pytest" -m gpu tests/bench/test_rwkvlm_parity.py \
   > "$out/parity_test.log" 2>&1; log "parity test exit $?") &
(export CUDA_VISIBLE_DEVICES=1
 init 0 "$scratch/init_s0.pth"; rwkvlm rwkvlm_s0 "$scratch/init_s0.pth"
 await "$scratch/init340.pth"; flame flame_340M --checkpoint.initial_load_path "$scratch/init340.pth" $shape340) &
(export CUDA_VISIBLE_DEVICES=2
 init 0 "$scratch/init340.pth" $shape340 &
 flame flame_owninit_s43 --job.seed 43
 await "$scratch/init_s1.pth"; flame flame_rwkvinit_s1 --checkpoint.initial_load_path "$scratch/init_s1.pth"
 python3 -m bench.rwkvlm parity --config $config $shape340 --training.batch_size 4 --json "$out/parity340.json" \
   > "$out/parity340.log" 2>&1; log "parity 340M exit $?"; wait) &
(export CUDA_VISIBLE_DEVICES=3
 init 1 "$scratch/init_s1.pth"; rwkvlm rwkvlm_s1 "$scratch/init_s1.pth"
 await "$scratch/init340.pth"; rwkvlm rwkvlm_340M "$scratch/init340.pth" $shape340) &
wait
log "all runs ended"
python3 -m bench.rwkvlm report "$out"/rwkvlm_s0 "$out"/flame_rwkvinit_s0 "$out"/rwkvlm_s1 "$out"/flame_rwkvinit_s1 \
  "$out"/flame_owninit_s42 "$out"/flame_owninit_s43 --out "$out/curves.png" > "$out/report.txt" 2>&1
python3 -m bench.rwkvlm report "$out"/rwkvlm_340M "$out"/flame_340M --out "$out/curves_340M.png" >> "$out/report.txt" 2>&1
cat "$out/report.txt"
