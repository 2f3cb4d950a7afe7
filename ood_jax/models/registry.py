"""Detector families by name, so configs stay data: `config.model = {"name", "args", "dtype"}`.

A family is a module of `ood_jax.models` (`FAMILIES`), imported when first asked for, exporting
one surface: `Model` (the Flax class, built as `Model(**config.model.args)`), `postprocess`,
`make_loss` and `load_backbone` (docs/guide/detector-models.md). `config.model.dtype` is every
family's compute dtype. Importing a family does not import the training stack: `make_loss`
imports the losses (optax).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import linen as nn

FAMILIES = {
    "detr": "ood_jax.models.detr",
    "deformable_detr": "ood_jax.models.deformable_detr",
    "dino": "ood_jax.models.dino",
}

# config.model.dtype -> the compute dtype `build_model` gives the detector (bfloat16: mixed
# precision, parameters and optimizer state float32, losses and matching float32).
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# A training loss, pure: (variables, batch, rng, mutable) -> (loss, (metrics, model_state)),
# with `variables` holding the parameters being differentiated and `mutable` the collections
# the forward pass may update (e.g. "batch_stats").
LossFn = Callable[..., tuple[jax.Array, tuple[dict[str, jax.Array], Any]]]


def family(name: str) -> ModuleType:
    """The family module `config.model.name` names."""
    if name not in FAMILIES:
        raise ValueError(f"config.model.name: unknown model {name!r}; known: {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def family_of(model: nn.Module) -> ModuleType:
    """The family module of a detector built from it (each `Model` names its family)."""
    name = getattr(type(model), "family", None)
    if name is None:
        raise ValueError(
            f"{type(model).__name__} is not a detector of any family {sorted(FAMILIES)}"
        )
    return family(name)


def compute_dtype(config: ml_collections.ConfigDict) -> Any:
    """The compute dtype `config` (config.model) names; ValueError naming the field if none."""
    name = config.get("dtype", "float32")
    if not isinstance(name, str) or name not in COMPUTE_DTYPES:
        raise ValueError(
            f"config.model.dtype: {name!r} is not a compute dtype; use one of "
            + ", ".join(map(repr, COMPUTE_DTYPES))
        )
    return COMPUTE_DTYPES[name]


def build_model(config: ml_collections.ConfigDict) -> nn.Module:
    """`config` is config.model: the family `config.name` names, its `Model` built from
    `config.args`, computing in `config.dtype`."""
    args = config.get("args", {})
    if "dtype" in args:  # one switch: a second one here could silently disagree with it
        raise ValueError("config.model.args.dtype: set the compute dtype as config.model.dtype")
    return family(config.name).Model(**args, dtype=compute_dtype(config))
