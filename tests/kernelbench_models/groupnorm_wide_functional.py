"""Linear -> F.group_norm with groups of 256 channels (parameters of the model) ->
leaky_relu -> hardswish -> mish -> x * per-channel scale."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.num_groups = num_groups
        self.gn_weight = nn.Parameter(1.0 + 0.1 * torch.randn(out_features))
        self.gn_bias = nn.Parameter(0.1 * torch.randn(out_features))
        self.scale = nn.Parameter(0.5 + torch.rand(out_features))

    def forward(self, x):
        x = self.fc(x)
        x = F.group_norm(x, self.num_groups, self.gn_weight, self.gn_bias, eps=1e-4)
        x = F.leaky_relu(x, 0.2)
        x = F.hardswish(x)
        x = F.mish(x)
        x = x * self.scale
        return x


batch_size = 48
in_features = 64
out_features = 512
num_groups = 2


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
