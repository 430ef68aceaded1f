"""``megaloss.deepspeed``: the DeepSpeed hooks, under the public name issue 6 gives them.

A re-export only; the code and its documentation live in :mod:`megaloss.integrations.deepspeed`
(DP x TP groups and the ``mpu`` for ``deepspeed.initialize``, the validated ds_config, the
measured gradient scale and calibrator, metrics through ``engine.monitor``). The modules that
``engine.forward`` runs are in :mod:`megaloss.integrations.hf` (``CausalLMWithLoss``) and
:mod:`megaloss.integrations.embedding` (``EmbeddingModelWithMNR``); the training step in
:mod:`megaloss.integrations.trainer`.

Importing this module does not import ``deepspeed`` (the functions import it when called).
"""
from .integrations.deepspeed import (MONITOR_SECTIONS, MegalossEngine, ParallelState,
                                     build_parallel, configure_launched_process, initialize,
                                     load_ds_config, skip_cpu_shm_comm_build, write_metrics)

__all__ = ["ParallelState", "MegalossEngine", "build_parallel", "load_ds_config", "initialize",
           "write_metrics", "skip_cpu_shm_comm_build", "configure_launched_process",
           "MONITOR_SECTIONS"]
