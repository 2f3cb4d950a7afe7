"""Detectors by name, so configs stay data: `config.model = {"name": ..., "args": {...}}`."""

from __future__ import annotations

import importlib

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
