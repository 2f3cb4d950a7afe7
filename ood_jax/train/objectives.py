"""The training loss of each detector family, around its forward pass.

DETR is matched with softmax classes and a no-object logit (`detr_loss`); Deformable DETR and
DINO with sigmoid focal costs (`dino_loss`). DINO also needs the ground truth *before* its
forward pass: contrastive denoising queries are noised copies of the targets that the decoder
must reconstruct or reject. `train.py` only
calls `make_loss(config, model)` and stays the same for every family.

A loss function here is pure: (variables, batch, rng, mutable) -> (loss, (metrics, model_state)),
with `variables` holding the parameters being differentiated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
from flax import linen as nn

from ood_jax.models import deformable_detr, denoising, dino
from ood_jax.train import detr_loss, dino_loss

LossFn = Callable[..., tuple[jax.Array, tuple[dict[str, jax.Array], Any]]]


def _targets(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {"boxes": batch["boxes"], "labels": batch["labels"], "mask": batch["box_mask"]}


def _detr_loss(model: nn.Module, loss_config: detr_loss.DetrLossConfig) -> LossFn:
    def loss(variables, batch, rng, mutable: Sequence[str]):
        # Trainable BatchNorm updates its statistics; frozen BatchNorm never writes them.
        outputs, model_state = model.apply(
            variables,
            batch["image"],
            batch["image_mask"],
            train=True,
            rngs={"dropout": rng},
            mutable=list(mutable),
        )
        total, metrics = detr_loss.detr_loss(
            outputs,
            _targets(batch),
            loss_config,
            num_query_groups=getattr(model, "num_query_groups", 1),
        )
        return total, (metrics, model_state)

    return loss


def _focal_loss(
    model: nn.Module,
    loss_config: dino_loss.DinoLossConfig,
    denoise: ml_collections.ConfigDict | None,
) -> LossFn:
    def loss(variables, batch, rng, mutable: Sequence[str]):
        denoise_rng, dropout_rng = jax.random.split(rng)
        targets = _targets(batch)
        queries, extra = None, {}
        if denoise is not None:
            queries = denoising.make_cdn_queries(
                denoise_rng,
                targets["labels"],
                targets["boxes"],
                targets["mask"],
                num_classes=model.num_classes,
                num_queries=model.num_queries,
                num_dn_queries=denoise.num_queries,
                label_noise_ratio=denoise.label_noise_ratio,
                box_noise_scale=denoise.box_noise_scale,
            )
            extra = {"denoise": queries}
        outputs, model_state = model.apply(
            variables,
            batch["image"],
            batch["image_mask"],
            train=True,
            rngs={"dropout": dropout_rng},
            mutable=list(mutable),
            **extra,
        )
        total, metrics = dino_loss.dino_loss(outputs, targets, loss_config, denoise=queries)
        return total, (metrics, model_state)

    return loss


def make_loss(config: ml_collections.ConfigDict, model: nn.Module) -> LossFn:
    """The loss of `model` with `config.loss` weights (and `config.denoising` for DINO)."""
    weights = config.get("loss", ml_collections.ConfigDict()).to_dict()
    if isinstance(model, dino.DINO):
        if "denoising" not in config:
            raise ValueError(
                "config.denoising: DINO needs num_queries, label_noise_ratio and box_noise_scale"
            )
        return _focal_loss(model, dino_loss.DinoLossConfig(**weights), config.denoising)
    if isinstance(model, deformable_detr.DeformableDetr):
        return _focal_loss(model, dino_loss.DinoLossConfig(**weights), None)
    return _detr_loss(model, detr_loss.DetrLossConfig(**weights))
