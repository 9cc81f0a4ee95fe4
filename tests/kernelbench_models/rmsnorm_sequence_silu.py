"""A transformer-style block on (batch, sequence, features): Linear -> nn.RMSNorm over the
features (eps=None: float32's machine epsilon, as PyTorch resolves it) -> SiLU, the rows
flattened (an RMSNorm acts on each row alone)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.norm = nn.RMSNorm(out_features)
        with torch.no_grad():  # away from the all-ones initialisation, so the weight shows
            self.norm.weight.add_(0.1 * torch.randn(out_features))
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.norm(self.fc(x)))


batch_size = 4
sequence = 12
in_features = 64
out_features = 96


def get_inputs():
    return [torch.randn(batch_size, sequence, in_features)]


def get_init_inputs():
    return [in_features, out_features]
