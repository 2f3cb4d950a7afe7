"""The focal set loss of Deformable DETR and DINO, with DINO's contrastive denoising terms.

The final decoder output, every earlier one ("aux") and the two-stage encoder proposals ("enc")
are each Hungarian-matched on Deformable DETR's focal cost and supervised with a sigmoid focal
loss plus L1 and GIoU; denoising outputs are supervised without matching. `make_loss_fn` is
`set_loss.make_loss_fn` with this loss and, for DINO, its denoising queries.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import linen as nn

from ood_jax import boxes as box_lib
from ood_jax.models import denoising, set_loss
from ood_jax.models.registry import LossFn

# Where a query has no box to regress, L1/GIoU are computed against this well-formed box and
# masked out, so no degenerate geometry reaches the gradient.
_DUMMY_BOX = (0.5, 0.5, 0.5, 0.5)
_TERMS = ("loss_ce", "loss_bbox", "loss_giou")


@dataclasses.dataclass(frozen=True)
class FocalSetLossConfig:
    """Focal-loss shape, matching-cost weights (`cost_*`) and loss weights; DINO's defaults."""

    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    cost_class: float = 2.0
    cost_bbox: float = 5.0
    cost_giou: float = 2.0
    class_weight: float = 1.0
    bbox_weight: float = 5.0
    giou_weight: float = 2.0
    encoder_weight: float = 1.0
    encoder_class_agnostic: bool = False


def focal_matching_cost(
    logits: jax.Array,
    pred_boxes: jax.Array,
    labels: jax.Array,
    target_boxes: jax.Array,
    config: FocalSetLossConfig = FocalSetLossConfig(),
) -> jax.Array:
    """Deformable DETR's matching cost for one image: [Q, C], [Q, 4], [M], [M, 4] -> [Q, M]."""
    prob = jax.nn.sigmoid(logits.astype(jnp.float32))
    alpha, gamma = config.focal_alpha, config.focal_gamma
    neg_cost = (1 - alpha) * prob**gamma * -jnp.log(1 - prob + 1e-8)
    pos_cost = alpha * (1 - prob) ** gamma * -jnp.log(prob + 1e-8)
    cost_class = jnp.take(pos_cost - neg_cost, labels, axis=-1)
    pred_boxes = pred_boxes.astype(jnp.float32)
    target_boxes = target_boxes.astype(jnp.float32)
    cost_bbox = jnp.abs(pred_boxes[:, None, :] - target_boxes[None, :, :]).sum(-1)
    cost_giou = -box_lib.pairwise_giou(
        box_lib.cxcywh_to_xyxy(pred_boxes), box_lib.cxcywh_to_xyxy(target_boxes)
    )
    return (
        config.cost_class * cost_class + config.cost_bbox * cost_bbox + config.cost_giou * cost_giou
    )


def _query_losses(
    logits: jax.Array,
    pred_boxes: jax.Array,
    query_labels: jax.Array,
    query_boxes: jax.Array,
    has_box: jax.Array,
    class_mask: jax.Array,
    normalizer: jax.Array,
    config: FocalSetLossConfig,
) -> dict[str, jax.Array]:
    """Unweighted terms of one head given every query's target.

    Args:
      logits: [B, Q, C]; pred_boxes: [B, Q, 4] cxcywh.
      query_labels: [B, Q] class each query should predict, C for none.
      query_boxes: [B, Q, 4] box each query should predict where `has_box`.
      has_box: [B, Q] bool, queries with a box target.
      class_mask: [B, Q] bool, queries that take part in the classification loss.
      normalizer: scalar divisor of every term.
    """
    num_classes = logits.shape[-1]
    # one_hot maps the "none" class C to all zeros.
    onehot = jax.nn.one_hot(query_labels, num_classes, dtype=jnp.float32)
    alpha = config.focal_alpha if config.focal_alpha >= 0 else None
    focal = optax.losses.sigmoid_focal_loss(
        logits.astype(jnp.float32), onehot, alpha=alpha, gamma=config.focal_gamma
    )
    query_boxes = jnp.where(
        has_box[..., None], query_boxes.astype(jnp.float32), jnp.array(_DUMMY_BOX)
    )
    pred_boxes = pred_boxes.astype(jnp.float32)
    l1 = jnp.abs(pred_boxes - query_boxes).sum(-1)
    giou = box_lib.elementwise_giou(
        box_lib.cxcywh_to_xyxy(pred_boxes), box_lib.cxcywh_to_xyxy(query_boxes)
    )
    return {
        "loss_ce": jnp.sum(jnp.where(class_mask[..., None], focal, 0.0)) / normalizer,
        "loss_bbox": jnp.sum(jnp.where(has_box, l1, 0.0)) / normalizer,
        "loss_giou": jnp.sum(jnp.where(has_box, 1.0 - giou, 0.0)) / normalizer,
    }


