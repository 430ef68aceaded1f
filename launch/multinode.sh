# Sourced by the launch/train_*.sh scripts once they have set REPO (the repository root), JOB (the
# path of the script the deepspeed launcher runs) and their positional arguments (the job's
# arguments). The jobs import their shared code as the package launch.jobs: the repository root
# goes first on PYTHONPATH, which every rank inherits (and DeepSpeed's ssh launcher exports). Starts
# with `deepspeed` on one node, or on several from the settings a scheduler puts in the
# environment (launch/README.md, "Several nodes"):
#   NUM_PROCS                 processes per node (default 2; on GPUs: GPUs per node)
#   SLURM (srun, one task per node): SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST (its first
#                             host is the master), SLURM_JOB_ID (master port 20000 + id % 20000)
#   torchrun / Kubernetes:    NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (or PET_NNODES, ...)
#   HOSTFILE=path             MPI-style hostfile ("host slots=N" lines)
# With a node rank: one launcher per node, `deepspeed --hostfile H --no_ssh --num_nodes N
# --node_rank R --master_addr A --master_port P --num_gpus NUM_PROCS` (a hostfile is written to
# $TMPDIR when none is given: in this form its names are only labels). Without a node rank but with HOSTFILE:
# this one launcher starts every node over ssh (pdsh). DRY_RUN=1 prints the command instead.
export PYTHONPATH="${REPO}${PYTHONPATH:+:${PYTHONPATH}}"
source "${REPO}/launch/_stop_status.sh"
NUM_PROCS_SET="${NUM_PROCS:+1}"
NUM_PROCS="${NUM_PROCS:-2}"
NNODES="${NNODES:-${PET_NNODES:-${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}}}"
NNODES="${NNODES%%:*}"  # torchrun's "MIN:MAX" form: the minimum
NODE_RANK="${NODE_RANK:-${PET_NODE_RANK:-${SLURM_NODEID:-}}}"
MASTER_ADDR="${MASTER_ADDR:-${PET_MASTER_ADDR:-}}"
MASTER_PORT="${MASTER_PORT:-${PET_MASTER_PORT:-}}"
HOSTFILE="${HOSTFILE:-}"

JOB_ARGS=("$@")

run() {  # run the launcher command "$@" (DRY_RUN: print it)
  if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "$@"; echo; exit 0; fi
  # The job's arguments and inputs, checked once before any rank starts (launch/jobs/preflight.py:
  # options, data files, the ds_config against the world size, --output_dir): one line under the
  # script's name, exit status 2. The world size: NUM_PROCS per node, or, with a hostfile and no
  # NUM_PROCS, the slots of its first NNODES hosts (as the launcher counts them).
  local world=""
  if [[ -z "${HOSTFILE}" && ( -z "${NNODES}" || "${NNODES}" -le 1 ) ]]; then world="${NUM_PROCS}"
  elif [[ -z "${HOSTFILE}" || -n "${NUM_PROCS_SET}" ]]; then world=$((NNODES * NUM_PROCS))
  elif [[ -f "${HOSTFILE}" ]]; then
    world="$(awk -v n="${NNODES:-0}" '$1 !~ /^#/ && NF && (n == 0 || hosts < n) {
      hosts++; for (i = 2; i <= NF; i++) if ($i ~ /^slots=[0-9]+$/) { sub("slots=", "", $i); s += $i }
    } END { print s + 0 }' "${HOSTFILE}")"
    if [[ "${world}" == 0 ]]; then world=""; fi
  fi
  MEGALOSS_PROG="$(basename "$0")" MEGALOSS_WORLD_SIZE="${world}" \
    python3 -m launch.jobs.check_args "${JOB}" ${JOB_ARGS[@]+"${JOB_ARGS[@]}"} || exit $?
  for arg in ${JOB_ARGS[@]+"${JOB_ARGS[@]}"}; do
    if [[ "${arg}" == "-h" || "${arg}" == "--help" ]]; then exit 0; fi
  done
  # A failing rank leaves its message in ${MEGALOSS_ERROR_FILE}.rank<r> (and prints nothing: the
  # ranks that hit the same error would print it once each); the lowest rank's is shown once,
  # after the launcher's closing lines ("Killing subprocess ..."), so the cause is what a user
  # reads last. ${MEGALOSS_ERROR_FILE}.left<r>: rank r left on an error, not dead (jobs/peers.py).
  MEGALOSS_ERROR_FILE="$(mktemp "${TMPDIR:-/tmp}/megaloss-error.XXXXXX")"
  export MEGALOSS_ERROR_FILE
  # SIGINT (Ctrl-C, a scheduler's signal to the job's process group) reaches the launcher's
  # launch.py and every rank directly; the `deepspeed` command itself ignores it, so this script
  # returns once the ranks have saved and exited, not as soon as the signal arrives.
  # SIGUSR1 (`sbatch --signal=USR1@60`, sent to every process of the step) would kill the
  # launcher's processes, which take no such signal: they ignore it (inherited), the ranks
  # install their own handler for it.
  # SIGTERM (SLURM's time limit and scancel: every process of the step) would kill this script
  # and the `deepspeed` command at once, before the ranks have saved (status 143, not 75): both
  # ignore it; launch.py installs its own handler, which passes it on to the ranks and waits
  # for them. A SIGTERM to this script alone therefore stops nothing (send it to the process
  # group, or SIGINT).
  trap '' INT USR1 TERM
  set +e
  "$@"
  local rc=$?
  set -e
  trap - INT USR1 TERM
  # Stopped on request and saved on every rank of this node, no rank failed: status 75, else
  # the launcher's status (launch/_stop_status.sh)
  exit_with_run_status "${rc}"
}

