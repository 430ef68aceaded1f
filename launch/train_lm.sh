#!/usr/bin/env bash
# The main job: a small Llama on the Python standard library's sources, TP=2 vocab-parallel
# chunked CE, ZeRO-2, on 2 processes (CPU or GPU). Extra arguments go to train_lm.py, e.g.
#   NUM_PROCS=4 bash launch/train_lm.sh --steps 300 --deepspeed_config configs/zero3.json
# (a later --deepspeed_config wins over the default below).
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_PROCS="${NUM_PROCS:-2}"
# A free rendezvous port unless MASTER_PORT is set (29500, the default, may be taken).
PORT="${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
exec deepspeed --num_gpus "${NUM_PROCS}" --master_port "${PORT}" launch/train_lm.py \
    --deepspeed_config "${DS_CONFIG:-configs/zero2.json}" "$@"
