"""DETR's softmax set-prediction loss with in-graph Hungarian matching (Carion et al., 2020).

Every decoder output is matched on its own to the padded targets (`match_batch`: optax's
Hungarian algorithm, fixed shapes, no host callbacks, each device on its own images) and
supervised with softmax cross-entropy plus L1 and GIoU on the matched pairs, in float32 whatever
the model computes in (`float32_outputs`).
`make_loss_fn` and `config_weights` are what every family's `make_loss` shares; the focal set
loss (`ood_jax.models.focal_set_loss`) reuses `match_batch`.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import linen as nn

from ood_jax import boxes as box_lib
from ood_jax import sharding
from ood_jax.models.registry import LossFn


@dataclasses.dataclass(frozen=True)
class SetLossConfig:
    """Loss weights (`*_weight`) and matching-cost weights (`cost_*`); DETR's defaults."""

    class_weight: float = 1.0
    bbox_weight: float = 5.0
    giou_weight: float = 2.0
    eos_coef: float = 0.1
    cost_class: float = 1.0
    cost_bbox: float = 5.0
    cost_giou: float = 2.0


def matching_cost(
    logits: jax.Array,
    pred_boxes: jax.Array,
    labels: jax.Array,
    target_boxes: jax.Array,
    config: SetLossConfig = SetLossConfig(),
) -> jax.Array:
    """DETR's matching cost for one image: [Q, C+1], [Q, 4], [M], [M, 4] -> [Q, M]."""
    prob = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    pred_boxes = pred_boxes.astype(jnp.float32)
    cost_class = -jnp.take(prob, labels, axis=-1)
    cost_bbox = jnp.abs(pred_boxes[:, None, :] - target_boxes[None, :, :]).sum(-1)
    cost_giou = -box_lib.pairwise_giou(
        box_lib.cxcywh_to_xyxy(pred_boxes), box_lib.cxcywh_to_xyxy(target_boxes)
    )
    return (
        config.cost_class * cost_class + config.cost_bbox * cost_bbox + config.cost_giou * cost_giou
    )


def hungarian_match(cost: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Optimal one-to-one matching of real targets to queries for one image.

    Args:
      cost: [Q, M] cost of giving target slot j to query i.
      mask: [M] bool, True for real targets.

    Returns:
      query_index: [M] int32, the query matched to each target slot (meaningless where not matched).
      matched: [M] bool, True for the real targets that got a query (all of them unless R > Q).
    """
    num_queries, num_slots = cost.shape
    # Padded target columns, and non-finite costs (a diverged prediction), cost `fill`, above
    # every real cost of the image: a column of equal costs adds the same to every complete
    # assignment, so it cannot change which queries the real targets get, and a non-finite pair
    # is used only when nothing else is left (as transformers' matcher does). With M > Q, dummy
    # rows of cost 0 are appended; a real query on a padded column while a dummy row holds a real
    # column could swap with it and lower the total by fill - cost > 0, so real targets get real
    # queries first: min(Q, R) of them, optimally, as scipy's linear_sum_assignment on the real
    # [Q, R] costs.
    real = mask[None, :] & jnp.isfinite(cost)
    fill = jnp.max(jnp.where(real, cost, -jnp.inf), initial=0.0) + 1.0
    cost = jnp.where(real, cost, fill)
    cost = jnp.pad(cost, ((0, max(num_slots - num_queries, 0)), (0, 0)))
    # With at least as many rows as columns every column is assigned; rows come back in column
    # order only for square problems, so scatter them into place.
    rows, cols = optax.assignment.hungarian_algorithm(cost)
    query_index = jnp.zeros(num_slots, jnp.int32).at[cols].set(rows.astype(jnp.int32))
    return query_index, mask & (query_index < num_queries)


def match_batch(cost: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`hungarian_match` of each image: [B, Q, M], [B, M] -> [B, M], [B, M]. Each device
    matches its own images (`sharding.per_batch_shard`). No gradient flows: the assignment is
    piecewise constant in the cost, and reverse mode cannot go through its while loops."""
    batched = sharding.per_batch_shard(jax.vmap(hungarian_match))
    return batched(jax.lax.stop_gradient(cost), mask)


def _level_losses(
    logits: jax.Array,
    pred_boxes: jax.Array,
    targets: Mapping[str, jax.Array],
    num_boxes: jax.Array,
    config: SetLossConfig,
) -> dict[str, jax.Array]:
    """Unweighted loss terms of one decoder output."""
    labels, target_boxes, mask = targets["labels"], targets["boxes"], targets["mask"]
    target_boxes = target_boxes.astype(jnp.float32)
    cost = jax.vmap(functools.partial(matching_cost, config=config))(
        logits, pred_boxes, labels, target_boxes
    )
    query_index, matched = match_batch(cost, mask)

    num_queries, no_object = logits.shape[1], logits.shape[2] - 1
    # Unmatched slots point past the last query, and mode="drop" discards them.
    scatter_to = jnp.where(matched, query_index, num_queries)
    target_classes = jax.vmap(
        lambda to, lab: jnp.full((num_queries,), no_object, jnp.int32).at[to].set(lab, mode="drop")
    )(scatter_to, labels.astype(jnp.int32))
    log_prob = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_prob, target_classes[..., None], axis=-1)[..., 0]
    # A weighted mean over every query of the batch, as torch's cross_entropy(weight=...).
    class_w = jnp.where(target_classes == no_object, config.eos_coef, 1.0)
    loss_ce = jnp.sum(class_w * nll) / jnp.sum(class_w)

    src = jnp.take_along_axis(
        pred_boxes.astype(jnp.float32),
        jnp.minimum(query_index, num_queries - 1)[..., None],
        axis=1,
    )
    l1 = jnp.abs(src - target_boxes).sum(-1)
    giou = box_lib.elementwise_giou(
        box_lib.cxcywh_to_xyxy(src), box_lib.cxcywh_to_xyxy(target_boxes)
    )
    return {
        "loss_ce": loss_ce,
        "loss_bbox": jnp.sum(jnp.where(matched, l1, 0.0)) / num_boxes,
        "loss_giou": jnp.sum(jnp.where(matched, 1.0 - giou, 0.0)) / num_boxes,
    }


