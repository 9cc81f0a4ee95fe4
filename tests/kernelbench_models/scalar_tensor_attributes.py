"""Operands that are 0-dim tensors: a non-persistent buffer and a plain tensor attribute (neither
in the state_dict), next to a module the forward never calls."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features, bias=False)
        self.register_buffer("temperature", torch.tensor(2.0), persistent=False)
        self.factor = torch.tensor(0.75)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        x = self.fc(x)
        x = x / self.temperature
        x = x * self.factor
        x = torch.relu(x)
        return x


batch_size = 32
in_features = 64
out_features = 64


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
