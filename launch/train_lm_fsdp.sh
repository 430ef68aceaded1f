#!/usr/bin/env bash
# The LM job under PyTorch FSDP2 instead of DeepSpeed: launch/train_lm.sh's data, model and
# held-out perplexity report, the Llama fully_shard-ed over all processes (CPU: gloo, GPU: NCCL),
# megaloss's chunked CE inside the FSDP-managed forward, calibrated with probe_fsdp. Extra
# arguments go to launch/train_lm_fsdp.py, e.g.
#   NUM_PROCS=4 bash launch/train_lm_fsdp.sh --steps 300 --loss_reduction sample
# Runs in the current directory: outputs go to ./runs/lm_fsdp unless --output_dir says otherwise.
# One node: NUM_PROCS processes (default 2), a free rendezvous port unless MASTER_PORT is set.
# Several nodes: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (torchrun's static rendezvous; run
# this script once per node). DRY_RUN=1 prints the command instead.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
JOB="${REPO}/launch/train_lm_fsdp.py"
export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
source "${REPO}/launch/_stop_status.sh"
NUM_PROCS="${NUM_PROCS:-2}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
PORT="${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
if command -v torchrun >/dev/null 2>&1; then TORCHRUN=(torchrun)
else TORCHRUN=(python3 -m torch.distributed.run); fi
CMD=("${TORCHRUN[@]}" --nnodes "${NNODES}" --node_rank "${NODE_RANK}"
     --nproc_per_node "${NUM_PROCS}" --master_addr "${MASTER_ADDR}" --master_port "${PORT}"
     "${JOB}" "$@")
if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi

# The arguments and inputs, checked once before any rank starts (launch/jobs/preflight.py): one
# line under the script's name, exit status 2.
MEGALOSS_PROG="$(basename "$0")" MEGALOSS_WORLD_SIZE="$((NNODES * NUM_PROCS))" \
  python3 -m launch.jobs.check_args "${JOB}" "$@" || exit $?
for arg in "$@"; do
  if [[ "${arg}" == "-h" || "${arg}" == "--help" ]]; then exit 0; fi
done
# A failing rank leaves its message in ${MEGALOSS_ERROR_FILE}.rank<r>; the lowest rank's is shown
# once, after torchrun's own lines (launch/multinode.sh does the same for the DeepSpeed jobs).
MEGALOSS_ERROR_FILE="$(mktemp "${TMPDIR:-/tmp}/megaloss-error.XXXXXX")"
export MEGALOSS_ERROR_FILE
# one thread per process unless OMP_NUM_THREADS says otherwise (torchrun's default too)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Stop requests (launch/jobs/signals.py). torchrun starts each rank in a session of its own, so
# a signal to this script's process group (Ctrl-C, kill -- -PGID, timeout(1)) reaches this
# script and torchrun, not the ranks:
# - SIGINT: taken by torchrun, which sends it to its ranks; ignored here.
# - SIGTERM (SLURM's scancel and time limit, timeout(1)): passed on to torchrun, which sends it
#   to its ranks and waits for them (30 s); this script must not die of it before the ranks
#   have saved. Repeats of the request are one request.
# - SIGUSR1 (sbatch --signal=USR1@60): passed on to the ranks (torchrun ignores it: started with
#   it ignored, it would die of it).
# torchrun runs in the background so that the traps run at once.
trap '' INT USR1
set +e
"${CMD[@]}" &
child=$!
trap 'kill -TERM "${child}" 2>/dev/null' TERM
trap 'pkill -USR1 -P "${child}" 2>/dev/null' USR1
wait "${child}"
rc=$?
while (( rc > 128 )) && kill -0 "${child}" 2>/dev/null; do wait "${child}"; rc=$?; done
set -e
trap - INT USR1 TERM
# 75 when stopped on request and saved everywhere, else torchrun's status (launch/_stop_status.sh)
exit_with_run_status "${rc}"
