#!/usr/bin/env bash
# The mixture-of-experts job: a small random-init Qwen3-MoE on the Python standard library's
# sources, trained twice under DeepSpeed on 2 processes (CPU or GPU), its load-balancing loss
# counted per micro-batch and over the whole global batch of each step (megaloss.router scopes
# micro_batch vs step, same coefficient, seed and data); prints held-out perplexity, expert load
# and expert specialisation per data domain of both runs, and writes plot.png. Extra arguments
# go to train_moe.py, e.g.
#   bash launch/train_moe.sh --steps 600 --scopes micro_batch,global,step --aux_loss 0.05
# Runs in the current directory: outputs go to ./runs/moe unless --output_dir says otherwise.
# Several nodes: as launch/train_lm.sh (launch/multinode.sh).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_moe.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/moe.json}" "$@"
source "${REPO}/launch/multinode.sh"
