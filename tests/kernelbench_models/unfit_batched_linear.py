"""Nothing gemmfuse can swap: the only Linear takes a 3-D input."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=-1)


batch_size = 8
seq_len = 16
in_features = 32
out_features = 32


def get_inputs():
    return [torch.rand(batch_size, seq_len, in_features)]


def get_init_inputs():
    return [in_features, out_features]
