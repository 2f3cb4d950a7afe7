import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from ood_jax import boxes

FRAMEWORKS = ["numpy", "jax", "tf"]


def to_fw(x, fw: str):
    x = np.asarray(x, np.float32)
    return {"numpy": lambda: x, "jax": lambda: jnp.asarray(x), "tf": lambda: tf.constant(x)}[fw]()


def assert_fw(y, fw: str) -> None:
    if fw == "numpy":
        assert type(y) is np.ndarray
    elif fw == "jax":
        assert isinstance(y, jax.Array)
    else:
        assert isinstance(y, tf.Tensor)
    assert np.asarray(y).dtype == np.float32


def random_xyxy(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    lo = rng.uniform(0.0, 0.7, shape + (2,))
    return np.concatenate([lo, lo + rng.uniform(0.05, 0.3, shape + (2,))], axis=-1)


def degenerate_pairs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Aligned xyxy boxes (a[i], b[i]) covering the corner cases, then random pairs."""
    a, b = random_xyxy(rng, (12,)), random_xyxy(rng, (12,))
    b[0] = a[0]  # identical
    b[1] = a[1] + 2.0  # disjoint
    b[2] = a[2] + np.array([0.01, 0.02, -0.02, -0.01])  # nested
    a[3, 2] = a[3, 0]  # zero width
    a[4] = b[4] = [0.3, 0.3, 0.3, 0.3]  # identical points: enclosing area 0
    a[5], b[5] = [0.1, 0.1, 0.1, 0.1], [0.6, 0.6, 0.6, 0.6]  # distinct points
    a[6] = b[6] = [0.2, 0.5, 0.8, 0.5]  # identical segments: enclosing area 0
    a[7], b[7] = [0.2, 0.5, 0.8, 0.5], [0.2, 0.2, 0.8, 0.2]  # parallel segments
    a[8], b[8] = [0.0, 0.0, 0.5, 0.5], [0.5, 0.0, 1.0, 0.5]  # touching edges
    return a.astype(np.float32), b.astype(np.float32)


def ref_pairwise(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Textbook IoU, union and GIoU for a [N, 4], b [M, 4] xyxy, one pair at a time."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    iou = np.zeros((len(a), len(b)))
    union = np.zeros((len(a), len(b)))
    giou = np.zeros((len(a), len(b)))
    for i in range(len(a)):
        for j in range(len(b)):
            ax0, ay0, ax1, ay1 = a[i]
            bx0, by0, bx1, by1 = b[j]
            iw = max(0.0, min(ax1, bx1) - max(ax0, bx0))
            ih = max(0.0, min(ay1, by1) - max(ay0, by0))
            inter = iw * ih
            area_a = max(0.0, ax1 - ax0) * max(0.0, ay1 - ay0)
            area_b = max(0.0, bx1 - bx0) * max(0.0, by1 - by0)
            u = area_a + area_b - inter
            enclosing = (max(ax1, bx1) - min(ax0, bx0)) * (max(ay1, by1) - min(ay0, by0))
            union[i, j] = u
            iou[i, j] = inter / u if u > 0 else 0.0
            giou[i, j] = iou[i, j] - ((enclosing - u) / enclosing if enclosing > 0 else 0.0)
    return iou, union, giou


def ref_batched(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out = [np.zeros(a.shape[:-1] + b.shape[-2:-1]) for _ in range(3)]
    for idx in np.ndindex(a.shape[:-2]):
        for o, r in zip(out, ref_pairwise(a[idx], b[idx])):
            o[idx] = r
    return tuple(out)


close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)

# One hand-checked box per format, batched [2, 1, 4].
CXCYWH = [[[0.5, 0.4, 0.2, 0.4]], [[0.3, 0.7, 0.4, 0.2]]]
XYXY = [[[0.4, 0.2, 0.6, 0.6]], [[0.1, 0.6, 0.5, 0.8]]]
YXYX = [[[0.2, 0.4, 0.6, 0.6]], [[0.6, 0.1, 0.8, 0.5]]]
XYWH = [[[0.4, 0.2, 0.2, 0.4]], [[0.1, 0.6, 0.4, 0.2]]]

KNOWN = [
    (boxes.cxcywh_to_xyxy, CXCYWH, XYXY),
    (boxes.xyxy_to_cxcywh, XYXY, CXCYWH),
    (boxes.yxyx_to_xyxy, YXYX, XYXY),
    (boxes.xyxy_to_yxyx, XYXY, YXYX),
    (boxes.cxcywh_to_yxyx, CXCYWH, YXYX),
    (boxes.yxyx_to_cxcywh, YXYX, CXCYWH),
    (boxes.xywh_to_xyxy, XYWH, XYXY),
    (boxes.xyxy_to_xywh, XYXY, XYWH),
]

PAIRS = [
    (boxes.cxcywh_to_xyxy, boxes.xyxy_to_cxcywh),
    (boxes.yxyx_to_xyxy, boxes.xyxy_to_yxyx),
    (boxes.cxcywh_to_yxyx, boxes.yxyx_to_cxcywh),
    (boxes.xywh_to_xyxy, boxes.xyxy_to_xywh),
    (
        functools.partial(boxes.scale, height=480.0, width=640.0),
        functools.partial(boxes.unscale, height=480.0, width=640.0),
    ),
    (
        functools.partial(boxes.cxcywh_to_coco, height=480.0, width=640.0),
        functools.partial(boxes.coco_to_cxcywh, height=480.0, width=640.0),
    ),
]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("fn,x,expected", KNOWN, ids=[k[0].__name__ for k in KNOWN])
def test_conversion_known_values(fn, x, expected, fw):
    y = fn(to_fw(x, fw))
    assert_fw(y, fw)
    close(np.asarray(y), np.asarray(expected, np.float32))


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("fwd,inv", PAIRS, ids=range(len(PAIRS)))
def test_round_trip(fwd, inv, fw):
    x = to_fw(np.random.default_rng(0).uniform(0.05, 0.95, (3, 5, 4)), fw)
    for f, g in ((fwd, inv), (inv, fwd)):
        y = g(f(x))
        assert_fw(f(x), fw)
        assert_fw(y, fw)
        assert np.asarray(y).shape == (3, 5, 4)
        close(np.asarray(y), np.asarray(x), atol=1e-5)


def test_conversions_inside_tf_data():
    x = np.random.default_rng(1).uniform(0.05, 0.95, (6, 4)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices(x).map(boxes.cxcywh_to_yxyx).batch(6)
    close(next(iter(ds)).numpy(), boxes.cxcywh_to_yxyx(x))


def test_conversions_under_jit():
    x = jnp.asarray(CXCYWH, jnp.float32)
    close(np.asarray(jax.jit(boxes.cxcywh_to_yxyx)(x)), np.asarray(YXYX, np.float32))


def test_import_does_not_import_tensorflow():
    code = "import sys, ood_jax.boxes; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_scale_unscale_broadcast(fw):
    b = np.tile(np.asarray([0.4, 0.2, 0.6, 0.6], np.float32), (2, 3, 1))
    height, width = to_fw([[100.0], [50.0]], fw), to_fw([[200.0], [10.0]], fw)
    expected = np.tile(np.asarray([[[80, 20, 120, 60]], [[4, 10, 6, 30]]], np.float32), (1, 3, 1))
    y = boxes.scale(to_fw(b, fw), height, width)
    assert_fw(y, fw)
    close(np.asarray(y), expected)
    close(np.asarray(boxes.unscale(to_fw(expected, fw), height, width)), b)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_coco_known_values(fw):
    # cx 0.5 w 0.2 of a 200-wide image is x 80..120; cy 0.5 h 0.4 of 100 high is y 30..70.
    cxcywh = to_fw([[0.5, 0.5, 0.2, 0.4], [0.25, 0.75, 0.5, 0.5]], fw)
    coco = to_fw([[80, 30, 40, 40], [0, 240, 320, 240]], fw)
    height, width = to_fw([100.0, 480.0], fw), to_fw([200.0, 640.0], fw)
    y = boxes.cxcywh_to_coco(cxcywh, height, width)
    assert_fw(y, fw)
    close(np.asarray(y), np.asarray(coco), atol=1e-4)
    z = boxes.coco_to_cxcywh(coco, height, width)
    assert_fw(z, fw)
    close(np.asarray(z), np.asarray(cxcywh))
    close(np.asarray(boxes.coco_to_cxcywh(y, height, width)), np.asarray(cxcywh))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_clip_xyxy(fw):
    y = boxes.clip_xyxy(to_fw([[-0.1, 0.5, 1.2, 1.5], [0.2, -3.0, 0.3, 0.4]], fw))
    assert_fw(y, fw)
    close(np.asarray(y), [[0.0, 0.5, 1.0, 1.0], [0.2, 0.0, 0.3, 0.4]])
    # Every coordinate exceeds its own bound but not the other axis's.
    y = boxes.clip_xyxy(to_fw([[-5, 100, 700, 500], [550, 500, 560, 600]], fw), 540.0, 480.0)
    close(np.asarray(y), [[0, 100, 540, 480], [540, 480, 540, 480]])


def test_area_clamps_inverted_boxes():
    b = jnp.asarray([[[0.0, 0.0, 2.0, 3.0], [1.0, 1.0, 0.0, 2.0]], [[0, 0, 1, 1], [0, 0, 0, 5]]])
    close(np.asarray(boxes.area(b)), [[6.0, 0.0], [1.0, 0.0]])


def test_pairwise_against_reference():
    a, b = degenerate_pairs(np.random.default_rng(2))
    ref_iou, ref_union, ref_giou = ref_pairwise(a, b)
    iou, union = boxes.pairwise_iou(jnp.asarray(a), jnp.asarray(b))
    assert iou.shape == union.shape == (12, 12)
    close(np.asarray(iou), ref_iou)
    close(np.asarray(union), ref_union)
    close(np.asarray(boxes.pairwise_giou(jnp.asarray(a), jnp.asarray(b))), ref_giou)
    # Also against itself: identical boxes on the diagonal.
    ref_iou, _, ref_giou = ref_pairwise(a, a)
    close(np.asarray(boxes.pairwise_iou(jnp.asarray(a), jnp.asarray(a))[0]), ref_iou)
    close(np.asarray(boxes.pairwise_giou(jnp.asarray(a), jnp.asarray(a))), ref_giou)


def test_elementwise_against_reference():
    a, b = degenerate_pairs(np.random.default_rng(3))
    ref_iou, _, ref_giou = ref_pairwise(a, b)
    iou = boxes.elementwise_iou(jnp.asarray(a), jnp.asarray(b))
    giou = boxes.elementwise_giou(jnp.asarray(a), jnp.asarray(b))
    assert iou.shape == giou.shape == (12,)
    close(np.asarray(iou), np.diag(ref_iou))
    close(np.asarray(giou), np.diag(ref_giou))


def test_hand_values():
    a = jnp.asarray([[0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    b = jnp.asarray([[1.0, 1.0, 3.0, 3.0], [9.0, 9.0, 10.0, 10.0], [0.0, 0.0, 1.0, 1.0]])
    # Overlap 1, union 7, enclosing 9 | union 2, enclosing 100 | identical.
    close(np.asarray(boxes.elementwise_iou(a, b)), [1 / 7, 0.0, 1.0])
    close(np.asarray(boxes.elementwise_giou(a, b)), [1 / 7 - 2 / 9, -0.98, 1.0])


def test_leading_batch_dims():
    rng = np.random.default_rng(4)
    a = random_xyxy(rng, (2, 3, 5)).astype(np.float32)
    b = random_xyxy(rng, (2, 3, 7)).astype(np.float32)
    a[0, 1, 2] = b[0, 1, 4]
    a[1, 2, 0] = [0.5, 0.5, 0.5, 0.5]
    ref_iou, ref_union, ref_giou = ref_batched(a, b)
    iou, union = boxes.pairwise_iou(jnp.asarray(a), jnp.asarray(b))
    giou = boxes.pairwise_giou(jnp.asarray(a), jnp.asarray(b))
    assert iou.shape == union.shape == giou.shape == (2, 3, 5, 7)
    close(np.asarray(iou), ref_iou)
    close(np.asarray(union), ref_union)
    close(np.asarray(giou), ref_giou)
    elem = boxes.elementwise_giou(jnp.asarray(a[..., :5, :]), jnp.asarray(b[..., :5, :]))
    assert elem.shape == (2, 3, 5)
    close(np.asarray(elem), np.diagonal(ref_giou[..., :5], axis1=-2, axis2=-1))


@pytest.mark.slow
def test_jit_and_vmap_match_eager():
    rng = np.random.default_rng(5)
    a, b = (jnp.asarray(random_xyxy(rng, (4, 6)), jnp.float32) for _ in range(2))
    a = a.at[0].set(jnp.asarray(degenerate_pairs(rng)[0][:6]))
    for fn in (
        boxes.pairwise_giou,
        lambda x, y: boxes.pairwise_iou(x, y)[0],
        boxes.elementwise_iou,
        boxes.elementwise_giou,
    ):
        eager = fn(a, b)
        close(np.asarray(jax.jit(fn)(a, b)), np.asarray(eager))
        close(np.asarray(jax.vmap(fn)(a, b)), np.asarray(eager))
        assert not np.isnan(np.asarray(eager)).any()


def test_giou_range():
    rng = np.random.default_rng(6)
    a, b = degenerate_pairs(rng)
    a = np.concatenate([a, random_xyxy(rng, (100,)).astype(np.float32)])
    b = np.concatenate([b, random_xyxy(rng, (100,)).astype(np.float32) * 3.0])
    giou = np.asarray(boxes.pairwise_giou(jnp.asarray(a), jnp.asarray(b)))
    assert np.isfinite(giou).all()
    assert giou.min() >= -1.0 - 1e-6 and giou.max() <= 1.0 + 1e-6
    # Both ends are reached: parallel segments give -1, identical boxes 1.
    assert np.isclose(giou.min(), -1.0) and np.isclose(giou.max(), 1.0)


@pytest.mark.parametrize("fn", [boxes.elementwise_giou, boxes.elementwise_iou])
def test_gradients_finite_on_degenerate_boxes(fn):
    a, b = degenerate_pairs(np.random.default_rng(7))
    ga, gb = jax.grad(lambda x, y: fn(x, y).sum(), argnums=(0, 1))(jnp.asarray(a), jnp.asarray(b))
    assert np.isfinite(np.asarray(ga)).all() and np.isfinite(np.asarray(gb)).all()
    # Non-degenerate overlapping rows must still get a learning signal.
    assert np.abs(np.asarray(ga)[2]).sum() > 0
