#!/usr/bin/env bash
# GRPO on a verifiable task: the main job's tiny Llama, a few SFT steps, then GRPO (reverse a list
# of words drawn from the stdlib text; reward = share of answer positions right), ZeRO-2, data
# parallel on 2 processes (CPU or GPU). Extra arguments go to train_grpo.py, e.g.
#   bash launch/train_grpo.sh --steps 80 --task sort --overwrite
# (a later --deepspeed_config wins over the default below). Runs in the current directory:
# outputs go to ./runs/grpo unless --output_dir says otherwise. Several nodes: as
# launch/train_lm.sh (launch/multinode.sh, launch/README.md).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_grpo.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/grpo.json}" "$@"
source "${REPO}/launch/multinode.sh"
