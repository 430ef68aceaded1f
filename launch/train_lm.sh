#!/usr/bin/env bash
# The main job: a small Llama on the Python standard library's sources, TP=2 vocab-parallel
# chunked CE, ZeRO-2, on 2 processes (CPU or GPU). Extra arguments go to train_lm.py, e.g.
#   NUM_PROCS=4 bash launch/train_lm.sh --steps 300 --deepspeed_config configs/zero3.json
# (a later --deepspeed_config wins over the default below). Runs in the current directory:
# outputs go to ./runs/lm unless --output_dir says otherwise, and relative paths are yours.
# Several nodes: the settings come from the environment a scheduler sets (SLURM_NNODES /
# SLURM_NODEID / SLURM_JOB_NODELIST; NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT; HOSTFILE);
# NUM_PROCS is then the processes per node. See launch/multinode.sh and launch/README.md.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_lm.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/zero2.json}" "$@"
source "${REPO}/launch/multinode.sh"
