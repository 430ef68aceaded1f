"""Run a case on a shared DeepSpeed rank (tests/integrations/conftest.py's ``deepspeed_pool``), or
a job in a shared launch (``launch_helpers.run_jobs_in_one_launch``), as on a fresh one:
DeepSpeed keeps parallel state in module globals that outlive an engine (``engine.destroy()``
leaves them): ``deepspeed.utils.groups.mpu`` stays the last engine's ``mpu``, so an engine built
without one after an engine built with one reads the old model-parallel sizes
(``DeepSpeedEngine._configure_distributed_model``), and the cached world / data-parallel groups
stay. Before and after every case (or job) those globals are put back to what they were before
the process's first one, and transformers' global DeepSpeed config (ZeRO-3 ``zero.Init`` of the
next model) is unset (:func:`fresh_deepspeed_state`).

Not a test module; imported as ``tests.helpers.deepspeed_state``, in the ranks too (the
repository root is on their ``sys.path``).
"""
import contextlib
import importlib
import sys

# the modules of deepspeed 0.19 whose globals hold parallel groups or the mpu
MODULES = ("deepspeed.utils.groups", "deepspeed.runtime.pipe.p2p",
           "deepspeed.runtime.sequence_parallel.parallel_state_sp",
           "deepspeed.runtime.tensor_parallel.init_utils",
           "deepspeed.runtime.activation_checkpointing.checkpointing")
_VALUES = (type(None), bool, int, float, str, tuple, list, dict, set)
_PRISTINE = None  # {module name: {global: value}}, taken before the rank's first case


def _copy(value):
    return value.copy() if isinstance(value, (list, dict, set)) else value


def _globals(module):
    return {k: _copy(v) for k, v in vars(module).items()
            if not k.startswith("__") and isinstance(v, _VALUES)}


def reset_deepspeed_state():
    """DeepSpeed's module globals put back to what they were before the first call (taken
    then), transformers' global DeepSpeed config unset."""
    global _PRISTINE
    if _PRISTINE is None:
        _PRISTINE = {}
        for name in MODULES:
            try:
                _PRISTINE[name] = _globals(importlib.import_module(name))
            except ImportError:  # another DeepSpeed version: nothing of it to reset
                pass
    for name, values in _PRISTINE.items():
        vars(sys.modules[name]).update({k: _copy(v) for k, v in values.items()})
    if "transformers.integrations.deepspeed" in sys.modules:
        sys.modules["transformers.integrations.deepspeed"].unset_hf_deepspeed_config()


@contextlib.contextmanager
def fresh_deepspeed_state():
    """DeepSpeed's module globals reset (:func:`reset_deepspeed_state`) on entry, so the block
    runs as in a fresh process, and again on exit, so that nothing of the block (its process
    groups above all, which the callers destroy next) stays referenced from them."""
    reset_deepspeed_state()
    try:
        yield
    finally:
        reset_deepspeed_state()


def run_with_fresh_deepspeed_state(rank, world_size, fn, *args):
    """``fn(rank, world_size, *args)`` in :func:`fresh_deepspeed_state` (see the module
    docstring)."""
    with fresh_deepspeed_state():
        return fn(rank, world_size, *args)
