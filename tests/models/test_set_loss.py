"""DETR matching and loss against scipy and transformers' PyTorch DETR loss."""

import types

import jax
import numpy as np
import pytest
import scipy.optimize
import torch
from transformers.loss.loss_for_object_detection import ForObjectDetectionLoss

from ood_jax.models import set_loss as dl

NUM_CLASSES = 5
# One jitted function for all tests, so equal shapes compile once.
detr_loss = jax.jit(dl.set_loss)


def random_mask(rng: np.random.Generator, num_slots: int, num_real: int) -> np.ndarray:
    # Real targets at random slots, not only leading ones, so nothing relies on the order.
    mask = np.zeros(num_slots, bool)
    mask[rng.choice(num_slots, num_real, replace=False)] = True
    return mask


@pytest.mark.slow
@pytest.mark.parametrize("num_queries,num_slots", [(20, 8), (8, 8), (5, 8)])
def test_matching_total_cost_equals_scipy(num_queries: int, num_slots: int) -> None:
    rng = np.random.default_rng(num_queries)
    num_real = np.tile(np.arange(num_slots + 1), 12)  # every count 0..M, many seeds each
    costs = rng.normal(size=(len(num_real), num_queries, num_slots)).astype(np.float32)
    masks = np.stack([random_mask(rng, num_slots, r) for r in num_real])
    query_index, matched = jax.jit(jax.vmap(dl.hungarian_match))(costs, masks)
    query_index, matched = np.asarray(query_index), np.asarray(matched)

    for cost, mask, qi, ok in zip(costs, masks, query_index, matched):
        rows, cols = scipy.optimize.linear_sum_assignment(cost[:, mask].astype(np.float64))
        assert not ok[~mask].any()
        assert ok.sum() == min(num_queries, mask.sum())
        assert len(set(qi[ok])) == ok.sum()
        ours = cost[qi[ok], np.flatnonzero(ok)].sum(dtype=np.float64)
        np.testing.assert_allclose(ours, cost[:, mask][rows, cols].sum(), rtol=1e-5, atol=1e-5)


def test_matching_avoids_non_finite_costs() -> None:
    cost = np.array([[np.nan, 1.0], [0.0, np.inf], [5.0, 5.0]], np.float32)
    query_index, matched = jax.jit(dl.hungarian_match)(cost, np.array([True, True]))
    np.testing.assert_array_equal(query_index, [1, 0])
    assert bool(matched.all())


def make_batch(
    seed: int, num_real: list[int], num_queries: int, num_slots: int, num_aux: int
) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    batch = len(num_real)

    def head() -> dict:
        logits = rng.normal(size=(batch, num_queries, NUM_CLASSES + 1)).astype(np.float32)
        centers = rng.uniform(0.2, 0.8, (batch, num_queries, 2))
        sizes = rng.uniform(0.05, 0.4, (batch, num_queries, 2))
        boxes = np.concatenate([centers, sizes], -1).astype(np.float32)
        return {"logits": logits, "boxes": boxes}

    outputs = head()
    outputs["aux"] = [head() for _ in range(num_aux)]
    mask = np.stack([random_mask(rng, num_slots, r) for r in num_real])
    boxes = np.concatenate(
        [
            rng.uniform(0.2, 0.8, (batch, num_slots, 2)),
            rng.uniform(0.05, 0.4, (batch, num_slots, 2)),
        ],
        -1,
    ).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, (batch, num_slots))
    # Padding slots hold garbage, which must not matter.
    boxes[~mask] = rng.normal(size=((~mask).sum(), 4))
    labels[~mask] = -7
    return outputs, {"boxes": boxes, "labels": labels.astype(np.int32), "mask": mask}


