"""KernelBench #33's and #41's patterns with the BatchNorm1d in eval mode, where it is the
per-channel ops (x - running_mean) * weight / sqrt(running_var + eps) + bias: Linear -> * 2 ->
BatchNorm1d -> ReLU; Linear -> GroupNorm -> BatchNorm1d without affine -> tanh; and #41's whole
chain with its BatchNorm1d left in training mode (batch statistics, then the same per-channel
ops: the fused call splits there)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features, num_groups):
        super().__init__()
        self.fc1 = nn.Linear(in_features, out_features)
        self.bn1 = nn.BatchNorm1d(out_features)
        self.fc2 = nn.Linear(in_features, out_features)
        self.gn = nn.GroupNorm(num_groups, out_features)
        self.bn2 = nn.BatchNorm1d(out_features, affine=False, eps=1e-3)
        self.fc3 = nn.Linear(in_features, out_features)
        self.bn3 = nn.BatchNorm1d(out_features)
        with torch.no_grad():  # statistics and affine vectors as training would leave them
            for bn in (self.bn1, self.bn2, self.bn3):
                bn.running_mean.uniform_(-1.0, 1.0)
                bn.running_var.uniform_(0.25, 4.0)
                if bn.affine:
                    bn.weight.uniform_(0.5, 1.5)
                    bn.bias.uniform_(-0.5, 0.5)
        self.bn1.eval()
        self.bn2.eval()

    def forward(self, x):
        a = torch.relu(self.bn1(self.fc1(x) * 2.0))
        b = torch.tanh(self.bn2(self.gn(self.fc2(x))))
        c = torch.relu(torch.nn.functional.gelu(self.bn3(self.fc3(x))))
        return a + b + c


batch_size = 32
in_features = 64
out_features = 96
num_groups = 4


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
