#!/usr/bin/env bash
# The embedding job: a small BERT-style bi-encoder on (docstring -> function source) pairs from
# the Python standard library, gathered MNR loss, on 2 processes (CPU or GPU). Reports held-out
# MRR@10 and recall@1 before and after training. Extra arguments go to train_embed.py, e.g.
#   NUM_PROCS=4 bash launch/train_embed.sh --steps 400 --deepspeed_config configs/zero3.json
# (without --deepspeed_config the job uses its built-in ZeRO-2 config, micro-batch 32).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROCS="${NUM_PROCS:-2}"
# A free rendezvous port unless MASTER_PORT is set (29500, the default, may be taken).
PORT="${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
exec deepspeed --num_gpus "${NUM_PROCS}" --master_port "${PORT}" launch/train_embed.py "$@"
