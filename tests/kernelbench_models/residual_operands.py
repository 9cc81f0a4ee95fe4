"""Operands the forward computes, read by the fused chains: a transformer MLP block on a 3-D
input (LayerNorm -> Linear -> GELU -> Linear -> + residual: both Linears fused, the residual
read per element by the second's epilogue, the rows of (batch, sequence) flattened); a Linear
whose chain multiplies by a gate computed before it, then a LayerNorm, then adds the block's
output (per element before and after the norm); and KernelBench #51's residual after the
reduction (a tail op, on (M, 1) + (M, K))."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, d_model)
        self.shift = nn.Parameter(torch.randn(d_model))

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(self.norm(x)))) + x
        flat = h.reshape(-1, h.shape[-1])
        gate = torch.sigmoid(flat)
        skip = flat.clone().detach()
        g = self.proj_norm(self.proj(flat) * gate) + flat
        y = torch.logsumexp(torch.mean(self.head(g) - self.shift, dim=1, keepdim=True), dim=1,
                            keepdim=True)  # fmt: skip
        return F.gelu(y) + skip


batch_size = 4
seq_len = 8
d_model = 64
hidden = 128


def get_inputs():
    return [torch.randn(batch_size, seq_len, d_model)]


def get_init_inputs():
    return [d_model, hidden]
