"""Single-process checks of the DeepSpeed wiring: the mpu object and TP tags as DeepSpeed reads
them, and ds_config loading. Multi-process behaviour is in test_deepspeed_equivalence.py."""
import pytest
import torch

from megaloss import Topology, init_dp_tp_mesh
from megaloss.integrations.deepspeed import DeepSpeedMPU
from megaloss.parallel import is_tensor_parallel, mark_tensor_parallel


def test_mpu_single_process_and_tags_deepspeed_reads():
    from deepspeed.runtime.utils import is_model_parallel_parameter
    mpu = DeepSpeedMPU(Topology())
    assert (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == (1, 0)
    assert (mpu.get_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()) == (1, 0)
    assert mpu.get_pipeline_model_parallel_world_size() == 1
    assert mpu.get_data_parallel_group_ranks() == [0]
    with pytest.raises(TypeError, match="topology"):
        DeepSpeedMPU(object())
    with pytest.raises(RuntimeError, match="initialised"):
        init_dp_tp_mesh(1)
    p = torch.nn.Parameter(torch.zeros(3))
    assert not is_model_parallel_parameter(p) and not is_tensor_parallel(p)
    assert mark_tensor_parallel(p) is p
    assert is_model_parallel_parameter(p) and is_tensor_parallel(p) and p.partition_dim == 0
    with pytest.raises(TypeError, match="Parameter"):
        mark_tensor_parallel(torch.zeros(3))


def test_vocab_parallel_head_is_tagged_for_deepspeed():
    """The TP head the wrapper installs is what DeepSpeed counts once per TP group."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megaloss.losses.vocab_parallel import VocabParallelLMHead
    head = VocabParallelLMHead(4, 10)
    assert all(is_model_parallel_parameter(p) for p in head.parameters())


def test_load_ds_config_points_monitors_at_output_dir(tmp_path):
    from megaloss.integrations.deepspeed import load_ds_config
    src = {"csv_monitor": {"enabled": True, "output_path": "", "job_name": "j"},
           "tensorboard": {"enabled": False, "output_path": ""},
           "wandb": {"enabled": True}, "megaloss": {"ce": {"z_loss": 1e-3}}}
    cfg, ml = load_ds_config(src, output_dir=str(tmp_path))
    assert cfg["csv_monitor"]["output_path"] == str(tmp_path / "monitor")
    assert cfg["tensorboard"]["output_path"] == ""  # disabled: untouched
    assert "output_path" not in cfg["wandb"]
    assert src["csv_monitor"]["output_path"] == ""  # the caller's dict is not modified
    assert ml.ce.z_loss == 1e-3
    with pytest.raises(ValueError, match="megaloss.ce.zloss"):
        load_ds_config({"megaloss": {"ce": {"zloss": 1}}})
    topo = Topology.build(1)
    assert topo.dp_size == topo.tp_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Topology.build(2)
