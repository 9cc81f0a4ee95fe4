"""Every reduction over channels, with keepdim and without, in function and method forms: one
Linear each (a ModuleList), the results concatenated."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(in_features, out_features) for _ in range(10))
        self.gn = nn.GroupNorm(num_groups, out_features)

    def forward(self, x):
        f = self.fcs
        outs = [
            torch.amin(f[0](x), dim=1),
            f[1](x).min(1, keepdim=True)[0],
            torch.max(f[2](x), 1)[0],
            f[3](x).amax(dim=-1, keepdim=True),
            torch.sum(self.gn(f[4](x)), dim=1),
            f[5](x).sum(dim=(1,), keepdim=True),
            f[6](x).mean(-1),
            torch.mean(torch.tanh(f[7](x)), dim=1, keepdim=True),
            torch.logsumexp(f[8](x), dim=1),
            f[9](x).logsumexp(1, keepdim=True),
        ]
        return torch.cat([o.reshape(-1) for o in outs])


batch_size = 32
in_features = 64
out_features = 96
num_groups = 4


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
