"""Checks of a training config's numbers before anything runs; errors name the field.

A negative step count or a zero batch size would otherwise train nothing (or fail deep inside
XLA) and still exit 0 with results of the untrained model.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

# field path -> (kind, lower bound, whether the bound itself is allowed)
_RULES: dict[str, tuple[type, float, bool]] = {
    "total_steps": (int, 1, True),
    "log_every": (int, 1, True),
    "checkpoint_every": (int, 1, True),
    "keep_checkpoints": (int, 1, True),
    "eval_every": (int, 0, True),
    "eval_batch_size": (int, 1, True),
    "seed": (int, 0, True),
    "input.batch_size": (int, 1, True),
    "input.image_size": (int, 1, True),
    "input.max_size": (int, 1, True),
    "input.eval_size": (int, 1, True),
    "input.max_boxes": (int, 1, True),
    "optim.lr": (float, 0.0, True),
    "optim.backbone_lr": (float, 0.0, True),
    "optim.weight_decay": (float, 0.0, True),
    "optim.clip_norm": (float, 0.0, False),
    "optim.warmup_steps": (int, 0, True),
    "pretrain.steps": (int, 0, True),
    "pretrain.batch_size": (int, 1, True),
    "pretrain.lr": (float, 0.0, False),
}


def _lookup(config: ml_collections.ConfigDict, path: str) -> tuple[bool, Any]:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def check_numbers(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first field of `_RULES` whose value is out of range."""
    for path, (kind, low, inclusive) in _RULES.items():
        present, value = _lookup(config, path)
        if not present:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int and not (number and float(value).is_integer()):
            raise ValueError(f"config.{path}: expected an integer, got {value!r}")
        if not number or not math.isfinite(value):
            raise ValueError(f"config.{path}: expected a finite number, got {value!r}")
        if value < low or (value == low and not inclusive):
            bound = f">= {low}" if inclusive else f"> {low}"
            raise ValueError(f"config.{path}: must be {bound}, got {value!r}")
