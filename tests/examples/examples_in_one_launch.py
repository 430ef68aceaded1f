"""Under ``deepspeed --num_gpus 2``: run each example script named on the command line in turn,
in the same ranks, as ``python <script>`` would (``__main__``, its own ``sys.argv``), so the
examples share one launch and one start-up (importing torch / deepspeed / transformers costs
more than these tiny examples). An example's failing assert exits the rank with status 1.

Each example must end with ``torch.distributed.destroy_process_group()``, as a script run on its
own must (left alive, gloo's threads can end a finished rank in ``std::terminate`` at interpreter
exit); a rank whose example did not call it exits with status 1. Initialising the default group
again in the same process is not reliable (the second rendezvous can meet the first one's keys
in rank 0's store and hang), so for every example but the last the call destroys only the
subgroups and keeps the default group for the next one, with DeepSpeed's cached groups reset
(``deepspeed_state.fresh_deepspeed_state``). The last example's call destroys everything."""
import argparse
import runpy
import sys

import torch.distributed as dist

from megaloss.integrations.deepspeed import freeze_imported_objects
from megaloss.testing import destroy_subgroups
from tests.helpers.deepspeed_state import fresh_deepspeed_state  # PYTHONPATH: the repo root

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=0)
p.add_argument("scripts", nargs="+")
args = p.parse_args()

destroy_everything = dist.destroy_process_group
destroyed = []


def destroy_process_group(group=None):
    """The examples' ``torch.distributed.destroy_process_group``: recorded; see above."""
    if group is not None:
        return destroy_everything(group)
    destroyed.append(True)
    if len(destroyed) == len(args.scripts):
        return destroy_everything()
    destroy_subgroups()


dist.destroy_process_group = destroy_process_group
for i, script in enumerate(args.scripts, start=1):
    if args.local_rank == 0:
        print(f"=== examples_in_one_launch: {script} ===", flush=True)
    sys.argv = [script, f"--local_rank={args.local_rank}"]
    freeze_imported_objects()  # the earlier examples' imports, out of DeepSpeed's gc.collect
    with fresh_deepspeed_state():
        runpy.run_path(script, run_name="__main__")
    if len(destroyed) != i:
        sys.exit(f"{script} did not end with torch.distributed.destroy_process_group()")
assert not dist.is_initialized()
