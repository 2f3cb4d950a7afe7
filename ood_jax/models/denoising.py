"""DINO's contrastive denoising (CDN) queries (Zhang et al., 2022; after DN-DETR, Li et al., 2022).

In training the decoder also gets noised copies of the ground truth: per group, a positive copy
of every target (box noised a little: reconstruct box and class) and a negative one (noised more:
predict "no object"), so it learns to reject anchors near, but not on, an object. The layout is
IDEA-Research's `prepare_for_cdn` with static shapes; layout, noise and attention mask:
docs/guide/detector-models.md.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ood_jax import boxes as box_lib

# What DINO's padded denoising slots decode to: sigmoid(0) for every coordinate.
_INVALID_BOX = 0.5


def num_groups(max_targets: int, num_dn_queries: int) -> int:
    """Number of denoising groups G for M = `max_targets` target slots."""
    if max_targets <= 0:
        return 1
    return max(1, num_dn_queries // (2 * max_targets))


def cdn_attention_mask(max_targets: int, groups: int, num_queries: int) -> np.ndarray:
    """[D + Q, D + Q] bool, True where query i may attend to key j.

    Matching queries see only matching queries (they must not peek at the ground truth);
    denoising queries see their own group (valid or not, as in DINO) and every matching query.
    The mask is shared by the batch: a model hiding invalid slots as keys combines it with
    `valid`.
    """
    num_dn = 2 * max_targets * groups
    # Matching queries are group -1; they see only each other.
    group = np.concatenate([np.arange(num_dn) // max(2 * max_targets, 1), np.full(num_queries, -1)])
    key_is_matching = group[None, :] < 0
    same_group = group[:, None] == group[None, :]
    return key_is_matching | same_group


def jitter_corners(
    rng: jax.Array, boxes: jax.Array, positive: jax.Array, box_noise_scale: float
) -> jax.Array:
    """DINO's box noise before clipping: cxcywh [..., 4] -> noised xyxy corners [..., 4].

    Every corner coordinate moves by sign * u * box_noise_scale * (w/2 or h/2), u ~ U[0, 1) where
    `positive` [...] is True and U[1, 2) elsewhere.
    """
    sign_rng, size_rng = jax.random.split(rng)
    half_size = jnp.tile(boxes[..., 2:] / 2, 2)
    sign = jnp.where(jax.random.bernoulli(sign_rng, 0.5, boxes.shape), 1.0, -1.0)
    magnitude = jax.random.uniform(size_rng, boxes.shape) + jnp.where(positive, 0.0, 1.0)[..., None]
    return box_lib.cxcywh_to_xyxy(boxes) + sign * magnitude * half_size * box_noise_scale


def make_cdn_queries(
    rng: jax.Array,
    labels: jax.Array,
    boxes: jax.Array,
    mask: jax.Array,
    *,
    num_classes: int,
    num_queries: int,
    num_dn_queries: int = 100,
    label_noise_ratio: float = 0.5,
    box_noise_scale: float = 1.0,
) -> dict[str, jax.Array]:
    """Contrastive denoising queries for a padded batch of targets.

    Args:
      rng: PRNG key.
      labels: [B, M] int class ids in [0, num_classes) (ignored where `mask` is False).
      boxes: [B, M, 4] normalized cxcywh.
      mask: [B, M] bool, True for real targets.
      num_classes: C; noised labels are drawn from [0, C) and invalid slots get label C.
      num_queries: Q, the number of matching queries (sizes the attention mask).
      num_dn_queries: the denoising budget, positives and negatives together;
        D = 2 * M * max(1, num_dn_queries // (2M)). IDEA-Research's `dn_number` counts pairs:
        its default 100 is 200 here.
      label_noise_ratio: a label is redrawn with probability label_noise_ratio / 2.
      box_noise_scale: corner noise relative to half the box size (`jitter_corners`): positives
        stay within box_noise_scale / 2 of the box size of every edge, negatives between that
        and box_noise_scale (before clipping to [0, 1]).

    Returns:
      "labels" [B, D] int32, "boxes" [B, D, 4] (in [0, 1]), "positive" [B, D] bool, "valid"
      [B, D] bool, "target_index" [B, D] int32 (the target slot each query copies), and
      "attention_mask" [D + Q, D + Q] bool.
    """
    if labels.ndim != 2 or mask.shape != labels.shape or boxes.shape != (*labels.shape, 4):
        raise ValueError(
            "make_cdn_queries: expected labels [B, M], boxes [B, M, 4] and mask [B, M], got "
            f"labels {labels.shape}, boxes {boxes.shape}, mask {mask.shape}"
        )
    if num_classes < 1 or num_queries < 0 or num_dn_queries < 0:
        raise ValueError(
            f"make_cdn_queries: need num_classes >= 1, num_queries >= 0 and num_dn_queries >= 0, "
            f"got {num_classes}, {num_queries}, {num_dn_queries}"
        )
    # The padded M replaces the reference's per-batch maximum target count: shapes stay static.
    max_targets = labels.shape[1]
    groups = num_groups(max_targets, num_dn_queries)
    slot = np.arange(2 * max_targets * groups)
    positive_slot = slot % (2 * max(max_targets, 1)) < max_targets
    target_index = slot % max(max_targets, 1)

    valid = jnp.asarray(mask, bool)[:, target_index]
    positive = jnp.broadcast_to(positive_slot, valid.shape)
    dn_labels = jnp.asarray(labels, jnp.int32)[:, target_index]
    dn_boxes = jnp.asarray(boxes, jnp.float32)[:, target_index]

    flip_rng, class_rng, box_rng = jax.random.split(rng, 3)
    flip = jax.random.uniform(flip_rng, valid.shape) < label_noise_ratio * 0.5
    redrawn = jax.random.randint(class_rng, valid.shape, 0, num_classes, jnp.int32)
    dn_labels = jnp.where(flip, redrawn, dn_labels)
    if box_noise_scale > 0:
        corners = jnp.clip(jitter_corners(box_rng, dn_boxes, positive, box_noise_scale), 0.0, 1.0)
        # Corners that crossed give a negative size, which DINO's inverse_sigmoid clamps to 0.
        dn_boxes = jnp.clip(box_lib.xyxy_to_cxcywh(corners), 0.0, 1.0)

    return {
        "labels": jnp.where(valid, dn_labels, num_classes),
        "boxes": jnp.where(valid[..., None], dn_boxes, _INVALID_BOX),
        "positive": positive,
        "valid": valid,
        "target_index": jnp.broadcast_to(jnp.asarray(target_index, jnp.int32), valid.shape),
        "attention_mask": jnp.asarray(cdn_attention_mask(max_targets, groups, num_queries)),
    }
