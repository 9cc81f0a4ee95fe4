"""Linear -> activations (swish as x * torch.sigmoid(x)) and scalar arithmetic, no GroupNorm
(module, F. and torch. forms)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.relu = nn.ReLU()
        self.gelu_tanh = nn.GELU(approximate="tanh")

    def forward(self, x):
        x = self.fc(x)
        x = self.relu(x)
        x = x * 0.5
        x = F.gelu(x)
        x = self.gelu_tanh(x)
        x = x * torch.sigmoid(x)  # swish, as KernelBench writes it
        x = torch.tanh(x)
        x = torch.sigmoid(x)
        x = x - 0.25
        return x


batch_size = 64
in_features = 96
out_features = 128


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
