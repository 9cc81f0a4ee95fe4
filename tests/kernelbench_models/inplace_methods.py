"""In-place and method forms: mul_, add_ with a per-channel parameter, F.relu(inplace=True),
sigmoid_, clamp_, log_, exp_, div_, clamp_min, clamp_max (8 float arguments: the
kernel's limit)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.bias2 = nn.Parameter(0.1 * torch.randn(out_features))

    def forward(self, x):
        x = self.fc(x)
        x.mul_(2.0)
        x.add_(self.bias2)
        x = F.relu(x, inplace=True)
        x = x.sigmoid_()
        x = x.clamp_(0.1, 0.9)
        x = x.log_()
        x = x.exp_()
        x = x.div_(3.0)
        x = torch.clamp_min(x, -0.05)
        x = x.clamp_max(0.2)
        return x


batch_size = 64
in_features = 96
out_features = 128


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
