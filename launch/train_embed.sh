#!/usr/bin/env bash
# The embedding job: a small BERT-style bi-encoder on (docstring -> function source) pairs from
# the Python standard library, gathered MNR loss, on 2 processes (CPU or GPU). Reports held-out
# MRR@10 and recall@1 before and after training. Extra arguments go to train_embed.py, e.g.
#   NUM_PROCS=4 bash launch/train_embed.sh --steps 400 --deepspeed_config configs/zero3.json
# (without --deepspeed_config the job uses its built-in ZeRO-2 config, micro-batch 32). Runs in
# the current directory: outputs go to ./runs/embed unless --output_dir says otherwise.
# Several nodes: the settings come from the environment a scheduler sets (SLURM_NNODES /
# SLURM_NODEID / SLURM_JOB_NODELIST; NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT; HOSTFILE);
# NUM_PROCS is then the processes per node. See launch/multinode.sh and launch/README.md.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_embed.py"
source "${REPO}/launch/multinode.sh"
