"""The tiny token encoder the embedding / GradCache tests train: ``[B, T]`` token ids ->
``[B, T, H]`` hidden states, ``tanh(linear(embedding))`` (the attention mask is accepted and
unused). Parameters are drawn embedding first, then the linear layer, so one seed gives one
model. Not a test module; imported as ``tests.helpers.tiny_encoder``."""
import torch


class TokenEncoder(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab_size, hidden_size)
        self.proj = torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, input_ids, attention_mask):
        return torch.tanh(self.proj(self.emb(input_ids)))
