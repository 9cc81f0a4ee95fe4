"""Fusable and unfusable blocks side by side: a chain through a softmax, a Linear on a 3-D
input, a chain (through x * sigmoid(x)) whose value is used twice, a Linear chain inside a
submodule, and F.linear."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, features, num_groups):
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.norm = nn.GroupNorm(num_groups, features)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.fc1 = nn.Linear(in_features, out_features)
        self.fc2 = nn.Linear(in_features, out_features)
        self.fc3 = nn.Linear(in_features, out_features)
        self.block = Block(in_features, num_groups)
        self.proj = nn.Parameter(0.1 * torch.randn(out_features, in_features))

    def forward(self, x):
        a = torch.softmax(torch.relu(self.fc1(x)), dim=1)
        b = self.fc2(x.unsqueeze(1)).squeeze(1)
        c = self.fc3(x)
        c = c * torch.sigmoid(c)  # swish: fused
        c = c - c.mean(dim=1, keepdim=True)  # c used twice: the chain stops before
        d = F.linear(self.block(x), self.proj)
        return a + b + c + d


batch_size = 32
in_features = 64
out_features = 96
num_groups = 8


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