def _matched_losses(
    logits: jax.Array,
    pred_boxes: jax.Array,
    labels: jax.Array,
    target_boxes: jax.Array,
    mask: jax.Array,
    num_boxes: jax.Array,
    config: FocalSetLossConfig,
) -> dict[str, jax.Array]:
    """Hungarian-matched terms of one head: [B, Q, C], [B, Q, 4], [B, M], [B, M, 4], [B, M]."""
    num_queries, num_classes = logits.shape[1:]
    cost = jax.vmap(functools.partial(focal_matching_cost, config=config))(
        logits, pred_boxes, labels, target_boxes
    )
    query_index, matched = set_loss.match_batch(cost, mask)

    # Unmatched target slots point past the last query, and mode="drop" discards them.
    scatter_to = jnp.where(matched, query_index, num_queries)

    def per_query(to: jax.Array, values: jax.Array, fill: Any) -> jax.Array:
        init = jnp.full((num_queries, *values.shape[1:]), fill, values.dtype)
        return init.at[to].set(values, mode="drop")

    query_labels = jax.vmap(per_query, (0, 0, None))(scatter_to, labels, num_classes)
    query_boxes = jax.vmap(per_query, (0, 0, None))(scatter_to, target_boxes, 0.0)
    has_box = jax.vmap(per_query, (0, 0, None))(scatter_to, matched, False)
    everything = jnp.ones(has_box.shape, bool)
    return _query_losses(
        logits, pred_boxes, query_labels, query_boxes, has_box, everything, num_boxes, config
    )


def _denoising_losses(
    logits: jax.Array,
    pred_boxes: jax.Array,
    targets: Mapping[str, jax.Array],
    denoise: Mapping[str, jax.Array],
    normalizer: jax.Array,
    config: FocalSetLossConfig,
) -> dict[str, jax.Array]:
    """Terms of one decoder layer's denoising outputs [B, D, C], [B, D, 4]; no matching."""
    # Slots copying a padded target are left out. DINO pads its denoising queries to the batch's
    # largest target count and lets that padding into the focal loss as negatives; with static
    # shapes the padding is a property of the input pipeline, so it must not change the loss.
    target_index = denoise["target_index"]
    valid = denoise["valid"] & jnp.take_along_axis(targets["mask"], target_index, axis=1)
    reconstruct = valid & denoise["positive"]
    labels = jnp.take_along_axis(targets["labels"], target_index, axis=1)
    query_labels = jnp.where(reconstruct, labels, logits.shape[-1])
    query_boxes = jnp.take_along_axis(targets["boxes"], target_index[..., None], axis=1)
    return _query_losses(
        logits, pred_boxes, query_labels, query_boxes, reconstruct, valid, normalizer, config
    )


def _per_head(
    fn: Callable[..., dict[str, jax.Array]], heads: Sequence[tuple[jax.Array, ...]]
) -> list[dict[str, jax.Array]]:
    """`fn` applied to each head's arrays; heads of equal shapes are stacked and vmapped, so the
    matcher's loops are traced and compiled once per shape, not once per layer."""
    groups: dict[tuple, list[int]] = {}
    for i, arrays in enumerate(heads):
        groups.setdefault(tuple(a.shape for a in arrays), []).append(i)
    results: list[dict[str, jax.Array]] = [{} for _ in heads]
    for members in groups.values():
        stacked = [jnp.stack(parts) for parts in zip(*(heads[i] for i in members))]
        terms = jax.vmap(fn)(*stacked)
        for j, i in enumerate(members):
            results[i] = {k: v[j] for k, v in terms.items()}
    return results


def _check_shape(name: str, array: Any, expected: tuple[int | None, ...]) -> None:
    """Raises unless `array` has the `expected` shape (None matches any size)."""
    shape = tuple(array.shape)
    if len(shape) != len(expected) or any(e not in (None, s) for s, e in zip(shape, expected)):
        wanted = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"focal_set_loss: {name} has shape {shape}, expected {wanted}")