def _fold_query_groups(outputs, targets, num_groups: int):
    """[B, G*Q, ...] outputs to [B*G, Q, ...], each group paired with its own copy of the targets."""

    def fold(x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[0] * num_groups, x.shape[1] // num_groups, *x.shape[2:])

    def fold_level(level):
        return {"logits": fold(level["logits"]), "boxes": fold(level["boxes"])}

    folded = {**fold_level(outputs), "aux": [fold_level(a) for a in outputs.get("aux", ())]}
    return folded, {k: jnp.repeat(v, num_groups, axis=0) for k, v in targets.items()}


def set_loss(
    outputs: Mapping[str, jax.Array | Sequence[Mapping[str, jax.Array]]],
    targets: Mapping[str, jax.Array],
    config: SetLossConfig = SetLossConfig(),
    num_boxes: jax.Array | None = None,
    num_query_groups: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DETR's total loss over the final and auxiliary decoder outputs.

    Args:
      outputs: "logits" [B, Q, C+1] (last class = no object), "boxes" [B, Q, 4] normalized
        cxcywh, and optionally "aux": a list of {"logits", "boxes"} of the same shapes from
        earlier decoder layers.
      targets: "boxes" [B, M, 4] normalized cxcywh, "labels" [B, M] int in [0, C), "mask" [B, M]
        bool, True for real targets.
      config: loss and matching weights (hashable: bind it with functools.partial or pass it as
        a static argument when jitting).
      num_boxes: the box-loss normalizer; defaults to the number of real targets in `targets`,
        which under jit with sharded inputs is already the global count, as DETR normalizes
        across devices; inside shard_map/pmap, where arrays are per device, pass the global
        count. Clamped to at least 1.
      num_query_groups: Group DETR training (see `models.detr.DETR`): the Q queries are this
        many groups, each matched to the targets on its own; the loss is their mean, so its
        scale does not depend on the number of groups.

    Returns:
      (total, metrics): total = sum over outputs of class_weight * loss_ce + bbox_weight *
      loss_bbox + giou_weight * loss_giou; metrics holds each unweighted term, named as
      transformers' DETR does ("loss_ce", ..., and "loss_ce_0", ... for the i-th aux output).
    """
    if num_boxes is None:
        num_boxes = jnp.sum(targets["mask"])
    num_boxes = jnp.maximum(jnp.asarray(num_boxes, jnp.float32), 1.0)
    if num_query_groups > 1:
        outputs, targets = _fold_query_groups(outputs, targets, num_query_groups)
        num_boxes = num_boxes * num_query_groups

    # All decoder layers share one shape, so they are stacked and vmapped: the matcher's loops are
    # traced and compiled once instead of once per layer.
    levels = [outputs, *outputs.get("aux", ())]
    level_losses = functools.partial(
        _level_losses, targets=targets, num_boxes=num_boxes, config=config
    )
    terms = jax.vmap(level_losses)(
        jnp.stack([out["logits"] for out in levels]), jnp.stack([out["boxes"] for out in levels])
    )
    total = jnp.sum(
        config.class_weight * terms["loss_ce"]
        + config.bbox_weight * terms["loss_bbox"]
        + config.giou_weight * terms["loss_giou"]
    )
    metrics = {k: v[0] for k, v in terms.items()}
    for i in range(len(levels) - 1):
        metrics.update({f"{k}_{i}": v[i + 1] for k, v in terms.items()})
    return total, metrics


def batch_targets(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The targets of a training batch, as the set losses read them."""
    return {"boxes": batch["boxes"], "labels": batch["labels"], "mask": batch["box_mask"]}


def float32_outputs(outputs: Any) -> Any:
    """A model's outputs as the matchers and losses read them: every floating-point array in
    float32, so that matching costs and losses are float32 with a bfloat16 forward pass too
    (the families' heads already return float32; this holds for any family)."""

    def cast(x: jax.Array) -> jax.Array:
        return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, outputs)


def config_weights(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """`config.loss` (weights, matching costs; none: the loss's defaults) as keyword arguments
    of a loss config dataclass."""
    return config.get("loss", ml_collections.ConfigDict()).to_dict()


def make_loss_fn(
    model: nn.Module,
    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]],
    model_inputs: Callable[[jax.Array, dict[str, jax.Array]], dict[str, Any]] | None = None,
) -> LossFn:
    """`model`'s forward pass in training mode, then `loss(outputs, targets, **inputs)` on its
    float32 outputs and the batch's targets.

    `model_inputs(rng, targets)`, when given, makes keyword inputs that the model and the loss
    both take (DINO's denoising queries), from a key split off `rng`; dropout gets the other one.
    """

    def loss_fn(variables, batch, rng, mutable: Sequence[str]):
        targets = batch_targets(batch)
        inputs = {}
        if model_inputs is not None:
            inputs_rng, rng = jax.random.split(rng)
            inputs = model_inputs(inputs_rng, targets)
        # Trainable BatchNorm updates its statistics; frozen BatchNorm never writes them.
        outputs, model_state = model.apply(
            variables,
            batch["image"],
            batch["image_mask"],
            train=True,
            rngs={"dropout": rng},
            mutable=list(mutable),
            **inputs,
        )
        total, metrics = loss(float32_outputs(outputs), targets, **inputs)
        return total, (metrics, model_state)

    return loss_fn
