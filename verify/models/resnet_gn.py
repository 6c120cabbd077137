"""A tiny ResNet with GroupNorm (plain torch, no torchvision): a conv stem, two basic blocks (one
strided, with a 1x1 projection shortcut), global average pooling and a linear classifier trained
with cross entropy. Channel and group counts are not divisible by 2 or 4 where it matters."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.registry import ModelCase, register_model, tokens


def image_batch(classes: int, seed: int, size: int = 8, channels: int = 3):
    """Step -> (images ``4 x channels x size x size``, labels), seeded."""
    def batch(step: int):
        g = torch.Generator().manual_seed(7000 + 100 * seed + step)
        return torch.randn(4, channels, size, size, generator=g), tokens(classes, (4,), 7000 + 100 * seed + step)
    return batch


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(groups, cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))

    def forward(self, x):
        y = F.relu(self.gn1(self.conv1(x)))
        y = self.gn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNetGN(nn.Module):
    def __init__(self, classes: int = 5, width: int = 12, groups: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.gn = nn.GroupNorm(groups, width)
        self.blocks = nn.Sequential(BasicBlock(width, width, 1, groups), BasicBlock(width, 2 * width, 2, groups))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images, labels):
        x = F.relu(self.gn(self.stem(images)))
        x = self.blocks(x).mean(dim=(2, 3))
        return F.cross_entropy(self.head(x), labels)


@register_model("resnet_gn", widenable=True)
def resnet_gn(seed: int, width: int = 12) -> ModelCase:
    """``resnet_gn@WIDTH``: ``WIDTH`` stem channels in ``WIDTH // 4`` groups (3 groups of 4 by default)."""
    torch.manual_seed(seed)
    return ModelCase(ResNetGN(width=width, groups=max(1, width // 4)), image_batch(5, seed))
