"""Detectors by name, so configs stay data: `config.model = {"name": ..., "args": {...}}`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from flax import linen as nn

MODELS = {
    "detr": "ood_jax.models.detr:DETR",
    "deformable_detr": "ood_jax.models.deformable_detr:DeformableDetr",
    "dino": "ood_jax.models.dino:DINO",
}


def build_model(config: ml_collections.ConfigDict) -> nn.Module:
    if config.name not in MODELS:
        raise ValueError(
            f"config.model.name: unknown model {config.name!r}; known: {sorted(MODELS)}"
        )
    module_name, _, class_name = MODELS[config.name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**config.get("args", {}))


def postprocess_for(module: nn.Module) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
    """The detector's own outputs -> {"scores", "labels", "boxes"}: every detector module
    (detr.py, deformable_detr.py, dino.py) defines `postprocess` next to its model class."""
    defining = sys.modules[type(module).__module__]
    if not hasattr(defining, "postprocess"):
        raise ValueError(f"{defining.__name__} defines no postprocess for {type(module).__name__}")
    return defining.postprocess
