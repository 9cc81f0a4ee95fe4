"""KernelBench #68's pattern: Linear -> torch.min(x, a 0-dim parameter) (elementwise, not a
reduction) -> x - that parameter -> torch.max(x, a per-channel buffer)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, constant):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.constant = nn.Parameter(torch.tensor(constant))
        self.register_buffer("floor", -0.1 * torch.rand(out_features))

    def forward(self, x):
        x = self.linear(x)
        x = torch.min(x, self.constant)
        x = x - self.constant
        return torch.max(x, self.floor)


batch_size = 32
in_features = 64
out_features = 96
constant = 0.2


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, constant]
