#!/usr/bin/env bash
# The LM job through transformers.Trainer (megaloss's MegalossTrainer: chunked CE, global token
# calibration) under DeepSpeed ZeRO-2 on 2 processes (CPU or GPU): the small Llama on the Python
# standard library's sources, as launch/train_lm.sh, data parallel only. Reports held-out
# cross-entropy / perplexity before and after training. Extra arguments go to train_lm_hf.py, e.g.
#   NUM_PROCS=4 bash launch/train_lm_hf.sh --steps 300 --report_to wandb
# (a later --deepspeed_config wins over the default below). Runs in the current directory:
# outputs go to ./runs/lm_hf unless --output_dir says otherwise. Several nodes: as
# launch/train_lm.sh (launch/multinode.sh, launch/README.md).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_lm_hf.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/zero2_hf.json}" "$@"
source "${REPO}/launch/multinode.sh"
