"""A small convolutional classifier with BatchNorm, for 8x8 (digits) or larger single-channel images.

BatchNorm is why it exists: its batch statistics and running buffers are what data parallel has
to keep in sync (SyncBatchNorm)."""

from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    def __init__(self, width: int = 32, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [batch, channels, h, w] -> logits [batch, classes]."""
        return self.classifier(self.features(images).flatten(1))
