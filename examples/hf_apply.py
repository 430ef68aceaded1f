"""One call: megaloss.integrations.hf.apply(model) makes a Hugging Face model's own forward compute
megaloss's chunked cross-entropy from its hidden states (no [tokens, vocab] logits), so the stock
transformers Trainer trains it unchanged. Checked against the same Trainer run on the unpatched
model (float64; the model's own loss goes through fp32 logits, hence 1e-6)."""
import copy
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from megaloss.integrations.hf import apply

torch.manual_seed(0)
llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, pad_token_id=0)).double()
ids = torch.randint(1, 128, (16, 12))
data = [{"input_ids": row, "labels": row.clone()} for row in ids]
for row in data[::3]:  # some padded rows
    row["labels"][8:] = -100


def train(model):
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=2, logging_steps=1,
                             learning_rate=0.1, optim="sgd", report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


reference = train(copy.deepcopy(llama))
losses = train(apply(llama))  # the one call: the model's own forward now uses megaloss
print(f"megaloss {losses}\nreference (the model's own loss) {reference}")
torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-6, atol=1e-6)