def _check_label_range(labels: Any, mask: Any, num_classes: int) -> None:
    """Real targets' labels must index a logit; checked only when the values are concrete."""
    if any(isinstance(x, jax.core.Tracer) for x in (labels, mask)):
        return
    labels, mask = np.asarray(labels), np.asarray(mask, bool)
    bad = mask & ((labels < 0) | (labels >= num_classes))
    if bad.any():
        raise ValueError(
            f"focal_set_loss: targets['labels'] of real targets must lie in [0, {num_classes}), "
            f"got {labels[bad][:5].tolist()}"
        )


def _check_inputs(
    outputs: Mapping[str, Any],
    targets: Mapping[str, Any],
    denoise: Mapping[str, Any] | None,
) -> None:
    for key in ("boxes", "labels", "mask"):
        if key not in targets:
            raise ValueError(f"focal_set_loss: targets has no {key!r} (keys: {sorted(targets)})")
    _check_shape("targets['labels']", targets["labels"], (None, None))
    batch, slots = targets["labels"].shape
    _check_shape("targets['mask']", targets["mask"], (batch, slots))
    _check_shape("targets['boxes']", targets["boxes"], (batch, slots, 4))

    num_classes = outputs["logits"].shape[-1]
    heads = {
        "outputs": outputs,
        **{f"outputs['aux'][{i}]": a for i, a in enumerate(outputs.get("aux", ()))},
    }
    if "enc" in outputs:
        heads["outputs['enc']"] = outputs["enc"]
    for name, head in heads.items():
        _check_shape(f"{name}['logits']", head["logits"], (batch, None, num_classes))
        _check_shape(f"{name}['boxes']", head["boxes"], (batch, head["logits"].shape[1], 4))
    _check_label_range(targets["labels"], targets["mask"], num_classes)

    if (denoise is None) != ("dn" not in outputs):
        raise ValueError(
            "focal_set_loss: outputs['dn'] and `denoise` come together (the model returns 'dn' exactly "
            f"when given denoising queries); got outputs['dn'] {'dn' in outputs}, "
            f"denoise {denoise is not None}"
        )
    if denoise is None:
        return
    layers, num_dn = len(heads) - ("enc" in outputs), denoise["target_index"].shape[-1]
    _check_shape(
        "outputs['dn']['logits']", outputs["dn"]["logits"], (layers, batch, num_dn, num_classes)
    )
    _check_shape("outputs['dn']['boxes']", outputs["dn"]["boxes"], (layers, batch, num_dn, 4))
    for key in ("positive", "valid", "target_index"):
        _check_shape(f"denoise[{key!r}]", denoise[key], (batch, num_dn))


def _weighted(terms: Mapping[str, jax.Array], config: FocalSetLossConfig) -> jax.Array:
    return (
        config.class_weight * terms["loss_ce"]
        + config.bbox_weight * terms["loss_bbox"]
        + config.giou_weight * terms["loss_giou"]
    )


