"""Under ``deepspeed --num_gpus 2``: run each example script named on the command line in turn,
in the same ranks, as ``python <script>`` would (``__main__``, its own ``sys.argv``), so the
examples share one launch and one start-up (importing torch / deepspeed / transformers costs
more than these tiny examples). An example's failing assert exits the rank with status 1."""
import argparse
import runpy
import sys

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=0)
p.add_argument("scripts", nargs="+")
args = p.parse_args()
for script in args.scripts:
    if args.local_rank == 0:
        print(f"=== examples_in_one_launch: {script} ===", flush=True)
    sys.argv = [script, f"--local_rank={args.local_rank}"]
    from megaloss.integrations.deepspeed import freeze_imported_objects
    freeze_imported_objects()  # the earlier examples' imports, out of DeepSpeed's gc.collect
    runpy.run_path(script, run_name="__main__")
