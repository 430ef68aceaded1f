"""Print the gradient scale megaloss measures for DDP and DeepSpeed ZeRO 0-3 on this machine.

    python tools/check_engine_scale.py --world 2 --gas 2

Spawns ``--world`` CPU processes (gloo, :func:`megaloss.testing.run_distributed`) and runs
megaloss's start-up probe (:mod:`megaloss.calibration.engine_scale`,
:func:`megaloss.calibration.deepspeed_scale.probe_deepspeed`) for each engine path; prints, for
rank 0, the gradient factor ``c`` (final grad = c * sum of all ranks' micro-batch gradients; the raw
measurement in brackets) and the loss multiplier.
"""
from __future__ import annotations

import argparse


def _worker(rank, world, gas):
    """One rank (gloo already initialised by the harness); returns ``[(name, scale or str)]``."""
    try:
        return _probe_all(gas)
    except BaseException as err:  # noqa: BLE001 - report it in the table rather than fail all
        return [("FAILED", f"ERROR {type(err).__name__}: {err}")]


def _probe_all(gas):
    from megaloss.calibration import EngineScaleError, probe_ddp
    from megaloss.integrations.deepspeed import probe_deepspeed
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    # DeepSpeed's CPU backend would JIT-build an optional shared-memory all-reduce op.
    skip_cpu_shm_comm_build()
    rows = []
    rows.append(("ddp (no_sync accumulation)", probe_ddp(gas=gas)))  # DDP over the default group
    for stage in range(4):
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
               "zero_optimization": {"stage": stage}}
        for backward in ("engine", "loss"):
            if stage == 0 and backward == "loss":
                continue  # DeepSpeed refuses a direct loss.backward() without ZeRO
            try:
                # The probe reads the group it accounts for from the engine (here: the world).
                rows.append((f"zero{stage} {backward}.backward",
                             probe_deepspeed(cfg, backward=backward)))
            except EngineScaleError as err:
                rows.append((f"zero{stage} {backward}.backward", f"ERROR {err}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    args = parser.parse_args()
    from megaloss.testing import run_distributed
    results = run_distributed(_worker, args.world, args.gas, timeout=600)
    print(f"\nworld={args.world} GAS={args.gas}; expected DDP c=1/{args.world}, "
          f"DeepSpeed engine.backward c=1/{args.world * args.gas}")
    for name, scale in results[0]:
        if isinstance(scale, str):
            print(f"  {name:32s} {scale}")
        else:
            print(f"  {name:32s} c = {scale.gradient_factor:.6g} (measured {scale.measured:.6g})"
                  f"  loss multiplier = {scale.loss_multiplier:g}")


if __name__ == "__main__":
    main()
