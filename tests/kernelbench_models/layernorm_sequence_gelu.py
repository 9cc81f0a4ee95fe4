"""A transformer-style block on (batch, sequence, features): Linear -> nn.LayerNorm over the
features -> GELU (the rows flattened: a LayerNorm acts on each row alone)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.ln = nn.LayerNorm(out_features, eps=1e-6)
        with torch.no_grad():  # away from the (1, 0) initialisation, so the affine part shows
            self.ln.weight.add_(0.1 * torch.randn(out_features))
            self.ln.bias.add_(0.1 * torch.randn(out_features))
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.ln(self.fc(x)))


batch_size = 4
sequence = 12
in_features = 64
out_features = 96


def get_inputs():
    return [torch.randn(batch_size, sequence, in_features)]


def get_init_inputs():
    return [in_features, out_features]
