"""Print the gradient scale megaloss measures for DDP and DeepSpeed ZeRO 0-3 on this machine.

    python tools/check_engine_scale.py --world 2 --gas 2

Spawns ``--world`` CPU processes (gloo) and runs megaloss's start-up probe
(:mod:`megaloss.calibration.engine_scale`) for each engine path; prints, on rank 0, the measured
scale ``c`` (final grad = c * sum of all ranks' micro-batch gradients) and the loss multiplier.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch.multiprocessing as mp


def _worker(rank, world, port, gas, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        queue.put((rank, _probe_all(gas)))
    except BaseException as err:  # noqa: BLE001 - report, so the parent does not wait forever
        queue.put((rank, [("FAILED", f"ERROR {type(err).__name__}: {err}")]))
    finally:
        dist.destroy_process_group()


def _probe_all(gas):
    import torch.distributed as dist

    from megaloss.calibration import EngineScaleError, probe_ddp, probe_deepspeed
    from megaloss.distributed.deepspeed_compat import skip_cpu_shm_comm_build
    # DeepSpeed's CPU backend would JIT-build an optional shared-memory all-reduce op.
    skip_cpu_shm_comm_build()
    group = dist.group.WORLD
    rows = []
    rows.append(("ddp (no_sync accumulation)", probe_ddp(gas=gas, group=group)))
    for stage in range(4):
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
               "zero_optimization": {"stage": stage}}
        for backward in ("engine", "loss"):
            if stage == 0 and backward == "loss":
                continue  # DeepSpeed refuses a direct loss.backward() without ZeRO
            try:
                rows.append((f"zero{stage} {backward}.backward",
                             probe_deepspeed(cfg, group=group, backward=backward)))
            except EngineScaleError as err:
                rows.append((f"zero{stage} {backward}.backward", f"ERROR {err}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--gas", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args.gas, queue), daemon=True)
             for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    print(f"\nworld={args.world} GAS={args.gas}; expected DDP c=1/{args.world}, "
          f"DeepSpeed engine.backward c=1/{args.world * args.gas}")
    for name, scale in results[0]:
        if isinstance(scale, str):
            print(f"  {name:32s} {scale}")
        else:
            print(f"  {name:32s} c = {scale.measured:.6g}  loss multiplier = "
                  f"{scale.loss_multiplier:g}")


if __name__ == "__main__":
    main()
