#!/usr/bin/env bash
# Distillation: the main job's small Llama (trained first, or --teacher PATH: a checkpoint of
# launch/train_lm.sh --save_every N) into a smaller Llama, against the same student trained with
# cross-entropy alone; TP=2 vocab-parallel heads for both models, ZeRO-2, on 2 processes (CPU or
# GPU). Extra arguments go to distill_lm.py, e.g.
#   bash launch/distill_lm.sh --teacher runs/lm/checkpoints --temperature 2 --alpha 0.5
# Runs in the current directory: outputs go to ./runs/distill unless --output_dir says otherwise.
# Several nodes: as launch/train_lm.sh (launch/multinode.sh).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/distill_lm.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/zero2.json}" "$@"
source "${REPO}/launch/multinode.sh"
