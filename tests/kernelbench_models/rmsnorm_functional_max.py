"""Linear -> F.rms_norm without a weight (eps=1e-6) -> x * 2 -> max over the channels
(keepdim): an RMSNorm written functionally, followed by a reduction."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.out_features = out_features

    def forward(self, x):
        x = F.rms_norm(self.fc(x), (self.out_features,), eps=1e-6)
        return torch.amax(x * 2.0, dim=1, keepdim=True)


batch_size = 32
in_features = 64
out_features = 128


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
