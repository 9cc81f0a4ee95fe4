"""KernelBench #98's and #55's patterns, pooling over the channels: Linear -> AvgPool1d over
x.unsqueeze(1) -> squeeze(1) -> GELU -> * 2 -> max values (folded into the weights); Linear ->
F.avg_pool1d -> tanh -> sum; Linear -> MaxPool1d -> sum (over the windows' maxima)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, pool_kernel_size, scale_factor):
        super().__init__()
        self.fc1 = nn.Linear(in_features, out_features)
        self.avg_pool = nn.AvgPool1d(kernel_size=pool_kernel_size)
        self.fc2 = nn.Linear(in_features, out_features)
        self.fc3 = nn.Linear(in_features, out_features)
        self.max_pool = nn.MaxPool1d(2)
        self.scale_factor = scale_factor

    def forward(self, x):
        a = self.avg_pool(self.fc1(x).unsqueeze(1)).squeeze(1)
        a = torch.max(F.gelu(a) * self.scale_factor, dim=1).values
        b = F.avg_pool1d(self.fc2(x).unsqueeze(1), 3).squeeze(1)
        b = torch.tanh(b).sum(dim=1)
        c = self.max_pool(self.fc3(x).unsqueeze(1)).squeeze(1)
        return a + b + c.sum(dim=1)


batch_size = 32
in_features = 64
out_features = 96
pool_kernel_size = 4
scale_factor = 2.0


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, pool_kernel_size, scale_factor]