slurm_hosts() {  # one host per line from SLURM_JOB_NODELIST (scontrol where present)
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "${SLURM_JOB_NODELIST}"
  else  # the compact form, e.g. "gpu[01-03,07],login1"
    python3 - "${SLURM_JOB_NODELIST}" <<'EOF'
import re, sys
for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", sys.argv[1]):
    m = re.fullmatch(r"(.*?)\[(.*)\](.*)", part)
    if not m:
        print(part)
        continue
    for r in m.group(2).split(","):
        a, _, b = r.partition("-")
        for i in range(int(a), int(b or a) + 1):
            print(f"{m.group(1)}{i:0{len(a)}d}{m.group(3)}")
EOF
  fi
}

if [[ -z "${HOSTFILE}" && ( -z "${NNODES}" || "${NNODES}" -le 1 ) ]]; then
  # One node, as always: a free rendezvous port unless MASTER_PORT is set (29500 may be taken).
  PORT="${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
  run deepspeed --num_gpus "${NUM_PROCS}" --master_port "${PORT}" "${JOB}" "$@"
fi

HOSTS=()
if [[ -n "${HOSTFILE}" ]]; then
  [[ -f "${HOSTFILE}" ]] || { echo "HOSTFILE=${HOSTFILE}: no such file" >&2; exit 2; }
  while read -r host _ || [[ -n "${host:-}" ]]; do
    if [[ -n "${host}" && "${host}" != \#* ]]; then HOSTS+=("${host}"); fi
  done < "${HOSTFILE}"
elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
  mapfile -t HOSTS < <(slurm_hosts)
fi
NNODES="${NNODES:-${#HOSTS[@]}}"
MASTER_ADDR="${MASTER_ADDR:-${HOSTS[0]:-}}"
if [[ -z "${MASTER_PORT}" ]]; then
  # Every node must pick the same port: from the SLURM job id, else DeepSpeed's default.
  if [[ -n "${SLURM_JOB_ID:-}" ]]; then MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
  else MASTER_PORT=29500; fi
fi
if [[ -z "${MASTER_ADDR}" ]]; then
  echo "several nodes (NNODES=${NNODES}) but no MASTER_ADDR, HOSTFILE or SLURM_JOB_NODELIST" >&2
  exit 2
fi

if [[ -n "${NODE_RANK}" ]]; then
  # One launcher per node (--no_ssh): every node runs this script with its own NODE_RANK.
  NUM_GPUS=()
  if [[ -z "${HOSTFILE}" ]]; then
    # DeepSpeed reads the node count and the processes per node from a hostfile; in this form
    # the names are only labels (this launcher starts node NODE_RANK's processes). Named after
    # its contents and renamed into place: launchers sharing a /tmp write the same file once.
    LINES="$(for ((i = 0; i < NNODES; i++)); do echo "${HOSTS[i]:-node${i}} slots=${NUM_PROCS}"; done)"
    HOSTFILE="${TMPDIR:-/tmp}/megaloss-hostfile-$(printf '%s\n' "${LINES}" | cksum | cut -d' ' -f1)"
    if [[ ! -f "${HOSTFILE}" ]]; then
      TMP_HOSTFILE="$(mktemp "${HOSTFILE}.XXXXXX")"
      printf '%s\n' "${LINES}" > "${TMP_HOSTFILE}"
      mv -f "${TMP_HOSTFILE}" "${HOSTFILE}"
    fi
    NUM_GPUS=(--num_gpus "${NUM_PROCS}")
  elif [[ -n "${NUM_PROCS_SET}" ]]; then
    NUM_GPUS=(--num_gpus "${NUM_PROCS}")  # else the hostfile's slots
  fi
  echo "node ${NODE_RANK} of ${NNODES}: rendezvous at ${MASTER_ADDR}:${MASTER_PORT}" >&2
  run deepspeed --hostfile "${HOSTFILE}" --no_ssh --num_nodes "${NNODES}" \
    --node_rank "${NODE_RANK}" --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT}" \
    "${NUM_GPUS[@]}" "${JOB}" "$@"
fi

# Hostfile + ssh: this one launcher starts every node of HOSTFILE over passwordless ssh (pdsh),
# each with as many processes as its slots (or NUM_PROCS when set).
if [[ -z "${HOSTFILE}" ]]; then
  echo "several nodes (NNODES=${NNODES}) but neither NODE_RANK nor HOSTFILE is set" >&2
  exit 2
fi
NUM_GPUS=()
if [[ -n "${NUM_PROCS_SET}" ]]; then NUM_GPUS=(--num_gpus "${NUM_PROCS}"); fi
run deepspeed --hostfile "${HOSTFILE}" --num_nodes "${NNODES}" --master_addr "${MASTER_ADDR}" \
  --master_port "${MASTER_PORT}" "${NUM_GPUS[@]}" "${JOB}" "$@"
