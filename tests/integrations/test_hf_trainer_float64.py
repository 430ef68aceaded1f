"""MegalossTrainer on a float64 model (single process, no DeepSpeed, which reduces no float64
gradients): the calibration weights follow the model's dtype, so one SGD step (lr 1) equals the
float64 reference to float64 rounding. With weights built in float32 (``1 / D`` rounded to 7
digits) the update was ~1e-8 off. Tolerance: 1e-11 relative per tensor; eval loss 1e-12."""
import pytest
from test_hf_trainer import case_reference, collate, eval_samples, samples, tiny_llama

pytest.importorskip("accelerate")


@pytest.mark.slow  # two Trainer runs, ~35 s: not in the fast tier
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduction", ["sample", "square"])
def test_float64_model_trains_in_float64(tmp_path, reduction):
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    case = {"zero": None, "reduction": reduction}
    model = tiny_llama().double()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, gradient_accumulation_steps=4,
                             max_steps=1, learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True, seed=0)
    trainer = MegalossTrainer(model=model, args=args, train_dataset=samples(),
                              eval_dataset=eval_samples(), data_collator=collate,
                              megaloss_config={"ce": {"chunk_size": 5, "z_loss": 1e-3,
                                                      "loss_reduction": reduction}})
    trainer.train()
    after = trainer.model.model.state_dict()
    _, grads = case_reference(case, before, samples())
    for name, g in grads.items():
        err = float((after[name] - before[name] + g).norm() / g.norm())
        assert err < 1e-11, (name, err)
    ref_eval, _ = case_reference(case, after, eval_samples(), grad=False)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(ref_eval, rel=1e-12)
