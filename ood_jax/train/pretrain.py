"""Backbone pretraining by multi-label classification on the training domains.

Detectors start from an ImageNet backbone. Where no such weights exist (the synthetic data has
its own classes and no network access is assumed), the backbone is first trained to say which
object classes an image contains, on the same training split the detector will use, so no
held-out domain is seen. The result is written as the backbone's variables and loaded by
`train.load_pretrained_backbone`.
"""

from __future__ import annotations

import functools
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import serialization

from ood_jax.data import pipeline
from ood_jax.models import detr
from ood_jax.train import sharding


class BackboneClassifier(nn.Module):
    backbone: nn.Module
    num_classes: int

    @nn.compact
    def __call__(self, images: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        features = self.backbone(images, train)
        features = features["features"] if "features" in features else features["stage4"]
        weights = detr.resize_mask(mask, features.shape[1:3])[..., None].astype(features.dtype)
        pooled = (features * weights).sum((1, 2)) / jnp.maximum(weights.sum((1, 2)), 1.0)
        return nn.Dense(self.num_classes, name="head")(pooled)


def pretrain_backbone(
    config: ml_collections.ConfigDict, builder, split: str, out_path: pathlib.Path
) -> pathlib.Path:
    """Trains config.model's backbone for `config.pretrain.steps` and writes its variables."""
    args = config.model.args
    backbone = detr.build_backbone(
        args.backbone,
        args.get("backbone_norm", "batch"),
        args.get("dilation", False),
        name="backbone",
    )
    model = BackboneClassifier(backbone, args.num_classes)
    mesh = sharding.make_mesh(config.mesh)
    data_sharding = sharding.batch_sharding(mesh)

    input_config = ml_collections.ConfigDict(config.input.to_dict())
    input_config.seed = config.seed + 1
    input_config.batch_size = config.pretrain.batch_size
    batches = pipeline.train_iterator(builder, split, input_config)

    size = config.input.image_size
    variables = model.init(
        jax.random.key(config.seed), jnp.zeros((1, size, size, 3)), jnp.ones((1, size, size)), False
    )
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    steps = config.pretrain.steps
    warmup = max(1, min(50, steps // 5))
    optimizer = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, config.pretrain.lr, warmup, max(steps, warmup + 1)),
        weight_decay=1e-4,
    )
    opt_state = optimizer.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, model_state, opt_state, batch):
        present = jax.nn.one_hot(batch["labels"], args.num_classes) * batch["box_mask"][..., None]
        targets = present.max(1)

        def loss_fn(params):
            logits, new_state = model.apply(
                {"params": params, **model_state},
                batch["image"],
                batch["image_mask"],
                True,
                mutable=list(model_state),
            )
            return optax.sigmoid_binary_cross_entropy(logits, targets).mean(), new_state

        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state, loss

    started = time.perf_counter()
    for i in range(1, config.pretrain.steps + 1):
        batch = next(batches)
        batch = pipeline.to_global_array(
            {k: batch[k] for k in ("image", "image_mask", "labels", "box_mask")}, data_sharding
        )
        params, model_state, opt_state, loss = step(params, model_state, opt_state, batch)
        if i % config.log_every == 0 or i == config.pretrain.steps:
            rate = i / (time.perf_counter() - started)
            print(
                f"backbone pretraining {i}/{config.pretrain.steps}  loss {float(loss):.4f}  "
                f"{rate:.2f} steps/s",
                flush=True,
            )

    backbone_variables = {"params": params["backbone"]}
    if "batch_stats" in model_state:
        backbone_variables["batch_stats"] = model_state["batch_stats"]["backbone"]
    out_path = pathlib.Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_bytes(serialization.msgpack_serialize(jax.device_get(backbone_variables)))
    tmp.replace(out_path)
    return out_path
