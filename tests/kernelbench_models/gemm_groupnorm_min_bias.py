"""KernelBench #75's pattern at a small size: Linear -> GroupNorm -> min over channels
(keepdim) -> + bias of shape (1, C, 1, 1), which broadcasts (M, 1) to (1, C, M, 1)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = self.gemm(x)
        x = self.group_norm(x)
        x = torch.min(x, dim=1, keepdim=True)[0]
        x = x + self.bias
        return x


batch_size = 64
in_features = 96
out_features = 128
num_groups = 16
bias_shape = (1, out_features, 1, 1)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, bias_shape]
