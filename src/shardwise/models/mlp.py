"""A plain multi-layer perceptron over flattened images: the smallest model every strategy must train."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, width), nn.GELU(),
            nn.Linear(width, width), nn.GELU(),
            nn.Linear(width, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.flatten(1))
