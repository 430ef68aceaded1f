"""Single-process checks of the DeepSpeed wiring: the mpu object and TP tags as DeepSpeed reads
them, and ds_config loading. Multi-process behaviour is in test_deepspeed_equivalence.py."""
import os

import pytest
import torch

from megaloss import Topology
from megaloss.integrations.deepspeed.mpu import DeepSpeedMPU
from megaloss.parallel import init_dp_tp_mesh, mark_tensor_parallel
from megaloss.parallel.param_tags import is_tensor_parallel


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

    from megaloss.losses.vocab_parallel_head import VocabParallelLMHead
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


class _FakeMonitor:
    """What DeepSpeed's MonitorMaster offers (enabled, write_events, the csv / tb monitors)."""

    def __init__(self, log_dir=None):
        self.enabled, self.events = True, []
        self.csv_monitor = self.tb_monitor = self.wandb_monitor = None
        if log_dir is not None:
            from types import SimpleNamespace
            self.csv_monitor = SimpleNamespace(enabled=True, log_dir=str(log_dir), filenames=[])

    def write_events(self, events):
        self.events += events


def test_write_metrics_uses_the_sample_axis_deepspeed_uses():
    from types import SimpleNamespace

    from megaloss.integrations.deepspeed import write_metrics
    from megaloss.integrations.deepspeed.monitor import monitor_step
    engine = SimpleNamespace(monitor=_FakeMonitor(), global_samples=48, global_steps=3)
    assert monitor_step(engine) == 48
    write_metrics(engine, {"loss": 2.5, "grad_norm": None})
    write_metrics(engine, {"loss": 2.0}, prefix="Eval/megaloss/")
    write_metrics(engine, {"x": 1}, step=7)
    assert engine.monitor.events == [("Train/megaloss/loss", 2.5, 48),
                                     ("Eval/megaloss/loss", 2.0, 48), ("Train/megaloss/x", 1.0, 7)]


def test_continue_monitors_truncates_csv_files_and_writes_no_second_header(tmp_path):
    from types import SimpleNamespace

    from megaloss.integrations.deepspeed.monitor import continue_monitors
    (tmp_path / "Train_megaloss_loss.csv").write_text("step,loss\n8,3.0\n16,2.5\n24,2.0\n")
    (tmp_path / "Eval_megaloss_loss.csv").write_text("step,loss\n0,4.0\n16,2.6\n")
    engine = SimpleNamespace(monitor=_FakeMonitor(tmp_path), global_samples=16)
    continue_monitors(engine)
    assert (tmp_path / "Train_megaloss_loss.csv").read_text() == "step,loss\n8,3.0\n16,2.5\n"
    assert (tmp_path / "Eval_megaloss_loss.csv").read_text() == "step,loss\n0,4.0\n16,2.6\n"
    assert sorted(engine.monitor.csv_monitor.filenames) == ["Eval_megaloss_loss",
                                                            "Train_megaloss_loss"]
    continue_monitors(SimpleNamespace(monitor=None))  # no monitor: nothing to do


def test_needs_output_dir_and_default_run_folder(tmp_path, monkeypatch):
    from megaloss.integrations.deepspeed.engine import default_output_dir, needs_output_dir
    monkeypatch.delenv("WANDB_DIR", raising=False)
    assert not needs_output_dir({"csv_monitor": {"enabled": False, "output_path": ""}})
    assert needs_output_dir({"csv_monitor": {"enabled": True, "output_path": ""}})
    assert not needs_output_dir({"csv_monitor": {"enabled": True, "output_path": "/x"}})
    assert needs_output_dir({"wandb": {"enabled": True}})
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert not needs_output_dir({"wandb": {"enabled": True}})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "20260101-000000")
    first = default_output_dir()
    assert first == os.path.join("runs", "20260101-000000")
    (tmp_path / first).mkdir(parents=True)
    assert default_output_dir() == first + "-2"  # never an existing run's folder


def test_wandb_cache_follows_wandb_dir_unless_user_set(tmp_path, monkeypatch):
    from megaloss.integrations.deepspeed.engine import keep_wandb_cache_in_run_dir
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a"))
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    keep_wandb_cache_in_run_dir()
    assert os.environ["WANDB_CACHE_DIR"] == str(tmp_path / "a")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "b"))  # a later run in the same process
    keep_wandb_cache_in_run_dir()
    assert os.environ["WANDB_CACHE_DIR"] == str(tmp_path / "b")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "mine"))  # the user's own: kept
    keep_wandb_cache_in_run_dir()
    assert os.environ["WANDB_CACHE_DIR"] == str(tmp_path / "mine")


def test_checkpoint_helpers(tmp_path):
    import random

    from megaloss.integrations.deepspeed.checkpoint import (
        latest_tag,
        prune_checkpoints,
        resolve_checkpoint,
        rng_state,
        set_rng_state,
    )
    state = rng_state()
    a = (random.random(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])

    for k in (2, 4, 6):
        (tmp_path / f"step_{k}").mkdir()
        (tmp_path / f"step_{k}" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        resolve_checkpoint(tmp_path)  # no latest yet
    (tmp_path / "latest").write_text("step_4")
    assert latest_tag(tmp_path) == "step_4"
    assert resolve_checkpoint(tmp_path) == (tmp_path, "step_4")
    assert resolve_checkpoint(tmp_path / "step_6") == (tmp_path, "step_6")
    (tmp_path / "step_6" / "dcp").mkdir()  # a folder inside a checkpoint: the checkpoint named
    with pytest.raises(FileNotFoundError, match=r"did you mean .*step_6, the checkpoint"):
        resolve_checkpoint(tmp_path / "step_6" / "dcp")
    prune_checkpoints(tmp_path, 1)  # keeps the newest and the one latest names
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4", "step_6"]
    (tmp_path / "latest").write_text("step_9")
    with pytest.raises(FileNotFoundError, match="step_9"):
        resolve_checkpoint(tmp_path)


def test_continue_monitors_purges_tensorboard_events_after_the_checkpoint(tmp_path):
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from megaloss.integrations.deepspeed.monitor import continue_monitors
    writer = SummaryWriter(log_dir=str(tmp_path))
    for x, v in ((8, 3.0), (16, 2.5), (24, 2.0)):  # the interrupted run got past its checkpoint
        writer.add_scalar("Train/megaloss/loss", v, x)
    writer.close()
    master = _FakeMonitor()
    master.tb_monitor = SimpleNamespace(summary_writer=SummaryWriter(log_dir=str(tmp_path)))
    continue_monitors(SimpleNamespace(monitor=master, global_samples=16))
    master.tb_monitor.summary_writer.add_scalar("Train/megaloss/loss", 1.5, 24)
    master.tb_monitor.summary_writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Train/megaloss/loss")] == [
        (8, 3.0), (16, 2.5), (24, 1.5)]


def test_freeze_imported_objects_collects_garbage_then_freezes_the_survivors():
    import gc
    import weakref

    from megaloss.integrations.deepspeed.compat import freeze_imported_objects

    class Node:
        pass

    garbage, alive = Node(), Node()
    garbage.self, alive.self = garbage, alive  # reference cycles: only gc.collect frees them
    dead = weakref.ref(garbage)
    del garbage
    before = gc.get_freeze_count()
    try:
        freeze_imported_objects()
        assert dead() is None, "the garbage cycle was frozen instead of collected"
        assert gc.get_freeze_count() > before
        assert not any(o is alive for o in gc.get_objects())  # frozen: not tracked now
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
