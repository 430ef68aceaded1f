# Sourced, not run, by launch/multinode.sh (the DeepSpeed jobs) and launch/train_lm_fsdp.sh (the
# FSDP2 job) once they have exported MEGALOSS_ERROR_FILE: the one place that turns how the ranks
# ended into the script's exit status and last line, so both launchers report a stop and a
# failure alike.
#
# The ranks' files beside ${MEGALOSS_ERROR_FILE}: .rank<r> the message of rank r's error
# (launch/jobs/processes.py); .stopped<r> rank r stopped on request and saved
# (launch/jobs/signals.py); .left<r> rank r left on an error, not dead (launch/jobs/peers.py).

# exit_with_run_status RC: exit the script. Stopped on request (SIGTERM / SIGINT / SIGUSR1) and
# saved on every rank, no rank failed: status 75 (EX_TEMPFAIL, "try again": continue with
# --resume), whatever status the launcher RC got from how the signal reached it. Otherwise RC,
# after the lowest failed rank's message when RC is not 0, so the cause is what a user reads
# last (after the launcher's own closing lines). Removes the ranks' files either way.
exit_with_run_status() {
  local rc="$1"
  if ls "${MEGALOSS_ERROR_FILE}".stopped* >/dev/null 2>&1 \
      && ! ls "${MEGALOSS_ERROR_FILE}".rank* >/dev/null 2>&1; then
    echo "stopped on request after a checkpoint on every rank: exit status 75 (continue with" \
      "--resume)" >&2
    _remove_rank_files
    exit 75
  fi
  if (( rc != 0 )); then
    local first
    # `|| true`: where no rank wrote its error (the launcher itself failed), a failed ls would
    # end the callers' `set -euo pipefail` script with status 2 instead of RC
    first="$(ls "${MEGALOSS_ERROR_FILE}".rank* 2>/dev/null | sort | head -n 1 || true)"
    if [[ -n "${first}" ]]; then
      echo "error: $(cat "${first}")" >&2
    fi
  fi
  _remove_rank_files
  exit "${rc}"
}

_remove_rank_files() {
  rm -f "${MEGALOSS_ERROR_FILE}" "${MEGALOSS_ERROR_FILE}".rank* "${MEGALOSS_ERROR_FILE}".stopped* \
    "${MEGALOSS_ERROR_FILE}".left*
}
