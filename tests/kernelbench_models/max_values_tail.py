"""Linear -> relu -> max over channels (.values, no keepdim) -> tail ops: x * 2, sigmoid, and a
subtraction that broadcasts (M,) against (4, 1) to (4, M)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.shift = nn.Parameter(torch.randn(4, 1))

    def forward(self, x):
        x = self.fc(x)
        x = torch.relu(x)
        x = x.max(dim=1).values
        x = x * 2.0
        x = torch.sigmoid(x)
        x = x - self.shift
        return x


batch_size = 64
in_features = 96
out_features = 128


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
