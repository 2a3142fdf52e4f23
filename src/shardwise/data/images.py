"""Image classification data: scikit-learn's handwritten digits (8x8, 1797 images) and synthetic images."""

from __future__ import annotations

import torch


class ImageSet:
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[indices], self.labels[indices]


def load_digits_split(val_fraction: float) -> tuple[ImageSet, ImageSet]:
    """Digits scaled to [0, 1] as [N, 1, 8, 8]; the last val_fraction of the (fixed) order validates."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    cut = int(len(labels) * (1 - val_fraction))
    return ImageSet(images[:cut], labels[:cut]), ImageSet(images[cut:], labels[cut:])


def synthetic_images(count: int, seed: int, num_classes: int = 10, size: int = 8) -> ImageSet:
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 1, size, size, generator=generator)
    labels = torch.randint(0, num_classes, (count,), generator=generator)
    return ImageSet(images, labels)
