"""DETR's optimizer: AdamW with a lower backbone learning rate, gradient clipping, step decay.

The COUNTS paper's schedule is `decay_epochs=(20, 34)` with `decay_factor=0.1` over 60 epochs
and weight decay 1e-4; epochs become steps through the training split's size.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from ood_jax import sharding


def learning_rate_schedule(base: float, config: ml_collections.ConfigDict, steps_per_epoch: float):
    """`base`, ramped up linearly over `warmup_steps`, times `decay_factor` at each of
    `decay_epochs`."""
    boundaries = {
        int(round(epoch * steps_per_epoch)): config.decay_factor for epoch in config.decay_epochs
    }
    decay = optax.piecewise_constant_schedule(base, boundaries)
    warmup_steps = config.get("warmup_steps", 0)
    if not warmup_steps:
        return decay
    return lambda step: decay(step) * jnp.minimum(1.0, (step + 1) / warmup_steps)


def make_optimizer(
    config: ml_collections.ConfigDict, params: Any, steps_per_epoch: float
) -> tuple[optax.GradientTransformation, dict[str, Any]]:
    """Returns (optimizer, {group: schedule}); parameters whose path matches
    `config.backbone_pattern` use `config.backbone_lr`, the rest `config.lr`, and those matching
    `config.frozen_pattern` (DETR keeps the ImageNet stem and first stage fixed) are not trained."""
    backbone = re.compile(config.backbone_pattern)
    frozen = re.compile(config.get("frozen_pattern") or r"(?!)")

    def group(path, _):
        name = sharding.path_name(path)
        if frozen.match(name):
            return "frozen"
        return "backbone" if backbone.match(name) else "transformer"

    labels = jax.tree_util.tree_map_with_path(group, params)
    schedules = {
        "backbone": learning_rate_schedule(config.backbone_lr, config, steps_per_epoch),
        "transformer": learning_rate_schedule(config.lr, config, steps_per_epoch),
    }
    groups = {
        name: optax.adamw(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay)
        for name, schedule in schedules.items()
    }
    groups["frozen"] = optax.set_to_zero()
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.clip_norm), optax.multi_transform(groups, labels)
    )
    return optimizer, schedules
