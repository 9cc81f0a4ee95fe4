"""Linear -> x + 1 -> GroupNorm (one group, affine=False) -> Softplus -> ELU -> ReLU6 -> x / 3."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, eps):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.gn = nn.GroupNorm(1, out_features, eps=eps, affine=False)
        self.softplus = nn.Softplus(beta=2.0, threshold=10.0)
        self.relu6 = nn.ReLU6()

    def forward(self, x):
        x = self.fc(x)
        x = x + 1.0
        x = self.gn(x)
        x = self.softplus(x)
        x = F.elu(x, alpha=0.5)
        x = self.relu6(x)
        x = x / 3.0
        return x


batch_size = 64
in_features = 80
out_features = 96
eps = 1e-3


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, eps]
