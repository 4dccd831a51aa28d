"""Vision models that are not classifiers, as users export them from torch: a YOLO detector
(ultralytics' YOLOv8 layout: Conv-BatchNorm-SiLU, C2f's split and concatenation, SPPF's
repeated MaxPool, a nearest Upsample joining two scales, and the decoded head: DFL's softmax
over distance bins, a grid of anchors, boxes scaled by their stride, sigmoid scores) and an OCR
recognizer (EasyOCR's and PaddleOCR's CRNN: a VGG-style feature extractor pooled to one row,
a bidirectional LSTM over the columns, per-column log-softmax over the characters for CTC).

ultralytics itself cannot be installed beside this project's torch (it needs torchvision, which
does not load beside the CPU wheel CI uses), and it exports through ``torch.onnx.export`` as
these do, so the modules are written here at tiny widths with seeded random weights, and go
through both of torch's exporters like the rest of the zoo (issue 49: "YOLO, OCR").
"""

from __future__ import annotations

import numpy as np

from .torch_models import _both

#: the detector's input (a multiple of its largest stride, 32) and the recognizer's line image
IMAGE = 64
LINE = (32, 96)


def _yolo():
    import torch
    from torch import nn

    def conv(c1: int, c2: int, k: int = 1, s: int = 1) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2, bias=False), nn.BatchNorm2d(c2),
                             nn.SiLU())  # fmt: skip

    class C2f(nn.Module):
        """Cross-stage block: split in two, bottlenecks on the last half, all concatenated."""

        def __init__(self, c1: int, c2: int, n: int = 1) -> None:
            super().__init__()
            self.c = c2 // 2
            self.cv1 = conv(c1, 2 * self.c)
            self.cv2 = conv((2 + n) * self.c, c2)
            self.m = nn.ModuleList(
                nn.Sequential(conv(self.c, self.c, 3), conv(self.c, self.c, 3)) for _ in range(n)
            )

        def forward(self, x):
            y = list(self.cv1(x).chunk(2, 1))
            for m in self.m:
                y.append(y[-1] + m(y[-1]))
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, c1: int, c2: int) -> None:
            super().__init__()
            self.cv1 = conv(c1, c1 // 2)
            self.cv2 = conv(c1 * 2, c2)
            self.m = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            x = self.cv1(x)
            y1 = self.m(x)
            y2 = self.m(y1)
            return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))

    class Yolo(nn.Module):
        bins, classes = 4, 3

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(conv(3, 8, 3, 2), conv(8, 16, 3, 2), C2f(16, 16))
            self.p4 = nn.Sequential(conv(16, 32, 3, 2), C2f(32, 32))
            self.p5 = nn.Sequential(conv(32, 32, 3, 2), SPPF(32, 32))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.fuse = C2f(64, 32)
            outputs = 4 * self.bins + self.classes
            self.heads = nn.ModuleList(nn.Conv2d(32, outputs, 1) for _ in range(2))
            steps = torch.arange(self.bins, dtype=torch.float32).view(1, 1, self.bins, 1)
            self.register_buffer("steps", steps)

        def forward(self, images):
            p4 = self.p4(self.stem(images))
            p5 = self.p5(p4)
            f4 = self.fuse(torch.cat((self.up(p5), p4), 1))
            found = []
            for head, feature, stride in ((self.heads[0], f4, 16), (self.heads[1], p5, 32)):
                b, _, h, w = feature.shape
                box, score = head(feature).flatten(2).split((4 * self.bins, self.classes), 1)
                # DFL: each side's distance is the expectation over its bins
                side = (box.view(b, 4, self.bins, h * w).softmax(2) * self.steps).sum(2)
                ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
                anchors = torch.stack((xs, ys), 0).flatten(1).to(side.dtype) + 0.5
                lt, rb = side.chunk(2, 1)
                centre = (anchors + (rb - lt) / 2) * stride
                size = (lt + rb) * stride
                found.append(torch.cat((centre, size, score.sigmoid()), 1))
            return torch.cat(found, 2)  # batch, 4 + classes, anchors of both scales

    return Yolo()


def _crnn():
    import torch
    from torch import nn

    class CRNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(1, 8, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
                nn.Conv2d(8, 16, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
                nn.Conv2d(16, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                nn.MaxPool2d((2, 1), (2, 1)),
                nn.Conv2d(32, 32, 3, 1, 1), nn.ReLU(),
                nn.AvgPool2d((LINE[0] // 8, 1)),  # the remaining rows pooled to one
            )  # fmt: skip
            self.rnn = nn.LSTM(32, 16, bidirectional=True, batch_first=True)
            self.fc = nn.Linear(32, 37)  # CTC's blank, 0-9 and a-z

        def forward(self, images):
            columns = self.features(images).squeeze(2).permute(0, 2, 1)  # batch, width, chans
            hidden, _ = self.rnn(columns)
            return torch.log_softmax(self.fc(hidden), 2)

    return CRNN()


def _images(batch: int, shape: tuple[int, ...], rng: np.random.Generator | None = None):
    if rng is None:
        import torch

        return (torch.rand(batch, *shape),)
    return rng.random(size=(batch, *shape), dtype=np.float32)


_both(
    "yolo",
    _yolo,
    lambda: _images(2, (3, IMAGE, IMAGE)),
    ["images"],
    ["output0"],
    {"images": {0: "batch"}},
    lambda rng: {"images": _images(1, (3, IMAGE, IMAGE), rng)},
)
_both(
    "crnn_ocr",
    _crnn,
    lambda: _images(2, (1, *LINE)),
    ["images"],
    ["log_probs"],
    {"images": {0: "batch"}},
    lambda rng: {"images": _images(1, (1, *LINE), rng)},
)
