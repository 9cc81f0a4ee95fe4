"""KernelBench #55's pattern and its kin, a max pooling over the channels right before a
channel reduction (the reduction takes the windows' maxima): Linear -> MaxPool1d(2) -> sum ->
* scale (#55 itself); Linear on 98 channels -> F.max_pool1d(4) -> mean (the last two channels
make no whole window and are dropped); Linear -> MaxPool1d(8) -> logsumexp; Linear ->
MaxPool1d(2) -> relu -> sum (no reduction right after the pooling: a bare GEMM)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_features, out_features, kernel_size, scale_factor):
        super().__init__()
        self.fc1 = nn.Linear(in_features, out_features)
        self.max_pool = nn.MaxPool1d(kernel_size)
        self.fc2 = nn.Linear(in_features, out_features + 2)
        self.fc3 = nn.Linear(in_features, out_features)
        self.wide_pool = nn.MaxPool1d(8)
        self.fc4 = nn.Linear(in_features, out_features)
        self.scale_factor = scale_factor

    def forward(self, x):
        a = self.max_pool(self.fc1(x).unsqueeze(1)).squeeze(1)
        a = torch.sum(a, dim=1) * self.scale_factor
        b = F.max_pool1d(self.fc2(x).unsqueeze(1), 4).squeeze(1).mean(dim=1)
        c = torch.logsumexp(self.wide_pool(self.fc3(x).unsqueeze(1)).squeeze(1), dim=1)
        d = torch.relu(self.max_pool(self.fc4(x).unsqueeze(1)).squeeze(1)).sum(dim=1)
        return a + b + c + d


batch_size = 32
in_features = 64
out_features = 96
kernel_size = 2
scale_factor = 0.5


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, kernel_size, scale_factor]