def focal_set_loss(
    outputs: Mapping[str, Any],
    targets: Mapping[str, jax.Array],
    config: FocalSetLossConfig = FocalSetLossConfig(),
    denoise: Mapping[str, jax.Array] | None = None,
    num_boxes: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The total focal set loss of a Deformable DETR or DINO output (DINO's with denoising).

    Args:
      outputs: the model's outputs: "logits" [B, Q, C] and "boxes" [B, Q, 4] (final decoder
        layer), optionally "aux" (a list of {"logits", "boxes"} from earlier layers), "enc"
        ({"logits" [B, K, C], "boxes" [B, K, 4]}, the two-stage proposals) and "dn"
        ({"logits" [L, B, D, C], "boxes" [L, B, D, 4]}, denoising outputs of every layer, the
        last one final).
      targets: "boxes" [B, M, 4] normalized cxcywh, "labels" [B, M] int in [0, C), "mask"
        [B, M] bool, True for real targets.
      config: weights (hashable: bind it with functools.partial or pass it as a static argument
        when jitting).
      denoise: the `make_cdn_queries` dict the model was run with; required exactly when
        outputs has "dn".
      num_boxes: normalizer; defaults to the number of real targets, which under jit with
        sharded inputs is already the global count; inside shard_map/pmap pass the global
        count. Clamped to at least 1. Denoising terms are divided by num_boxes * G (G groups).

    Returns:
      (total, metrics): total is the weighted sum of every head's terms (encoder terms times
      `encoder_weight`); metrics holds the unweighted terms "loss_ce", "loss_bbox", "loss_giou"
      with suffix "" (final layer), "_{i}" (i-th earlier layer), "_enc", "_dn" (final layer's
      denoising) and "_dn_{i}" (i-th earlier layer's denoising).
    """
    _check_inputs(outputs, targets, denoise)
    labels = jnp.asarray(targets["labels"], jnp.int32)
    mask = jnp.asarray(targets["mask"], bool)
    # Padding slots may hold any label; give them a valid index so the cost stays finite.
    labels = jnp.where(mask, labels, 0)
    target_boxes = jnp.asarray(targets["boxes"], jnp.float32)
    targets = {"labels": labels, "boxes": target_boxes, "mask": mask}
    if num_boxes is None:
        num_boxes = jnp.sum(mask)
    num_boxes = jnp.maximum(jnp.asarray(num_boxes, jnp.float32), 1.0)

    aux = list(outputs.get("aux", ()))
    names = ["", *(f"_{i}" for i in range(len(aux)))]
    heads = [(o["logits"], o["boxes"], labels) for o in [outputs, *aux]]
    head_weights = [1.0] * len(heads)
    if "enc" in outputs:
        # DINO supervises the proposals with the real labels (its interm loss); the original
        # two-stage Deformable DETR ranks proposals by logit 0 alone and so collapses every
        # class to 0 (`bin_targets`). transformers' Deformable DETR has no encoder loss at all.
        enc_labels = jnp.zeros_like(labels) if config.encoder_class_agnostic else labels
        names.append("_enc")
        heads.append((outputs["enc"]["logits"], outputs["enc"]["boxes"], enc_labels))
        head_weights.append(config.encoder_weight)
    matched = functools.partial(
        _matched_losses, target_boxes=target_boxes, mask=mask, num_boxes=num_boxes, config=config
    )
    per_head = _per_head(matched, heads)

    if denoise is not None:
        num_slots, num_dn = mask.shape[1], denoise["target_index"].shape[-1]
        groups = max(1, num_dn // (2 * num_slots)) if num_slots else 1
        dn_losses = functools.partial(
            _denoising_losses,
            targets=targets,
            denoise=denoise,
            normalizer=num_boxes * groups,
            config=config,
        )
        dn_terms = jax.vmap(dn_losses)(outputs["dn"]["logits"], outputs["dn"]["boxes"])
        num_layers = len(aux) + 1
        for layer in range(num_layers):
            names.append("_dn" if layer == num_layers - 1 else f"_dn_{layer}")
            per_head.append({k: v[layer] for k, v in dn_terms.items()})
            head_weights.append(1.0)

    total = sum(w * _weighted(t, config) for w, t in zip(head_weights, per_head))
    metrics = {f"{k}{name}": t[k] for name, t in zip(names, per_head) for k in _TERMS}
    return total, metrics


def make_loss_fn(
    model: nn.Module,
    config: FocalSetLossConfig,
    denoise: ml_collections.ConfigDict | None = None,
) -> LossFn:
    """`model`'s forward pass in training mode, then `focal_set_loss`.

    With `denoise` (num_queries, label_noise_ratio, box_noise_scale: DINO's `config.denoising`)
    the model also gets contrastive denoising queries made from the batch's targets
    (`denoising.make_cdn_queries`), and the loss supervises their outputs.
    """

    # Passed without `denoise` too: dropout then draws on the same key with and without it.
    def denoising_inputs(rng: jax.Array, targets: dict[str, jax.Array]) -> dict[str, Any]:
        if denoise is None:
            return {}
        queries = denoising.make_cdn_queries(
            rng,
            targets["labels"],
            targets["boxes"],
            targets["mask"],
            num_classes=model.num_classes,
            num_queries=model.num_queries,
            num_dn_queries=denoise.num_queries,
            label_noise_ratio=denoise.label_noise_ratio,
            box_noise_scale=denoise.box_noise_scale,
        )
        return {"denoise": queries}

    loss = functools.partial(focal_set_loss, config=config)
    return set_loss.make_loss_fn(model, loss, denoising_inputs)
