"""Nothing gemmfuse can swap: the only Linear's weight is computed in the forward."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, features))
        self.scale = nn.Parameter(torch.ones(features, 1))

    def forward(self, x):
        return torch.softmax(F.linear(x, self.weight * self.scale), dim=-1)


batch_size = 16
features = 32


def get_inputs():
    return [torch.rand(batch_size, features)]


def get_init_inputs():
    return [features]
