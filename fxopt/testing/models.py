"""The project's reference models: the two seed CNNs (3x32x32 inputs) and a few common blocks."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SeedCNN(nn.Module):
    """conv 5x5 (no padding) -> relu -> maxpool, twice, then three linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class SeedCNN2(nn.Module):
    """conv 3x3 (padding 1) -> relu -> maxpool, twice, then two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1, 1)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.view(-1, 32 * 8 * 8))))


class ConvBNAct(nn.Sequential):
    def __init__(self, cin, cout, k=3, stride=1, groups=1, act=nn.ReLU):
        super().__init__(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), act(inplace=True) if act in (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish)
                         else act())


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU, conv-BN, residual add, ReLU."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(y)) + idt)


class InvertedResidual(nn.Module):
    """A MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project (ReLU6), residual."""

    def __init__(self, c, expand=4):
        super().__init__()
        h = c * expand
        self.block = nn.Sequential(ConvBNAct(c, h, 1, act=nn.ReLU6), ConvBNAct(h, h, 3, groups=h, act=nn.ReLU6),
                                   nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.block(x)


class SmallResNet(nn.Module):
    """A tiny ResNet for fast tests (3x32x32 inputs)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = ConvBNAct(3, 16)
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.mb = InvertedResidual(32)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.mb(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


REFERENCE_MODELS = {"seedcnn": SeedCNN, "seedcnn2": SeedCNN2, "smallresnet": SmallResNet}
