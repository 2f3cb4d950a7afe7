"""DINO's contrastive denoising queries: layout, noise distributions and attention mask."""

import functools
from collections.abc import Callable

import jax
import numpy as np
import pytest
import scipy.stats

from ood_jax.models import denoising

NUM_CLASSES = 10


# One jitted function for every test; the noise ratio is traced, so changing it doesn't recompile.
_make = jax.jit(
    denoising.make_cdn_queries,
    static_argnames=("num_classes", "num_queries", "num_dn_queries", "box_noise_scale"),
)


def jitted(**kwargs) -> Callable:
    return functools.partial(_make, **kwargs)


def random_targets(
    rng: np.random.Generator, num_real: list[int], num_slots: int, size: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Targets at random slots (not only leading ones), with garbage in the padding."""
    batch = len(num_real)
    mask = np.zeros((batch, num_slots), bool)
    for row, count in zip(mask, num_real):
        row[rng.choice(num_slots, count, replace=False)] = True
    centers = rng.uniform(0.35, 0.65, (batch, num_slots, 2))
    sizes = rng.uniform(*size, (batch, num_slots, 2))
    boxes = np.concatenate([centers, sizes], -1).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, (batch, num_slots)).astype(np.int32)
    boxes[~mask] = rng.normal(size=((~mask).sum(), 4))
    labels[~mask] = -3
    return labels, boxes, mask


def to_xyxy(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2], -1)


def dino_blocked_attention(single_pad: int, dn_number: int, num_queries: int) -> list[list[bool]]:
    """IDEA-Research's `prepare_for_cdn` mask loop, in plain Python (True = blocked)."""
    pad_size = single_pad * 2 * dn_number
    size = pad_size + num_queries
    blocked = [[False] * size for _ in range(size)]

    def block(rows: range, cols: range) -> None:
        for i in rows:
            for j in cols:
                blocked[i][j] = True

    block(range(pad_size, size), range(pad_size))
    for i in range(dn_number):
        rows = range(single_pad * 2 * i, single_pad * 2 * (i + 1))
        if i == 0:
            block(rows, range(single_pad * 2 * (i + 1), pad_size))
        if i == dn_number - 1:
            block(rows, range(single_pad * i * 2))
        else:
            block(rows, range(single_pad * 2 * (i + 1), pad_size))
            block(rows, range(single_pad * 2 * i))
    return blocked


@pytest.mark.slow
@pytest.mark.parametrize("num_slots,num_dn,groups", [(7, 100, 7), (60, 100, 1), (3, 0, 1)])
def test_shapes_and_layout_fixed_for_any_target_count(
    num_slots: int, num_dn: int, groups: int
) -> None:
    rng = np.random.default_rng(num_slots)
    make = jitted(num_classes=NUM_CLASSES, num_queries=11, num_dn_queries=num_dn)
    compiled_before = _make._cache_size()
    num_dn_slots = 2 * num_slots * groups
    # DINO's layout, written out: per group, M positive copies then M negative copies.
    positive = [half == 0 for _ in range(groups) for half in (0, 1) for _ in range(num_slots)]
    target = [m for _ in range(groups) for _ in (0, 1) for m in range(num_slots)]
    for num_real in ([0, 0], [1, num_slots], [num_slots // 2, 2]):
        labels, boxes, mask = random_targets(rng, num_real, num_slots, (0.05, 0.3))
        out = make(jax.random.key(sum(num_real)), labels, boxes, mask)
        assert out["labels"].shape == out["positive"].shape == (2, num_dn_slots)
        assert out["valid"].shape == out["target_index"].shape == (2, num_dn_slots)
        assert out["boxes"].shape == (2, num_dn_slots, 4)
        assert out["attention_mask"].shape == (num_dn_slots + 11,) * 2
        assert out["labels"].dtype == out["target_index"].dtype == np.int32
        np.testing.assert_array_equal(out["positive"], np.broadcast_to(positive, (2, num_dn_slots)))
        np.testing.assert_array_equal(
            out["target_index"], np.broadcast_to(target, (2, num_dn_slots))
        )
        blocked = dino_blocked_attention(num_slots, groups, 11)
        np.testing.assert_array_equal(out["attention_mask"], ~np.array(blocked, bool))
    # At most one compilation served every target count.
    assert _make._cache_size() - compiled_before <= 1


def test_padded_targets_make_invalid_slots() -> None:
    rng = np.random.default_rng(0)
    labels, boxes, mask = random_targets(rng, [0, 2, 4, 6], 6, (0.05, 0.3))
    out = jitted(num_classes=NUM_CLASSES, num_queries=4)(jax.random.key(0), labels, boxes, mask)
    valid = np.asarray(out["valid"])
    expected = np.take_along_axis(mask, np.asarray(out["target_index"]), axis=1)
    np.testing.assert_array_equal(valid, expected)
    assert (valid.sum(1) == 2 * mask.sum(1) * 8).all()  # G = 100 // 12 = 8 groups
    # Invalid slots hold the extra label-embedding row and DINO's padding box sigmoid(0).
    np.testing.assert_array_equal(np.asarray(out["labels"])[~valid], NUM_CLASSES)
    np.testing.assert_array_equal(np.asarray(out["boxes"])[~valid], 0.5)
    valid_labels = np.asarray(out["labels"])[valid]
    assert ((valid_labels >= 0) & (valid_labels < NUM_CLASSES)).all()
    assert ((np.asarray(out["boxes"]) >= 0) & (np.asarray(out["boxes"]) <= 1)).all()


@pytest.mark.parametrize("box_noise_scale", [1.0, 0.4])
def test_box_noise_within_and_beyond_half_scale(box_noise_scale: float) -> None:
    rng = np.random.default_rng(1)
    labels, boxes, mask = random_targets(rng, [8] * 64, 8, (0.05, 0.25))
    make = jitted(num_classes=NUM_CLASSES, num_queries=0, box_noise_scale=box_noise_scale)
    out = make(jax.random.key(7), labels, boxes, mask)
    index = np.asarray(out["target_index"])
    source = np.take_along_axis(boxes, index[..., None], axis=1)
    noised_boxes = np.asarray(out["boxes"], np.float64)
    assert ((noised_boxes >= 0) & (noised_boxes <= 1)).all()
    noised = to_xyxy(noised_boxes)
    # Corner displacement in units of box_noise_scale * (w/2, h/2, w/2, h/2).
    unit = box_noise_scale * np.tile(source[..., 2:], 2) / 2
    rel = np.abs(noised - to_xyxy(source)) / unit
    positive = np.asarray(out["positive"])[..., None].repeat(4, -1)
    # Clipping only pulls a corner back towards the box, so positives obey the bound clipped or
    # not; negatives are checked where no corner was clipped or crossed its opposite one.
    unclipped = (noised > 1e-6) & (noised < 1 - 1e-6)
    not_crossed = np.tile(noised_boxes[..., 2:] > 0, 2)
    pos, neg = rel[positive], rel[~positive & unclipped & not_crossed]
    assert pos.max() <= 1 + 1e-3
    assert neg.min() >= 1 - 1e-3 and neg.max() <= 2 + 1e-3
    assert neg.size > 0.5 * pos.size
    if box_noise_scale > 0.5:  # only then can opposite corners cross, collapsing the box
        assert (noised_boxes[..., 2:][~positive[..., :2]] == 0).any()


def test_corner_jitter_is_uniform_in_half_scale_bands() -> None:
    rng = np.random.default_rng(6)
    boxes = np.concatenate(
        [rng.uniform(0.3, 0.7, (4000, 2)), rng.uniform(0.05, 0.3, (4000, 2))], -1
    )
    positive = np.arange(4000) % 2 == 0
    corners = np.asarray(
        jax.jit(denoising.jitter_corners, static_argnums=3)(jax.random.key(0), boxes, positive, 0.4)
    )
    delta = (corners - to_xyxy(boxes)) / (0.4 * np.tile(boxes[:, 2:], 2) / 2)
    # |delta| ~ U[0, 1) for positives and U[1, 2) for negatives, with a fair random sign.
    assert scipy.stats.kstest(np.abs(delta[positive]).ravel(), "uniform").pvalue > 1e-4
    assert scipy.stats.kstest(np.abs(delta[~positive]).ravel() - 1, "uniform").pvalue > 1e-4
    assert scipy.stats.binomtest(int((delta > 0).sum()), delta.size).pvalue > 1e-4


@pytest.mark.parametrize("ratio", [0.5, 0.8, 0.0])
def test_label_noise_redraws_ratio_half_of_labels(ratio: float) -> None:
    rng = np.random.default_rng(2)
    labels, boxes, mask = random_targets(rng, [10] * 64, 10, (0.05, 0.3))
    labels[:] = 0  # so every redrawn label that differs is visible and its value is informative
    make = jitted(num_classes=NUM_CLASSES, num_queries=0, label_noise_ratio=ratio)
    noised = np.asarray(make(jax.random.key(3), labels, boxes, mask)["labels"])
    changed = noised != 0
    # DINO redraws with probability ratio/2, uniformly over all classes (the old one included).
    p_changed = ratio * 0.5 * (1 - 1 / NUM_CLASSES)
    if ratio == 0:
        assert not changed.any()
        return
    assert scipy.stats.binomtest(int(changed.sum()), changed.size, p_changed).pvalue > 1e-4
    counts = np.bincount(noised[changed], minlength=NUM_CLASSES)[1:]
    assert scipy.stats.chisquare(counts).pvalue > 1e-4


@pytest.mark.parametrize(
    "single_pad,groups,num_queries", [(3, 3, 7), (4, 1, 5), (2, 2, 0), (0, 1, 4)]
)
def test_attention_mask_matches_plain_python(
    single_pad: int, groups: int, num_queries: int
) -> None:
    allowed = denoising.cdn_attention_mask(single_pad, groups, num_queries)
    expected = ~np.array(dino_blocked_attention(single_pad, groups, num_queries), bool)
    np.testing.assert_array_equal(allowed, expected)


def test_same_key_same_queries_other_key_other_noise() -> None:
    labels, boxes, mask = random_targets(np.random.default_rng(4), [0, 2, 3, 6], 6, (0.05, 0.3))
    make = jitted(num_classes=NUM_CLASSES, num_queries=4)  # the shapes of the padding test
    first, again = (make(jax.random.key(1), labels, boxes, mask) for _ in range(2))
    other = make(jax.random.key(2), labels, boxes, mask)
    for k in first:
        np.testing.assert_array_equal(first[k], again[k], err_msg=k)
    assert not np.allclose(first["boxes"], other["boxes"])


def test_bad_shapes_raise() -> None:
    labels, boxes, mask = random_targets(np.random.default_rng(5), [1, 2], 4, (0.05, 0.3))
    with pytest.raises(ValueError, match="boxes"):
        denoising.make_cdn_queries(
            jax.random.key(0), labels, boxes[:, :3], mask, num_classes=3, num_queries=2
        )
