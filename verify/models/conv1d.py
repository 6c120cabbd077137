"""A tiny 1-D convolutional network over sequences (plain torch): a ``Conv1d`` stem, two residual
blocks (a plain convolution, then a grouped dilated one with ``padding="same"`` and a depthwise one;
the second block strided, with a 1x1 projection shortcut), GroupNorm and ReLU after each, mean pooling
over time and a linear classifier trained with cross entropy. Channel counts are not divisible by 4
where it matters (12 channels in 3 groups by default)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from verify.models.registry import ModelCase, register_model, tokens


def sequence_batch(classes: int, seed: int, channels: int = 5, length: int = 16):
    """Step -> (sequences ``4 x channels x length``, labels), seeded."""
    def batch(step: int):
        g = torch.Generator().manual_seed(9000 + 100 * seed + step)
        return torch.randn(4, channels, length, generator=g), tokens(classes, (4,), 9000 + 100 * seed + step)
    return batch


class Block1d(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 3, stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(groups, cout)
        self.grouped = nn.Conv1d(cout, cout, 3, padding="same", dilation=2, groups=groups)
        self.depthwise = nn.Conv1d(cout, cout, 5, padding=2, groups=cout, bias=False)
        self.gn2 = nn.GroupNorm(groups, cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv1d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))

    def forward(self, x):
        y = F.relu(self.gn1(self.conv1(x)))
        y = self.gn2(self.depthwise(self.grouped(y)))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ConvNet1d(nn.Module):
    def __init__(self, channels: int = 5, classes: int = 5, width: int = 12, groups: int = 3):
        super().__init__()
        self.stem = nn.Conv1d(channels, width, 5, padding=2)
        self.gn = nn.GroupNorm(groups, width)
        self.blocks = nn.Sequential(Block1d(width, width, 1, groups), Block1d(width, 2 * width, 2, groups))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, seqs, labels):
        x = F.relu(self.gn(self.stem(seqs)))
        x = self.blocks(x).mean(dim=2)
        return F.cross_entropy(self.head(x), labels)


@register_model("conv1d_net", widenable=True)
def conv1d_net(seed: int, width: int = 12) -> ModelCase:
    """``conv1d_net@WIDTH``: ``WIDTH`` stem channels in ``WIDTH // 4`` groups."""
    torch.manual_seed(seed)
    return ModelCase(ConvNet1d(width=width, groups=max(1, width // 4)), sequence_batch(5, seed))
