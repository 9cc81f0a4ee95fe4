"""KernelBench #70's and #40's patterns, values read again: Linear -> sigmoid(x) * s + x (the
GEMM result added back), then Linear -> y * s + y.clone().detach() (a detached residual)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, scaling_factor):
        super().__init__()
        self.fc1 = nn.Linear(in_features, out_features)
        self.fc2 = nn.Linear(out_features, out_features)
        self.scaling_factor = scaling_factor

    def forward(self, x):
        x = self.fc1(x)
        original_x = x
        x = torch.sigmoid(x) * self.scaling_factor + original_x
        y = self.fc2(x)
        residual = y.clone().detach()
        return y * self.scaling_factor + residual


batch_size = 32
in_features = 64
out_features = 96
scaling_factor = 2.0


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, scaling_factor]