def transformers_loss(outputs: dict, targets: dict) -> tuple[float, dict[str, float]]:
    num_aux = len(outputs["aux"])
    config = types.SimpleNamespace(
        class_cost=1.0,
        bbox_cost=5.0,
        giou_cost=2.0,
        num_labels=NUM_CLASSES,
        eos_coefficient=0.1,
        auxiliary_loss=num_aux > 0,
        bbox_loss_coefficient=5.0,
        giou_loss_coefficient=2.0,
        decoder_layers=num_aux + 1,
    )
    heads = outputs["aux"] + [outputs]
    labels = [
        {"class_labels": torch.as_tensor(lab[m]).long(), "boxes": torch.as_tensor(box[m])}
        for lab, box, m in zip(targets["labels"], targets["boxes"], targets["mask"])
    ]
    loss, loss_dict, _ = ForObjectDetectionLoss(
        logits=torch.as_tensor(outputs["logits"]),
        labels=labels,
        device="cpu",
        pred_boxes=torch.as_tensor(outputs["boxes"]),
        config=config,
        outputs_class=torch.stack([torch.as_tensor(h["logits"]) for h in heads]),
        outputs_coord=torch.stack([torch.as_tensor(h["boxes"]) for h in heads]),
    )
    return float(loss), {k: float(v) for k, v in loss_dict.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_real,num_queries,num_slots",
    [([0, 3, 8, 5], 20, 8), ([1, 2], 8, 8), ([6, 2, 0], 4, 8)],
)
def test_loss_equals_transformers(num_real: list[int], num_queries: int, num_slots: int) -> None:
    outputs, targets = make_batch(sum(num_real), num_real, num_queries, num_slots, num_aux=2)
    total, metrics = detr_loss(outputs, targets)
    ref_total, ref_terms = transformers_loss(outputs, targets)

    np.testing.assert_allclose(float(total), ref_total, rtol=1e-5, atol=1e-5)
    assert set(metrics) == {k for k in ref_terms if k.startswith("loss_")}
    for k, v in metrics.items():
        np.testing.assert_allclose(float(v), ref_terms[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_num_boxes_override() -> None:
    outputs, targets = make_batch(0, [2, 4], 10, 6, num_aux=1)
    _, own = detr_loss(outputs, targets, num_boxes=6)
    # Doubling the normalizer (as if other devices held as many boxes) halves the box terms only.
    _, halved = detr_loss(outputs, targets, num_boxes=12)
    for k in ("loss_bbox", "loss_giou_0"):
        np.testing.assert_allclose(halved[k], own[k] / 2, rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(halved["loss_ce"], own["loss_ce"], rtol=1e-6)


@jax.jit
def loss_and_grad(logits: jax.Array, boxes: jax.Array, outputs: dict, targets: dict) -> tuple:
    def loss(logits: jax.Array, boxes: jax.Array) -> jax.Array:
        return dl.set_loss({**outputs, "logits": logits, "boxes": boxes}, targets)[0]

    return jax.value_and_grad(loss, argnums=(0, 1))(logits, boxes)


@pytest.mark.parametrize("num_real", [[0, 3], [0, 0]])
def test_gradient_finite_without_targets(num_real: list[int]) -> None:
    outputs, targets = make_batch(1, num_real, 10, 6, num_aux=1)
    targets["boxes"][~targets["mask"]] = 0.0  # the pipeline pads with zeros: degenerate boxes

    value, grads = loss_and_grad(outputs["logits"], outputs["boxes"], outputs, targets)
    assert np.isfinite(value)
    assert all(np.isfinite(g).all() for g in grads)
    if sum(num_real) == 0:
        # Nothing to regress: the boxes get no gradient at all.
        assert not np.asarray(grads[1]).any()


@pytest.mark.slow
def test_query_groups_loss_is_mean_of_groups_matched_alone() -> None:
    num_groups, num_queries = 3, 5
    outputs, targets = make_batch(11, [3, 0, 5], num_groups * num_queries, 6, num_aux=1)
    total, metrics = jax.jit(lambda o, t: dl.set_loss(o, t, num_query_groups=num_groups))(
        outputs, targets
    )

    def group(level: dict, g: int) -> dict:
        cut = slice(g * num_queries, (g + 1) * num_queries)
        return {"logits": level["logits"][:, cut], "boxes": level["boxes"][:, cut]}

    refs = [
        transformers_loss(
            {**group(outputs, g), "aux": [group(a, g) for a in outputs["aux"]]}, targets
        )
        for g in range(num_groups)
    ]
    np.testing.assert_allclose(float(total), np.mean([r[0] for r in refs]), rtol=1e-5)
    for k, v in metrics.items():
        np.testing.assert_allclose(float(v), np.mean([r[1][k] for r in refs]), rtol=1e-5, err_msg=k)
