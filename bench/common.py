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
