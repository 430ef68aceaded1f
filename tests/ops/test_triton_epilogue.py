"""The Triton epilogue without a GPU: its kernels compiled for Hopper, and its numbers (under
Triton's interpreter, in a subprocess) against the torch epilogue.

The interpreted cases live in ``tests/ops/triton_interpreter_cases.py``: ``TRITON_INTERPRET=1``
must be set before triton is first imported (triton jits its own library then), which this
process did at collection, and must not leak into the processes that other tests spawn; so one
test here runs that file in a fresh interpreter with the variable set.
"""
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from megaloss.ops import triton_common, triton_epilogue  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join("tests", "ops", "triton_interpreter_cases.py")
LOG_PROBS_CASES = os.path.join("tests", "ops", "triton_log_probs_cases.py")  # same subprocess


def background_jobs(folder, env):
    """The interpreted cases' pytest run, started with the session (tests/conftest.py)."""
    def interpreted():
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               CASES, LOG_PROBS_CASES], cwd=ROOT,
                              env=dict(env, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=800)
    return {"interpreted": interpreted}


@pytest.mark.slow  # spawns a process (~10 s: the interpreter runs each program in Python)
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("interpreted")
def test_interpreted_kernels_match_torch_epilogue(background):
    proc = background
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert proc.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 27, summary
    assert not re.search(r"skipped|failed|error", summary), summary


def test_kernels_compile_for_hopper():
    """The interpreter runs the kernels as Python; this compiles them as the GPU would (TTIR ->
    PTX -> cubin for sm_90, the H100/H200; no GPU needed), each dtype and each soft-capping /
    smoothing specialisation at least once."""
    if triton_common.interpreted():
        pytest.skip("this process runs triton in its interpreter")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    target = GPUTarget("cuda", 90, 32)
    scalars = {"stride_row": "i32", "n_cols": "i32", "vocab_start": "i32",
               "ignore_index": "i32", "cap": "fp32"}
    for dt, has_cap, has_smooth in [("bf16", True, True), ("fp32", False, False),
                                    ("fp16", True, False), ("bf16", False, True)]:
        sig = {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "max_ptr": "*fp32",
               "sumexp_ptr": "*fp32", "target_ptr": "*fp32", "sumlogits_ptr": "*fp32",
               **scalars, "HAS_CAP": "constexpr", "HAS_SMOOTH": "constexpr", "BLOCK": "constexpr"}
        src = ASTSource(triton_epilogue._stats_kernel, sig,
                        constexprs={"HAS_CAP": has_cap, "HAS_SMOOTH": has_smooth, "BLOCK": 4096})
        assert triton.compile(src, target=target, options={"num_warps": 8}).asm["cubin"]
    for dt, has_cap in [("bf16", True), ("fp32", False), ("fp16", False)]:
        sig = {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "lse_ptr": "*fp32",
               "coef_ptr": "*fp32", **scalars, "two_z": "fp32", "eps_over_v": "fp32",
               "one_minus_eps": "fp32", "HAS_CAP": "constexpr", "BLOCK": "constexpr"}
        src = ASTSource(triton_epilogue._grad_kernel, sig,
                        constexprs={"HAS_CAP": has_cap, "BLOCK": 2048})
        assert triton.compile(src, target=target, options={"num_warps": 4}).asm["cubin"]


@pytest.mark.slow  # ~4 s of compiling: over the fast tier's budget
def test_log_probs_kernels_compile_for_hopper():
    """The log-probabilities kernels (:mod:`megaloss.ops.triton_log_probs`) compiled for sm_90
    as the GPU would, each dtype and soft-capping / entropy specialisation at least once."""
    if triton_common.interpreted():
        pytest.skip("this process runs triton in its interpreter")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton has no ahead-of-time compile API: {e}")
    from megaloss.ops import triton_log_probs
    target = GPUTarget("cuda", 90, 32)
    scalars = {"stride_row": "i32", "n_cols": "i32", "vocab_start": "i32",
               "ignore_index": "i32", "cap": "fp32", "temperature": "fp32"}
    for dt, has_cap, has_ent in [("bf16", True, True), ("fp32", False, False),
                                 ("fp16", False, True)]:
        sig = {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "max_ptr": "*fp32",
               "sumexp_ptr": "*fp32", "target_ptr": "*fp32", "weighted_ptr": "*fp32",
               **scalars, "HAS_CAP": "constexpr", "HAS_ENT": "constexpr", "BLOCK": "constexpr"}
        src = ASTSource(triton_log_probs._stats_kernel, sig,
                        constexprs={"HAS_CAP": has_cap, "HAS_ENT": has_ent, "BLOCK": 4096})
        assert triton.compile(src, target=target, options={"num_warps": 8}).asm["cubin"]
        sig = {"logits_ptr": f"*{dt}", "labels_ptr": "*i64", "lse_ptr": "*fp32",
               "mu_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32", **scalars,
               "HAS_CAP": "constexpr", "HAS_ENT": "constexpr", "BLOCK": "constexpr"}
        src = ASTSource(triton_log_probs._grad_kernel, sig,
                        constexprs={"HAS_CAP": has_cap, "HAS_ENT": has_ent, "BLOCK": 2048})
        assert triton.compile(src, target=target, options={"num_warps": 4}).asm["cubin"]
