#!/usr/bin/env bash
# Launch flame training under torchrun, on one node or several.
#
#   NGPU=8 bash launch/train.sh --config configs/rwkv7_340M.toml [--section.key value ...]
#   NNODE=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> NGPU=8 bash launch/train.sh --config ...
#
# Environment (all optional):
#   NGPU              processes per node (default: the number of visible GPUs, else 1)
#   NNODE             number of nodes (default 1)
#   NODE_RANK         this node's index (default 0; set by launch/slurm.sbatch under Slurm)
#   MASTER_ADDR       address of node 0 (default 127.0.0.1), MASTER_PORT (default 29500)
#   LOG_DIR           per-rank logs (default logs/<date-time>): torchrun writes each rank's stdout
#                     and stderr there; the console shows rank 0 only.
#   MAX_RESTARTS      torchrun restarts of a worker group whose rank died (default 0); each
#                     restart resumes from the last complete checkpoint
#   SHUTDOWN_TIMEOUT  seconds the ranks get to save after a stop signal before torchrun kills
#                     them (default 240; keep it below Slurm's --signal grace)
#
# A SIGTERM, SIGINT or SIGUSR1 sent to this script (torchrun) reaches every rank, which finishes
# its step, saves a checkpoint there and exits with code 75; torchrun itself then exits with 1
# (it reports the signal, not the ranks' codes). Run the same command again to resume.
set -euo pipefail

if [[ -z "${NGPU:-}" ]]; then
  NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [[ "$NGPU" -ge 1 ]] || NGPU=1
fi
NNODE=${NNODE:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LOG_DIR=${LOG_DIR:-logs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$LOG_DIR"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-240}

echo "flame: $NNODE node(s) x $NGPU process(es), node rank $NODE_RANK, master $MASTER_ADDR:$MASTER_PORT, logs in $LOG_DIR"
exec torchrun \
  --nnodes "$NNODE" --nproc_per_node "$NGPU" --node_rank "$NODE_RANK" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --max-restarts "${MAX_RESTARTS:-0}" --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  --log_dir "$LOG_DIR" --redirects 3 --tee 3 --local-ranks-filter 0 \
  -m flame.train "$@"
