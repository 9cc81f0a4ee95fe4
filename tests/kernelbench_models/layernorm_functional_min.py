"""Linear -> F.layer_norm with a weight and no bias (as nn.LayerNorm(bias=False)) -> tanh ->
min over the channels, kept -> + per-row offset."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.ln_weight = nn.Parameter(1.0 + 0.2 * torch.randn(out_features))
        self.offset = nn.Parameter(torch.randn(1))
        self.out_features = out_features

    def forward(self, x):
        x = self.fc(x)
        x = F.layer_norm(x, (self.out_features,), self.ln_weight, None, 1e-5)
        x = torch.tanh(x)
        x = torch.amin(x, dim=1, keepdim=True)
        return x + self.offset


batch_size = 40
in_features = 64
out_features = 160


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
