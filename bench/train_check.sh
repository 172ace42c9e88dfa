#!/usr/bin/env bash
# GPU check of the trainer (issue 3): rwkv7_340M in bf16 on the embedded corpus (the GPU machines
# have no network), from the repository root:
#   bash bench/train_check.sh h100      # 1 GPU: 50 steps, checkpoint at 25, then a resume from 25;
#                                       # compares steps 30-50 of the two runs (must be bitwise equal)
#   bash bench/train_check.sh h200x2    # FSDP over 2 GPUs (batch 8 x DP 2) against 1 GPU at the same
#                                       # global batch (batch 8 x GA 2), 30 steps, loss side by side
#   bash bench/train_check.sh cpu-smoke # the same procedure at toy size on the CPU
# Logs go to $OUT (default /tmp/out), run folders to $RUNS (default /tmp/runs).
set -uo pipefail
MODE=$1
OUTDIR=${OUT:-/tmp/out}
RUNS=${RUNS:-/tmp/runs}
mkdir -p "$OUTDIR" "$RUNS"
if [[ $MODE == cpu-smoke ]]; then
  SIZE=(--model.hidden_size 64 --model.num_layers 2 --training.device cpu)
  STEPS=6; SEQ=64; EVERY=3; LOG=1
elif [[ $MODE == h200x2 ]]; then
  SIZE=(--checkpoint.enable false); STEPS=30; SEQ=2048; EVERY=15; LOG=1
else
  SIZE=(); STEPS=50; SEQ=2048; EVERY=25; LOG=5
fi
COMMON=(--config configs/rwkv7_340M.toml --data.dataset embedded --data.tokenizer ""
  --data.streaming false --data.num_workers 0 --data.val_fraction 0.01 --model.vocab_size 8192
  --training.steps $STEPS --training.seq_len $SEQ --lr_scheduler.warmup_steps 10
  --checkpoint.interval $EVERY --checkpoint.keep_latest_k 0 --metrics.log_freq $LOG
  --metrics.val_freq $EVERY --metrics.val_steps 4 "${SIZE[@]}")
run() {  # name, timeout, launcher args..., -- trainer args...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" --job.dump_folder "$RUNS/$name" > "$OUTDIR/$name.log" 2>&1
  echo "=== $name exit $?"
  grep -v tokenizing "$OUTDIR/$name.log" | grep -E "step |error|Error|resumed|fsdp|model:" | tail -30
}
copy_checkpoint() {  # from run a to run b: a's step-$EVERY checkpoint, which b then resumes from
  local a=$1 b=$2
  mkdir -p "$RUNS/$b/checkpoint"
  cp -r "$RUNS/$a/checkpoint/step-$EVERY" "$RUNS/$b/checkpoint/"
}
nvidia-smi -L 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case $MODE in
  h100|cpu-smoke)
    run gpu1_straight 210 python3 -m flame.train "${COMMON[@]}" --training.batch_size 8 \
      --training.gradient_accumulation_steps 1
    copy_checkpoint gpu1_straight gpu1_resumed
    run gpu1_resumed 130 python3 -m flame.train "${COMMON[@]}" --training.batch_size 8 \
      --training.gradient_accumulation_steps 1
    python3 bench/train_compare.py --equal "$RUNS/gpu1_straight/metrics.jsonl" "$RUNS/gpu1_resumed/metrics.jsonl"
    ;;
  h200x2)
    run gpu2_fsdp 200 env NGPU=2 LOG_DIR="$RUNS/logs2" bash launch/train.sh "${COMMON[@]}" --training.batch_size 8 \
      --training.gradient_accumulation_steps 1
    run gpu1_ref 200 env CUDA_VISIBLE_DEVICES=0 python3 -m flame.train "${COMMON[@]}" --training.batch_size 8 \
      --training.gradient_accumulation_steps 2
    python3 bench/train_compare.py "$RUNS/gpu1_ref/metrics.jsonl" "$RUNS/gpu2_fsdp/metrics.jsonl"
    ;;
esac
