#!/usr/bin/env bash
# One prepared GPU check of megaloss, for a machine with one CUDA GPU and no network (sized for an
# H200 in 8 minutes). See tools/README.md ("gpu_check.sh").
#
#   bash tools/gpu_check.sh [--out DIR] [--wheels DIR] [--budget SECONDS] [--dry-run]
#
#   --out DIR      output folder (default: $OUT; one of the two is required)
#   --wheels DIR   wheels (and sdists) installed first with pip --no-index --no-deps: Liger-Kernel,
#                  Cut Cross-Entropy, DeepSpeed (none of them is on the GPU machine)
#   --budget S     wall-clock seconds for the whole check (default 450); each step gets at most
#                  what is left, a step that cannot start in time is marked "skipped (budget)"
#   --dry-run      the same steps on the CPU with tiny shapes and no CUDA rows (so the script
#                  cannot rot; tests/tools/test_gpu_check.py runs it); installs nothing
#
# megaloss is used from this checkout through PYTHONPATH, not pip-installed (its pin would pull
# another torch). Steps, each writing into the output folder:
#   1. env          environment.txt: python, torch, CUDA, GPU, triton, optional packages
#   2. wheels       pip install --no-index --no-deps of --wheels DIR
#   3. pytest_cuda  the tests marked `cuda` -> pytest_cuda.csv (one row per test), .xml, .txt
#   4. bench_ce     tools/bench_ce.py at N in {8192, 32768}, H=4096, V=151936, bf16: eager,
#                   megaloss (auto), torch's F.linear_cross_entropy (default options and
#                   acc_policy="accurate"), megaloss_torch, megaloss_triton, megaloss_compile,
#                   liger, cce -> bench_ce.csv, bench_ce_impls.csv (side by side), bench_ce.txt
#   5. bench_vp_mnr vocab-parallel CE (one rank) and gathered MNR (world 1) on the one GPU
#                   -> bench_vp_mnr.csv
# and summary.txt (every table) + summary.csv (one row per step: status, seconds, detail).
# Exit status: 0 when every step passed, 1 otherwise (the files are written either way).
set -uo pipefail

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; }

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT:-}"
WHEELS=""
DRY=0
BUDGET=450
PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR="${2:?--out needs a folder}"; shift 2 ;;
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
    --budget) BUDGET="${2:?--budget needs seconds}"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [ -z "$OUT_DIR" ]; then
  echo "gpu_check.sh: no output folder: set \$OUT or pass --out DIR" >&2
  exit 2
fi
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET  # compiled kernels; only the dry run's bench step sets it
cd "$ROOT"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1

START=$(date +%s)
SUMMARY_CSV="$OUT_DIR/summary.csv"
echo "step,status,seconds,detail" > "$SUMMARY_CSV"
FAILED=0

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# run_step NAME CAP_SECONDS FUNCTION: runs FUNCTION (exported) under a timeout of min(CAP, budget
# left) and records status, seconds and the one-line result the step leaves in $OUT_DIR/.detail
# in summary.csv.
run_step() {
  local name=$1 cap=$2; shift 2
  local remaining; remaining=$(left)
  local limit=$(( cap < remaining ? cap : remaining ))
  echo
  echo "=== $name (limit ${limit}s, $(( $(date +%s) - START ))s elapsed) ==="
  if [ "$limit" -lt 15 ]; then
    echo "$name,skipped (budget),0,\"less than 15 s left\"" >> "$SUMMARY_CSV"
    FAILED=1
    return
  fi
  rm -f "$OUT_DIR/.detail"
  local t0; t0=$(date +%s)
  # The step in a child bash (timeout runs programs, not functions) in its own process group,
  # which timeout signals whole: a benchmark's worker processes go with it.
  timeout --kill-after=10 "$limit" bash -c "$*"
  local rc=$?
  local secs=$(( $(date +%s) - t0 ))
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="timeout"; FAILED=1
  elif [ $rc -ne 0 ]; then status="failed (rc $rc)"; FAILED=1; fi
  local detail=""
  [ -f "$OUT_DIR/.detail" ] && detail=$(tr -d '"\n' < "$OUT_DIR/.detail")
  echo "$name,$status,$secs,\"$detail\"" >> "$SUMMARY_CSV"
  echo "--- $name: $status in ${secs}s ${detail}"
}

