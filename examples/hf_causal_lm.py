import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megaloss import CausalLMWithLoss, Topology
from megaloss.configs import config_path  # the shipped ds_configs (package data)
from megaloss.integrations.deepspeed import initialize, load_ds_config, train_step
from megaloss.integrations.deepspeed.compat import configure_launched_process

configure_launched_process()  # quiet DeepSpeed; on CPU: threads per process, no JIT build
deepspeed.init_distributed()
ds_config, ml = load_ds_config(config_path("zero2"), output_dir="runs/mine")  # checks "megaloss"
topo = Topology.build(ml.tensor_parallel_size)  # DP x TP process groups
torch.manual_seed(0)  # TP ranks must start from the same weights
V, T = 512, 64
llama = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4))
model = CausalLMWithLoss(llama, options=ml.ce.options(), tp_group=topo.tp_group)
me = initialize(model, ds_config, topology=topo, output_dir="runs/mine")  # probe, engine, ...

micro, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
g = torch.Generator().manual_seed(topo.dp_rank)  # DP ranks: different data; TP ranks: the same
for _ in range(20):
    ids = [(torch.randint(0, V, (micro, 1), generator=g) + torch.arange(T)) % V for _ in range(gas)]
    m = train_step(me, [{"input_ids": x, "labels": x} for x in ids])  # logs via engine.monitor
    if torch.distributed.get_rank() == 0:
        print(f"step {m.step}: loss {m.loss:.3f}")
# torch's docs (torch.distributed, "Shutdown"): destroy the process groups at the end. Left
# alive, gloo's threads are torn down with the interpreter and a rank can die in std::terminate
# ("terminate called without an active exception", exit -6) after a finished run.
torch.distributed.destroy_process_group()
