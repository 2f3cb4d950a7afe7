"""What the benchmarks share: interleaved timing and random detection inputs.

Scripts in bench/ run as `python bench/X.py`, so this module is imported as `common`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def time_alternating(
    fns: dict[str, Callable[[], Any]], steps: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds of each of `steps` calls of every fn (each must block until done), after
    `warmup` calls. The calls alternate between the fns, so a change in the machine's load
    during the run weighs on all of them alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def random_detection_input(seed: int, batch: int, size: int, max_boxes: int, num_classes: int):
    """Images [B, S, S, 3] float32, boxes [B, M, 4] normalized cxcywh, labels [B, M], and a
    mask [B, M] with 3 to 6 real boxes per image."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, size, size, 3), np.float32)
    box_size = rng.uniform(0.05, 0.5, (batch, max_boxes, 2))
    center = rng.uniform(box_size / 2, 1 - box_size / 2)
    boxes = np.concatenate([center, box_size], -1).astype(np.float32)
    labels = rng.integers(0, num_classes, (batch, max_boxes)).astype(np.int32)
    counts = rng.integers(3, 7, batch)
    mask = np.arange(max_boxes)[None, :] < counts[:, None]
    return images, boxes, labels, mask


def summary(times: list[float]) -> str:
    """Median [min-max] seconds."""
    return f"{statistics.median(times):8.3f} [{min(times):.3f}-{max(times):.3f}]"


def torch_detection_batch(inputs):
    """`random_detection_input`'s arrays as transformers' detectors take them: pixel values
    [B, 3, S, S], an all-ones pixel mask, and one {"class_labels", "boxes"} dict per image."""
    import torch

    images, boxes, labels, mask = inputs
    pixel_values = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    pixel_mask = torch.ones(images.shape[:3], dtype=torch.long)
    targets = [
        {
            "class_labels": torch.from_numpy(labels[i][mask[i]]).long(),
            "boxes": torch.from_numpy(boxes[i][mask[i]]),
        }
        for i in range(len(images))
    ]
    return pixel_values, pixel_mask, targets


def torch_adamw(model, lr: float, backbone_lr: float, weight_decay: float):
    """AdamW in DETR's two parameter groups (the backbone at `backbone_lr`) over the parameters
    that require grad, and those parameters (for gradient clipping)."""
    import torch

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    backbone = [p for n, p in trainable if n.startswith("model.backbone.")]
    rest = [p for n, p in trainable if not n.startswith("model.backbone.")]
    optimizer = torch.optim.AdamW(
        [{"params": backbone, "lr": backbone_lr}, {"params": rest, "lr": lr}],
        lr=lr,
        weight_decay=weight_decay,
    )
    return optimizer, [p for _, p in trainable]
