#!/usr/bin/env bash
# Preference training on pairs cut from the stdlib text: the GRPO job's tiny Llama, a few SFT
# steps on the real text, then DPO / SimPO / ORPO / CPO / KTO (--loss) on pairs whose chosen
# continuation of a prompt is the real one and whose rejected one comes from another place of
# the text (--rejected), ZeRO-2, data parallel on 2 processes (CPU or GPU). Extra arguments go
# to train_dpo.py, e.g.
#   bash launch/train_dpo.sh --loss simpo --output_dir runs/simpo
# (a later --deepspeed_config wins over the default below). Runs in the current directory:
# outputs go to ./runs/dpo unless --output_dir says otherwise. Several nodes: as
# launch/train_lm.sh (launch/multinode.sh, launch/README.md).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_dpo.py"
set -- --deepspeed_config "${DS_CONFIG:-${REPO}/configs/dpo.json}" "$@"
source "${REPO}/launch/multinode.sh"
