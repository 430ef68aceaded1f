#!/usr/bin/env bash
# A user's install, checked: build megaloss's wheel, install it into a fresh venv OUTSIDE the
# checkout that already holds torch (which must stay exactly as it was), at the lowest versions
# the package's ranges admit (tools/constraints-lowest.txt), then run the examples and the
# console scripts from a directory that is not the checkout. CI runs it (.ci/run).
#   bash tools/wheel_check.sh [WORKDIR]     (default: a fresh temporary directory)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d -t megaloss-wheel-XXXXXX)}"
mkdir -p "$WORK"
LOWEST="$REPO/tools/constraints-lowest.txt"
step() { printf '\n== wheel_check: %s\n' "$*"; }

step "build the wheel"
rm -rf "$WORK/dist"
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$REPO"
WHEEL="$(ls "$WORK"/dist/megaloss-*.whl)"
python3 - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["megaloss/py.typed", "megaloss/configs/zero2.json", "megaloss/configs/zero2_hf.json",
        "megaloss/cli/check_layout.py"]
missing = [n for n in need if n not in names]
assert not missing, f"the wheel lacks {missing}"
assert not [n for n in names if n.startswith(("tests/", "launch/", "tools/"))], "repo dirs in wheel"
print(f"{sys.argv[1]}: {len(names)} files, package data present")
PY

step "the setup.py shim reads the one source of metadata, pyproject.toml"
shim="$(cd "$REPO" && python3 setup.py -q --version 2>/dev/null | tail -n 1)"
case "$WHEEL" in *"megaloss-$shim-"*) echo "setup.py --version: $shim (the wheel's)";;
  *) echo "setup.py --version gave '$shim', the wheel is $WHEEL" >&2; exit 1;; esac

step "a fresh venv with the user's torch installed first"
rm -rf "$WORK/venv"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q --upgrade "pip>=24" setuptools wheel
"$PY" -m pip install -q -c "$LOWEST" torch
before="$("$PY" -W ignore -c 'import torch, os; print(torch.__version__, os.path.getmtime(torch.__file__))')"

step "install megaloss from the wheel at the lowest supported versions"
# deepspeed is an sdist whose build imports torch: --no-build-isolation builds it against the
# venv's torch instead of downloading another torch into a build environment.
"$PY" -m pip install -q --no-build-isolation -c "$LOWEST" "megaloss[deepspeed,hf] @ file://$WHEEL"
after="$("$PY" -W ignore -c 'import torch, os; print(torch.__version__, os.path.getmtime(torch.__file__))')"
[ "$before" = "$after" ] || { echo "torch changed: $before -> $after" >&2; exit 1; }
"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|deepspeed|transformers|pydantic|numpy|megaloss) '
echo "torch untouched: $after"

step "run from outside the checkout"
RUN="$WORK/user"
rm -rf "$RUN" && mkdir -p "$RUN" && cd "$RUN"
export PATH="$WORK/venv/bin:$PATH" OMP_NUM_THREADS=1 PYTHONNOUSERSITE=1
unset PYTHONPATH
python -c 'import megaloss, sys; p = megaloss.__file__; print(p); sys.exit(p.startswith(sys.argv[1]))' "$REPO"
python "$REPO/examples/single_device.py"
deepspeed --num_gpus 2 "$REPO/examples/hf_causal_lm.py" > hf_causal_lm.log 2>&1 || {
    tail -40 hf_causal_lm.log; exit 1; }
grep -E "step (1|20):" hf_causal_lm.log
megaloss-check-layout --help > check_layout_help.txt && head -3 check_layout_help.txt
megaloss-comm-model --markdown > comm_model.md && head -5 comm_model.md
# a user's own config, in the user's directory
python - <<'PY'
import json
from megaloss.configs import config_path
cfg = json.loads(config_path("zero2").read_text())
cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
cfg["megaloss"]["tensor_parallel_size"] = 1
json.dump(cfg, open("my_ds.json", "w"), indent=1)
PY
megaloss-check-layout --deepspeed_config my_ds.json --num_procs 2 --steps 2 > check_layout.txt \
    || { cat check_layout.txt; exit 1; }
tail -2 check_layout.txt
echo "wheel_check: OK"
