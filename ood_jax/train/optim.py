"""DETR's optimizer: AdamW with a lower backbone learning rate, gradient clipping, step decay;
and the exponential moving average of the parameters that evaluation may use instead of them.

The COUNTS paper's schedule is `decay_epochs=(20, 34)` with `decay_factor=0.1` over 60 epochs
and weight decay 1e-4; epochs become steps through the training split's size.

EMA (`config.ema_decay` > 0; 0 is off, the default; detrex and MMDetection offer the same):
after the update that makes step t + 1 from step t, `ema <- d_t * ema + (1 - d_t) * params`,
starting from the initial parameters. d_t is `config.ema_decay`, or with `config.ema_warmup`
(the default) the warmup of TensorFlow's `ExponentialMovingAverage(num_updates=t)`:
d_t = min(ema_decay, (1 + t) / (10 + t)), so that early averages forget the random
initialization within tens of steps rather than ~1 / (1 - ema_decay) of them.
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


def init_ema(params: Any) -> Any:
    """The average's starting point: the parameters, in float32 whatever their dtype."""
    return jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)


def ema_decay_at(step: jax.Array, decay: float, warmup: bool) -> jax.Array:
    """d_t of the module docstring for the update after `step` (= t) updates, float32."""
    decay = jnp.float32(decay)
    if not warmup:
        return decay
    t = jnp.asarray(step, jnp.float32)
    return jnp.minimum(decay, (1.0 + t) / (10.0 + t))


def update_ema(ema: Any, params: Any, step: jax.Array, *, decay: float, warmup: bool) -> Any:
    """The average after the update that made `params` from the state at `step`, in float32.

    Written as `ema + (1 - d) * (params - ema)`: the same average, in which a parameter that
    does not move (a frozen backbone) keeps an average bit-identical to itself.
    """
    keep = ema_decay_at(step, decay, warmup)
    return jax.tree.map(lambda e, p: e + (1.0 - keep) * (p.astype(jnp.float32) - e), ema, params)
