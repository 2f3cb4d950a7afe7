"""Backbone pretraining by dense multi-label classification on the training domains.

Detectors start from an ImageNet backbone. Where no such weights exist (the synthetic data has
its own classes and no network access is assumed), the backbone is first trained, on the same
training split the detector will use (so no held-out domain is seen), to say for every cell of
its output feature map which object classes are there: a cell is positive for a class when its
centre lies inside a box of that class or a box of that class is centred in it. Saying *where*
as well as *what* gives a frozen backbone features a detector head can localise from; a pooled
image-level label alone would not. The result is written as the backbone's variables and loaded
by `train.load_pretrained_backbone`.
"""

from __future__ import annotations

import functools
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import serialization

from ood_jax import boxes as box_lib
from ood_jax import files, multihost
from ood_jax.data import pipeline
from ood_jax.models import backbones
from ood_jax import sharding
from ood_jax.train.compiled import CompiledOnFirstCall


class DenseClassifier(nn.Module):
    """Backbone -> per-cell class logits [B, h, w, C] (a 1x1 convolution on its last features)."""

    backbone: nn.Module
    num_classes: int

    @nn.compact
    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        features = self.backbone(images, train)
        features = backbones.last_map(features)
        return nn.Conv(self.num_classes, (1, 1), name="head")(features).astype(jnp.float32)


def dense_targets(
    boxes: jax.Array,
    labels: jax.Array,
    box_mask: jax.Array,
    grid: tuple[int, int],
    num_classes: int,
) -> jax.Array:
    """[B, h, w, C] presence of each class at each cell of an h x w grid over the canvas.

    `boxes` are normalized cxcywh relative to the canvas. A cell is positive for a box's class
    when the cell's centre is inside the box or the box's centre is inside the cell, so boxes
    smaller than a cell still mark one.
    """
    height, width = grid
    cy = (jnp.arange(height) + 0.5) / height
    cx = (jnp.arange(width) + 0.5) / width
    x0, y0, x1, y1 = jnp.moveaxis(box_lib.cxcywh_to_xyxy(boxes), -1, 0)  # each [B, M]
    inside_y = (cy[None, :, None] >= y0[:, None]) & (cy[None, :, None] <= y1[:, None])
    inside_x = (cx[None, :, None] >= x0[:, None]) & (cx[None, :, None] <= x1[:, None])
    covers = inside_y[:, :, None] & inside_x[:, None, :]  # [B, h, w, M]
    row = jnp.floor(boxes[..., 1] * height).astype(jnp.int32)
    col = jnp.floor(boxes[..., 0] * width).astype(jnp.int32)
    centred = (jnp.arange(height)[None, :, None, None] == row[:, None, None, :]) & (
        jnp.arange(width)[None, None, :, None] == col[:, None, None, :]
    )
    present = (covers | centred) & box_mask[:, None, None, :]
    one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)  # [B, M, C]
    return jnp.einsum("bhwm,bmc->bhwc", present.astype(jnp.float32), one_hot).clip(0.0, 1.0)


def pretrain_backbone(
    config: ml_collections.ConfigDict, builder, split: str, out_path: pathlib.Path
) -> pathlib.Path:
    """Trains config.model's backbone for `config.pretrain.steps` and writes its variables."""
    args = config.model.args
    # Pretraining may leave out the detector's DC5 dilation, as ImageNet weights are made: the
    # same weights then run dilated in the detector, and pretraining costs less.
    backbone = backbones.build_backbone(
        args.backbone,
        args.get("backbone_norm", "batch"),
        config.pretrain.get("dilation", args.get("dilation", False)),
        name="backbone",
        last_stage=args.get("backbone_last_stage"),
    )
    model = DenseClassifier(backbone, args.num_classes)
    mesh = sharding.make_mesh(config.mesh)
    data_sharding = sharding.batch_sharding(mesh)

    input_config = ml_collections.ConfigDict(config.input.to_dict())
    input_config.seed = config.seed + 1
    input_config.batch_size = config.pretrain.batch_size
    fields = ("image", "image_mask", "image_size", "boxes", "labels", "box_mask")
    rows = sharding.process_rows(data_sharding, input_config.batch_size)
    host_batches = pipeline.train_iterator(builder, split, input_config, rows=rows)
    batches = sharding.start_global(
        ({k: batch[k] for k in fields} for batch in host_batches), data_sharding
    )

    size = config.input.image_size
    # Born replicated over the mesh (every process's devices), as the train step wants them.
    replicated = sharding.replicated(mesh)
    init = functools.partial(model.init, images=jnp.zeros((1, size, size, 3)), train=False)
    variables = jax.jit(init, out_shardings=replicated)(jax.random.key(config.seed))
    params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
    steps = config.pretrain.steps
    warmup = max(1, min(50, steps // 5))
    optimizer = optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, config.pretrain.lr, warmup, max(steps, warmup + 1)),
        weight_decay=1e-4,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=replicated)(params)

    def pretrain_step(params, model_state, opt_state, batch):
        def loss_fn(params):
            logits, new_state = model.apply(
                {"params": params, **model_state}, batch["image"], True, mutable=list(model_state)
            )
            grid = logits.shape[1:3]
            canvas = batch["image"].shape[1:3]
            boxes = pipeline.boxes_on_canvas(batch["boxes"], batch["image_size"], canvas)
            targets = dense_targets(
                boxes, batch["labels"], batch["box_mask"], grid, args.num_classes
            )
            # Cells over padding carry no label; they are left out of the mean.
            valid = backbones.resize_mask(batch["image_mask"], grid)[..., None].astype(jnp.float32)
            losses = optax.sigmoid_binary_cross_entropy(logits, targets) * valid
            return losses.sum() / jnp.maximum(valid.sum() * args.num_classes, 1.0), new_state

        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state, loss

    step = CompiledOnFirstCall(jax.jit(pretrain_step, donate_argnums=(0, 1, 2)), "pretraining step")
    started = time.perf_counter()
    for i in range(1, config.pretrain.steps + 1):
        batch, _ = next(batches)
        params, model_state, opt_state, loss = step(params, model_state, opt_state, batch)
        if multihost.is_primary() and (i % config.log_every == 0 or i == config.pretrain.steps):
            # The loss first: it waits for the step, which dispatch lets run behind the loop.
            loss = float(loss)
            rate = i / (time.perf_counter() - started - step.compile_seconds)
            print(
                f"backbone pretraining {i}/{config.pretrain.steps}  loss {loss:.4f}  "
                f"{rate:.2f} steps/s",
                flush=True,
            )

    backbone_variables = {"params": params["backbone"]}
    if "batch_stats" in model_state:
        backbone_variables["batch_stats"] = model_state["batch_stats"]["backbone"]
    # Replicated: each process holds the whole of it; one writes, the others wait for the file.
    host_variables = jax.tree.map(np.asarray, backbone_variables)
    if jax.process_index() == 0:
        files.write_atomic(out_path, serialization.msgpack_serialize(host_variables))
    multihost.barrier(f"pretrained backbone written to {out_path}")
    return out_path
