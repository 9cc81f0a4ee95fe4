"""One Linear module called twice (shared weights): each call fused with its own chain (the
second's a softmax over the features), the weight split once between them."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        return torch.softmax(self.fc(torch.relu(self.fc(x))), dim=-1)


batch_size = 16
features = 32


def get_inputs():
    return [torch.rand(batch_size, features)]


def get_init_inputs():
    return [features]
