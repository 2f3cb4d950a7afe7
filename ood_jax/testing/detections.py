"""Equality of two runs' detections up to ties, for tests of exported detectors.

Two runtimes may round a score in the last bits, so where two detections' scores tie within
the tolerance (DETR: a query's two best classes; top-k: neighbouring ranks) they may come out
in either order. There the other run's (label, box, score) must be one of the model's own
(query, class) pairs at that score: a tie broken the other way, not a different detection.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


@functools.partial(jax.jit, static_argnums=0)
def class_scores(module, variables, images, mask) -> tuple[jax.Array, jax.Array]:
    """Every query's score of every class [B, Q, C] and its box [B, Q, 4]: what the
    post-processing picks its detections from."""
    out = module.apply(variables, images, mask, train=False)
    if type(module).family == "detr":
        return jax.nn.softmax(out["logits"], -1)[..., :-1], out["boxes"]
    return jax.nn.sigmoid(out["logits"]), out["boxes"]


def assert_same_detections(
    module: Any,
    variables: dict[str, Any],
    images: np.ndarray,
    mask: np.ndarray,
    got: dict[str, np.ndarray],
    ref: dict[str, np.ndarray],
    tol: float,
) -> dict[str, float]:
    """Asserts `got`'s boxes, scores and labels are `ref`'s (both the detections of `module`
    on (images, mask)) within `tol`, up to ties, and returns the max differences and the
    number of ties."""
    assert got["labels"].shape == ref["labels"].shape
    score_diff = float(np.abs(got["scores"] - ref["scores"]).max())
    assert score_diff <= tol, f"scores differ by {score_diff}"

    same = (got["labels"] == ref["labels"]) & (np.abs(got["boxes"] - ref["boxes"]).max(-1) <= tol)
    if not same.all():
        table, boxes = jax.device_get(class_scores(module, variables, images, mask))
    for b, k in zip(*np.nonzero(~same)):
        label = got["labels"][b, k]
        match = (np.abs(table[b, :, label] - got["scores"][b, k]) <= tol) & (
            np.abs(boxes[b] - got["boxes"][b, k]).max(-1) <= tol
        )
        assert match.any(), f"image {b} detection {k}: {label}, {got['boxes'][b, k]} is none"
    box_diff = float(np.abs(got["boxes"] - ref["boxes"]).max(-1)[same].max())
    return {"boxes": box_diff, "scores": score_diff, "ties": int((~same).sum())}
