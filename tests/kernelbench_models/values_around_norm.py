"""Values read again on both sides of a GroupNorm, one of them detached, and after the
reduction: Linear -> sigmoid(x) + x -> GroupNorm -> t = tanh(x); (t * scale + x) * t.detach()
-> logsumexp over the channels (keepdim) -> x * mish(x)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.norm = nn.GroupNorm(num_groups, out_features)
        self.scale = nn.Parameter(torch.rand(out_features) + 0.5)

    def forward(self, x):
        h = self.fc(x)
        h = torch.sigmoid(h) + h
        h = self.norm(h)
        t = torch.tanh(h)
        h = t * self.scale + h
        h = h * t.detach()
        h = torch.logsumexp(h, dim=1, keepdim=True)
        return h * F.mish(h)


batch_size = 32
in_features = 64
out_features = 96
num_groups = 6


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
