"""The script of the shared ``deepspeed --num_gpus 2`` launch of this folder (conftest.py's
``shared_hf_launch``): runs the ``_worker_main(argv)`` of several test modules one after the
other in the same two processes (one process start-up and one import of torch, deepspeed,
transformers and sentence-transformers for all of them).

``--spec`` is a JSON list of ``{"file", "argv", "done", "crash"}``. After a module's worker
returns, rank 0 writes ``done``; when it raises (SystemExit included), the rank writes its
traceback to ``crash`` and the launch stops (the ranks may be out of step; the fixture relaunches
the modules after it). Between modules the environment is restored (a W&B case sets WANDB_*),
DeepSpeed's globals are reset and transformers' global ZeRO-3 config is unset (it would
``zero.Init`` the next module's model; ``deepspeed_state.py``), and the module's process groups
are destroyed (``megaloss.testing.destroy_subgroups``).
"""
import argparse
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(file):
    spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickling and dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    a, _ = parser.parse_known_args(argv)  # the launcher may add --local_rank
    sys.path[:0] = [str(HERE), str(HERE.parent / "helpers")]
    rank = int(os.environ.get("RANK", "0"))
    for entry in json.loads(Path(a.spec).read_text()):
        from deepspeed_state import reset_deepspeed_state

        from megaloss.integrations.deepspeed import freeze_imported_objects
        from megaloss.testing import destroy_subgroups
        reset_deepspeed_state()  # with transformers' ZeRO-3 config
        environ = dict(os.environ)
        try:
            module = _load(entry["file"])
            freeze_imported_objects()  # the imports (and the last module's survivors)
            module._worker_main(entry["argv"])
        except BaseException:  # noqa: BLE001 - reported to that module's tests
            Path(f"{entry['crash']}.rank{rank}").write_text(traceback.format_exc())
            raise SystemExit(1) from None
        finally:
            os.environ.clear()
            os.environ.update(environ)
        reset_deepspeed_state()
        destroy_subgroups()  # the module's groups: their gloo threads would poll through the rest
        if rank == 0:
            Path(entry["done"]).touch()


if __name__ == "__main__":
    main(sys.argv[1:])
