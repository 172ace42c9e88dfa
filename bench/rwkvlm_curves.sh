#!/usr/bin/env bash
# The curves of bench/RESULTS.md's "Beside RWKV-LM's trainer" on one host with 4 GPUs, one run per
# GPU at a time (docs/rwkv-lm.md):
#   L12-D768 demo recipe, 2000 steps: flame and RWKV-LM from RWKV-LM's init seeds 0 and 1, flame's own
#   init (job.seed 42 and 43); the 340M shape (L24-D1024, ctx 2048, batch 8), 500 steps, both trainers.
# Needs the shards and the RWKV-LM checkout of docs/rwkv-lm.md, and RWKV-LM's extensions built
# (python -m bench.rwkvlm build). Usage: bash bench/rwkvlm_curves.sh OUT_DIR [SCRATCH_DIR]
# Each run writes OUT_DIR/<run>/metrics.jsonl as it goes, and OUT_DIR/<run>.log.
# SCRATCH_DIR (default /dev/shm) holds the initial weights (0.4 and 0.9 GB); on one 4-GPU host
# writing them to /tmp took minutes.
set -u
out=${1:?usage: bash bench/rwkvlm_curves.sh OUT_DIR [SCRATCH_DIR]}
scratch=${2:-/dev/shm}
mkdir -p "$out"
config=configs/rwkv7_rwkvlm_demo.toml
shape340="--model.num_layers 24 --model.hidden_size 1024 --training.seq_len 2048 --training.batch_size 8
  --training.steps 500 --optimizer.lr 4e-4 --lr_scheduler.lr_min 4e-5"
flame() { local name=$1; shift
  python3 -m flame.train --config $config --checkpoint.enable false --job.dump_folder "$out/$name" "$@" \
    > "$out/$name.log" 2>&1; echo "$name exit $? at $(date +%T)"; }
rwkvlm() { local name=$1 init=$2; shift 2
  python3 -m bench.rwkvlm train --config $config --init "$init" --out "$out/$name" "$@" \
    > "$out/$name.log" 2>&1; echo "$name exit $? at $(date +%T)"; }
init() { local gpu=$1 seed=$2 file=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu python3 -m bench.rwkvlm init --config $config --seed "$seed" --out "$file" "$@" \
    > "$out/init-$(basename "$file").log" 2>&1; }

echo "initial weights at $(date +%T)"
init 0 0 "$scratch/init_s0.pth" & init 1 1 "$scratch/init_s1.pth" & init 2 0 "$scratch/init340.pth" $shape340 &
wait
echo "training at $(date +%T)"
(export CUDA_VISIBLE_DEVICES=0; flame flame_rwkvinit_s0 --checkpoint.initial_load_path "$scratch/init_s0.pth"
 flame flame_owninit_s42 --job.seed 42) &
(export CUDA_VISIBLE_DEVICES=1; rwkvlm rwkvlm_s0 "$scratch/init_s0.pth"; flame flame_owninit_s43 --job.seed 43) &
(export CUDA_VISIBLE_DEVICES=2; flame flame_rwkvinit_s1 --checkpoint.initial_load_path "$scratch/init_s1.pth"
 flame flame_340M --checkpoint.initial_load_path "$scratch/init340.pth" $shape340) &
(export CUDA_VISIBLE_DEVICES=3; rwkvlm rwkvlm_s1 "$scratch/init_s1.pth"; rwkvlm rwkvlm_340M "$scratch/init340.pth" $shape340) &
wait
python3 -m bench.rwkvlm report "$out"/rwkvlm_s0 "$out"/flame_rwkvinit_s0 "$out"/rwkvlm_s1 "$out"/flame_rwkvinit_s1 \
  "$out"/flame_owninit_s42 "$out"/flame_owninit_s43 --out "$out/curves.png"
python3 -m bench.rwkvlm report "$out"/rwkvlm_340M "$out"/flame_340M --out "$out/curves_340M.png"
