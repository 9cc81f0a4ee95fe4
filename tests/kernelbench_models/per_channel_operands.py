"""Per-channel parameters and buffers as operands on both sides of the arithmetic ops, with exp,
log and reciprocals kept where float32 is well conditioned."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(0.5 + torch.rand(out_features))
        self.register_buffer("shift", 0.1 * torch.randn(1, out_features))
        self.offset = nn.Parameter(0.1 * torch.randn(out_features))
        self.gn = nn.GroupNorm(num_groups, out_features)
        self.divisor = nn.Parameter(0.5 + 1.5 * torch.rand(out_features))
        self.numerator = nn.Parameter(0.5 + torch.rand(out_features))

    def forward(self, x):
        x = self.fc(x)
        x = x * self.scale
        x = x + self.shift
        x = self.offset - x
        x = torch.tanh(x)
        x = torch.exp(x)
        x = self.gn(x)
        x = 1.5 / (torch.sigmoid(x) + 0.5)
        x = x / self.divisor
        x = self.numerator / (x + 1.0)
        x = torch.log(torch.sigmoid(x))
        return x


batch_size = 64
in_features = 128
out_features = 256
num_groups = 16


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
