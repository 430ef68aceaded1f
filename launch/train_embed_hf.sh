#!/usr/bin/env bash
# The code-search bi-encoder through sentence-transformers' SentenceTransformerTrainer with
# megaloss's GatheredMultipleNegativesRankingLoss, under DeepSpeed ZeRO-2 on 2 processes (CPU or
# GPU): the same data and held-out split as launch/train_embed.sh. Reports held-out MRR@10 and
# recall@1 before and after training. Extra arguments go to train_embed_hf.py, e.g.
#   NUM_PROCS=4 bash launch/train_embed_hf.sh --steps 400 --mini_batch_size 16
# (a later --deepspeed_config wins over the default below). Runs in the current directory:
# outputs go to ./runs/embed_hf unless --output_dir says otherwise. Several nodes: as
# launch/train_embed.sh (launch/multinode.sh, launch/README.md).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_embed_hf.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/zero2_hf.json}" "$@"
source "${REPO}/launch/multinode.sh"
