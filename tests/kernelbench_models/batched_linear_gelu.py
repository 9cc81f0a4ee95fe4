"""A Linear on a 3-D input (batch, sequence, features) with a pointwise chain (GELU, a scale):
fused with its leading dimensions as rows, and the softmax over the features after it (a row
op, as a LayerNorm)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = torch.nn.functional.gelu(self.fc(x))
        x = x * 0.5
        return torch.softmax(x, dim=-1)


batch_size = 8
seq_len = 16
in_features = 32
out_features = 48


def get_inputs():
    return [torch.rand(batch_size, seq_len, in_features)]


def get_init_inputs():
    return [in_features, out_features]