# 1. environment ---------------------------------------------------------------------------------
step_env() {
  "$PY" - "$OUT_DIR" <<'PY'
import importlib, os, platform, sys
out = sys.argv[1]
lines = [f"python {platform.python_version()} ({sys.executable})"]
import torch
lines.append(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
             f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    lines.append(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
for mod in ("triton", "megaloss", "liger_kernel", "cut_cross_entropy", "deepspeed",
            "transformers"):
    try:
        m = importlib.import_module(mod)
        lines.append(f"{mod} {getattr(m, '__version__', '?')} ({os.path.dirname(m.__file__)})")
    except Exception as e:  # missing, or broken without its dependencies
        lines.append(f"{mod}: not importable ({type(e).__name__}: {str(e)[:100]})")
open(os.path.join(out, "environment.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
open(os.path.join(out, ".detail"), "w").write(
    f"torch {torch.__version__}; cuda {torch.cuda.is_available()}")
PY
}

# 2. wheels --------------------------------------------------------------------------------------
step_wheels() {
  local files=()
  if [ -n "$WHEELS" ]; then
    shopt -s nullglob
    files=("$WHEELS"/*.whl "$WHEELS"/*.tar.gz)
    shopt -u nullglob
  fi
  if [ ${#files[@]} -eq 0 ]; then
    echo "no wheels given (--wheels DIR): Liger / CCE rows will say 'not importable'"
    echo "no wheels" > "$OUT_DIR/.detail"
    return 0
  fi
  if [ $DRY -eq 1 ]; then
    printf 'dry run, would install: %s\n' "${files[@]}"
    echo "dry run: ${#files[@]} files not installed" > "$OUT_DIR/.detail"
    return 0
  fi
  # --no-deps: torch and triton are there already, and nothing can be fetched; one file at a time
  # so that one that does not install (e.g. an sdist that needs a missing build dependency) does
  # not stop the others.
  local ok=0 bad=()
  for f in "${files[@]}"; do
    if "$PY" -m pip install --no-index --no-deps --no-build-isolation -q "$f"; then
      ok=$((ok + 1))
    else
      bad+=("$(basename "$f")")
    fi
  done
  echo "installed $ok of ${#files[@]}${bad:+; failed: ${bad[*]}}" > "$OUT_DIR/.detail"
  [ ${#bad[@]} -eq 0 ]
}

# 3. tests marked cuda ---------------------------------------------------------------------------
step_pytest() {
  # Only the files that use the marker: collecting the whole suite would import test modules
  # whose optional dependencies (deepspeed, ...) this machine may lack.
  local files
  files=$(grep -rlE "mark\.cuda" tests --include='test_*.py' | sort)
  if [ -z "$files" ]; then
    echo "no test file uses the cuda marker" | tee "$OUT_DIR/.detail"
    return 1
  fi
  echo "files: $files"
  # shellcheck disable=SC2086
  "$PY" -m pytest -m cuda -q -p no:cacheprovider -o addopts="" -rs \
      --junitxml="$OUT_DIR/pytest_cuda.xml" $files > "$OUT_DIR/pytest_cuda.txt" 2>&1
  local rc=$?
  tail -n 30 "$OUT_DIR/pytest_cuda.txt"
  "$PY" - "$OUT_DIR" <<'PY'
import csv, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
path = os.path.join(out, "pytest_cuda.xml")
rows = []
if os.path.exists(path):
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
                break
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": case.get("time"), "message": message})
with open(os.path.join(out, "pytest_cuda.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=["test", "outcome", "seconds", "message"])
    w.writeheader()
    w.writerows(rows)
counts = {}
for r in rows:
    counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
detail = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no tests ran"
open(os.path.join(out, ".detail"), "w").write(detail)
PY
  # pytest exit 5 (nothing collected/selected) is a failure here too: the marker must select.
  return $rc
}

# 4. bench_ce ------------------------------------------------------------------------------------
step_bench_ce() {
  local impls=(torch_lce torch_lce_accurate megaloss_torch megaloss_triton megaloss_compile liger
               cce)
  if [ $DRY -eq 1 ]; then
    # CPU, tiny; the Triton rows through its interpreter, torch.compile without code generation;
    # every case in one process (the fresh worker per case is tests/tools/test_bench_tools.py's).
    TRITON_INTERPRET=1 "$PY" tools/bench_ce.py --no-cuda --sizes 64 --hidden 16 \
        --vocab 256 --chunk-size 32 --repeats 1 --time-budget 1 --threads 2 --timeout 120 \
        --same-process \
        --impls "${impls[@]}" --compile-backend aot_eager \
        --csv "$OUT_DIR/bench_ce.csv" --impl-csv "$OUT_DIR/bench_ce_impls.csv" \
        > "$OUT_DIR/bench_ce.txt"
  else
    "$PY" tools/bench_ce.py --no-cpu --sizes 8192 32768 --hidden 4096 --vocab 151936 \
        --cuda-dtypes bfloat16 --chunk-size 1024 --repeats 3 --time-budget 15 --timeout 240 \
        --impls "${impls[@]}" \
        --csv "$OUT_DIR/bench_ce.csv" --impl-csv "$OUT_DIR/bench_ce_impls.csv" \
        > "$OUT_DIR/bench_ce.txt"
  fi
  local rc=$?
  cat "$OUT_DIR/bench_ce.txt"
  echo "rc $rc; $(($(wc -l < "$OUT_DIR/bench_ce_impls.csv" 2>/dev/null || echo 1) - 1)) rows" \
      > "$OUT_DIR/.detail"
  return $rc
}

# 5. vocab-parallel CE and MNR on one device -----------------------------------------------------
step_vp_mnr() {
  "$PY" - "$OUT_DIR" "$DRY" <<'PY'
import csv, gc, math, os, statistics, sys, time
import torch
import torch.nn.functional as F
import megaloss
from megaloss.ops.cross_entropy_options import CrossEntropyOptions

out, dry = sys.argv[1], sys.argv[2] == "1"
cuda = torch.cuda.is_available() and not dry
dev = torch.device("cuda" if cuda else "cpu")
sync = torch.cuda.synchronize if cuda else (lambda: None)
rows = []


def measure(fn, reps):
    """fn() -> loss (backward inside the measurement): median seconds of reps warm runs, extra
    peak MiB of one run above what was allocated before it (CUDA allocator; nan on CPU), loss."""
    fn()  # warm-up: kernels compiled, workspaces allocated
    sync()
    mem = math.nan
    if cuda:
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = fn()
    sync()
    if cuda:
        mem = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), mem, float(loss)


def add(bench, config, impl, result, ref=None, note=""):
    t, mem, loss = result
    rows.append({"bench": bench, "device": dev.type, "config": config, "impl": impl,
                 "time_s": round(t, 5), "extra_MiB": round(mem, 1), "loss": loss,
                 "loss_diff_vs_first": "" if ref is None else abs(loss - ref), "note": note})
    print(rows[-1])


# Vocab-parallel CE at TP=1 (no process group: a single rank), against the single-device loss.
n, h, v, dtype = (64, 16, 300, torch.float32) if dry else (8192, 4096, 151936, torch.bfloat16)
g = torch.Generator().manual_seed(0)
hid = torch.randn(n, h, generator=g).to(dev, dtype).requires_grad_()
w = (torch.randn(v, h, generator=g) * 0.02).to(dev, dtype).requires_grad_()
y = torch.randint(0, v, (n,), generator=g).to(dev)
hid.grad, w.grad = torch.zeros_like(hid), torch.zeros_like(w)
config = f"N={n} H={h} V={v} {str(dtype).split('.')[-1]} chunk=1024 tp=1"
ref = None
for impl, fn in [
        ("linear_cross_entropy (auto)", lambda o: megaloss.linear_cross_entropy(
            hid, w, y, options=o, return_stats=True)),
        ("vocab_parallel tp=1 (auto)", lambda o: megaloss.linear_cross_entropy(
            hid, w, y, options=o, return_stats=True, vocab_parallel_options=megaloss.VocabParallelOptions())),
        ("vocab_parallel tp=1 (torch epilogue)",
         lambda o: megaloss.linear_cross_entropy(
             hid, w, y, options=o.replace(impl="torch"), return_stats=True,
             vocab_parallel_options=megaloss.VocabParallelOptions()))]:
    def step(fn=fn):
        loss = fn(CrossEntropyOptions(chunk_size=1024)).loss
        loss.backward()
        return loss.detach()
    res = measure(step, 1 if dry else 3)
    ref = res[2] if ref is None else ref
    add("vocab_parallel", config, impl, res, ref)

del hid, w, y
gc.collect()

# MNR (in-batch negatives, cosine, T=0.05) on one device, against the plain formulation.
d = 16 if dry else 768
for b in ((64,) if dry else (4096, 16384)):
    g = torch.Generator().manual_seed(b)
    q = torch.randn(b, d, generator=g).to(dev, dtype).requires_grad_()
    p = (q.detach().float() + torch.randn(b, d, generator=g).to(dev)).to(dtype).requires_grad_()
    config = f"B={b} D={d} {str(dtype).split('.')[-1]} chunk=1024 world=1"

    def mnr():
        loss = megaloss.mnr_loss(q, p, chunk_size=1024)
        loss.backward()
        return loss.detach()

    def naive():
        s = F.normalize(q, dim=-1) @ F.normalize(p, dim=-1).T / 0.05
        loss = F.cross_entropy(s.float(), torch.arange(b, device=dev))
        loss.backward()
        return loss.detach()

    first = measure(naive, 1 if dry else 3)
    add("mnr", config, "plain torch (full score matrix)", first)
    add("mnr", config, "megaloss.mnr_loss", measure(mnr, 1 if dry else 3), first[2])
    del q, p
    gc.collect()

with open(os.path.join(out, "bench_vp_mnr.csv"), "w", newline="") as f:
    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
    wr.writeheader()
    wr.writerows(rows)
worst = max((r["loss_diff_vs_first"] for r in rows if r["loss_diff_vs_first"] != ""), default=0)
open(os.path.join(out, ".detail"), "w").write(f"{len(rows)} rows; max loss diff {worst:.3g}")
PY
}

# summary ----------------------------------------------------------------------------------------
write_summary() {
  "$PY" - "$OUT_DIR" "$DRY" "$(( $(date +%s) - START ))" <<'PY'
import csv, os, sys
out, dry, secs = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
sys.path.insert(0, "tools")
from _bench_common import format_table


def number(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def table(name, cols=None):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return f"({name}: not written)"
    rows = [{k: number(v) for k, v in r.items()} for r in csv.DictReader(open(path, newline=""))]
    if not rows:
        return f"({name}: empty)"
    return format_table(rows, cols or list(rows[0]))


parts = [f"megaloss gpu_check{' (DRY RUN: CPU, tiny shapes, no CUDA rows)' if dry else ''}, "
         f"{secs} s", "", open(os.path.join(out, "environment.txt")).read()
         if os.path.exists(os.path.join(out, "environment.txt")) else "",
         "steps:", table("summary.csv"), "",
         "tests marked cuda:", table("pytest_cuda.csv", ["test", "outcome", "seconds"]), "",
         "linear cross-entropy, side by side (bench_ce_impls.csv; ratios against eager; "
         "roofline = time of the 3 bare GEMMs / time; extra_MiB = peak above inputs, weight "
         "and their grads):",
         table("bench_ce_impls.csv", ["device", "dtype", "tokens", "impl", "epilogue", "time_s",
                                      "time_vs_eager", "roofline", "extra_MiB", "mem_vs_eager",
                                      "loss_diff_vs_eager", "note"]), "",
         "vocab-parallel CE (one rank) and MNR on one device (bench_vp_mnr.csv):",
         table("bench_vp_mnr.csv"), ""]
open(os.path.join(out, "summary.txt"), "w").write("\n".join(parts))
print("\n".join(parts))
PY
}

if [ $DRY -eq 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
then
  echo "gpu_check.sh: torch sees no CUDA GPU here; --dry-run runs the check on the CPU" >&2
  exit 2
fi
export OUT_DIR WHEELS DRY PY
export -f step_env step_wheels step_pytest step_bench_ce step_vp_mnr
echo "megaloss gpu_check: out=$OUT_DIR dry_run=$DRY budget=${BUDGET}s wheels=${WHEELS:-none}"
run_step env 60 step_env
run_step wheels 90 step_wheels
run_step pytest_cuda 150 step_pytest
run_step bench_ce 300 step_bench_ce
run_step bench_vp_mnr 90 step_vp_mnr
rm -f "$OUT_DIR/.detail"
echo
write_summary
exit $FAILED
