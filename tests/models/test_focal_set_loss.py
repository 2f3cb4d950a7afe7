"""DINO's loss against transformers' PyTorch Deformable DETR loss and a numpy denoising reference."""

import functools
import types

import jax
import numpy as np
import pytest
import scipy.optimize
import torch
import transformers
from transformers.loss import loss_deformable_detr as hf_loss

from ood_jax.models import denoising
from ood_jax.models import focal_set_loss as dl
from ood_jax.models.set_loss import hungarian_match

NUM_CLASSES = 5
ALPHA, GAMMA = 0.25, 2.0
# One jitted function for all tests, so equal shapes compile once.
dino_loss = jax.jit(dl.focal_set_loss, static_argnames="config")


def random_mask(rng: np.random.Generator, num_slots: int, num_real: int) -> np.ndarray:
    # Real targets at random slots, not only leading ones, so nothing relies on the order.
    mask = np.zeros(num_slots, bool)
    mask[rng.choice(num_slots, num_real, replace=False)] = True
    return mask


def random_boxes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    centers = rng.uniform(0.2, 0.8, (*shape, 2))
    sizes = rng.uniform(0.05, 0.4, (*shape, 2))
    return np.concatenate([centers, sizes], -1).astype(np.float32)


def random_head(rng: np.random.Generator, batch: int, num_queries: int) -> dict:
    logits = rng.normal(size=(batch, num_queries, NUM_CLASSES)).astype(np.float32)
    return {"logits": logits, "boxes": random_boxes(rng, (batch, num_queries))}


def make_batch(
    seed: int, num_real: list[int], num_queries: int, num_slots: int, num_aux: int
) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    batch = len(num_real)
    outputs = random_head(rng, batch, num_queries)
    outputs["aux"] = [random_head(rng, batch, num_queries) for _ in range(num_aux)]
    mask = np.stack([random_mask(rng, num_slots, r) for r in num_real])
    boxes = random_boxes(rng, (batch, num_slots))
    labels = rng.integers(0, NUM_CLASSES, (batch, num_slots))
    # Padding slots hold garbage, which must not matter.
    boxes[~mask] = rng.normal(size=((~mask).sum(), 4))
    labels[~mask] = -7
    return outputs, {"boxes": boxes, "labels": labels.astype(np.int32), "mask": mask}


def torch_targets(targets: dict, class_agnostic: bool = False) -> list[dict]:
    return [
        {
            "class_labels": torch.as_tensor(lab[m]).long() * (0 if class_agnostic else 1),
            "boxes": torch.as_tensor(box[m]),
        }
        for lab, box, m in zip(targets["labels"], targets["boxes"], targets["mask"])
    ]


def transformers_loss(heads: list[dict], labels: list[dict]) -> tuple[float, dict[str, float]]:
    """transformers' Deformable DETR loss; `heads` run from the first decoder layer to the last."""
    config = types.SimpleNamespace(
        class_cost=2.0,
        bbox_cost=5.0,
        giou_cost=2.0,
        num_labels=NUM_CLASSES,
        focal_alpha=ALPHA,
        auxiliary_loss=len(heads) > 1,
        bbox_loss_coefficient=5.0,
        giou_loss_coefficient=2.0,
        decoder_layers=len(heads),
    )
    loss, loss_dict, _ = hf_loss.DeformableDetrForObjectDetectionLoss(
        logits=torch.as_tensor(heads[-1]["logits"]),
        labels=labels,
        device="cpu",
        pred_boxes=torch.as_tensor(heads[-1]["boxes"]),
        config=config,
        outputs_class=torch.stack([torch.as_tensor(h["logits"]) for h in heads]),
        outputs_coord=torch.stack([torch.as_tensor(h["boxes"]) for h in heads]),
    )
    return float(loss), {k: float(v) for k, v in loss_dict.items() if k.startswith("loss_")}


def assert_terms_equal(ours: dict, ref: dict, suffix: str = "") -> None:
    for k, v in ref.items():
        np.testing.assert_allclose(float(ours[k + suffix]), v, rtol=1e-5, atol=1e-5, err_msg=k)


def test_matching_cost_and_assignment_equal_transformers(monkeypatch) -> None:
    outputs, targets = make_batch(0, [0, 3, 8, 5, 1], 20, 8, num_aux=0)
    # transformers' matcher hands each image's [Q, R] cost to scipy; record what it hands over.
    seen = []

    def recording_assignment(cost):
        seen.append(cost.numpy().astype(np.float64))
        return scipy.optimize.linear_sum_assignment(cost)

    monkeypatch.setattr(hf_loss, "linear_sum_assignment", recording_assignment)
    matcher = hf_loss.DeformableDetrHungarianMatcher(class_cost=2, bbox_cost=5, giou_cost=2)
    ref_pairs = matcher(
        {
            "logits": torch.as_tensor(outputs["logits"]),
            "pred_boxes": torch.as_tensor(outputs["boxes"]),
        },
        torch_targets(targets),
    )

    labels = np.where(targets["mask"], targets["labels"], 0)
    cost = jax.jit(jax.vmap(dl.focal_matching_cost))(
        outputs["logits"], outputs["boxes"], labels, targets["boxes"]
    )
    query_index, matched = jax.jit(jax.vmap(hungarian_match))(cost, targets["mask"])
    for b, mask in enumerate(targets["mask"]):
        ours = np.asarray(cost[b])[:, mask]
        np.testing.assert_allclose(ours, seen[b], rtol=1e-5, atol=1e-5)
        rows, cols = ref_pairs[b]
        assert np.asarray(matched[b]).sum() == mask.sum()
        ref_total = seen[b][rows.numpy(), cols.numpy()].sum()
        our_total = ours[np.asarray(query_index[b])[mask], np.arange(mask.sum())].sum()
        np.testing.assert_allclose(our_total, ref_total, rtol=1e-5, atol=1e-5)
        # Random costs have one optimum, so the pairs agree too.
        assert sorted(zip(rows.tolist(), cols.tolist())) == sorted(
            zip(np.asarray(query_index[b])[mask].tolist(), range(mask.sum()))
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_real,num_queries,num_slots",
    # The first case has the shapes of the end-to-end test below (one compilation for both); the
    # second has fewer queries than targets.
    [([0, 3, 5], 24, 5), ([6, 2, 0], 4, 8)],
)
def test_loss_equals_transformers(num_real: list[int], num_queries: int, num_slots: int) -> None:
    outputs, targets = make_batch(sum(num_real), num_real, num_queries, num_slots, num_aux=2)
    total, metrics = dino_loss(outputs, targets)
    ref_total, ref_terms = transformers_loss([*outputs["aux"], outputs], torch_targets(targets))

    np.testing.assert_allclose(float(total), ref_total, rtol=1e-5, atol=1e-5)
    assert set(metrics) == set(ref_terms)
    assert_terms_equal(metrics, ref_terms)


@pytest.mark.slow
def test_encoder_terms_equal_transformers() -> None:
    # DINO: proposals are supervised with the real classes. As many proposals as queries, so the
    # encoder is matched in one vmap with the decoder layers.
    outputs, targets, dn = denoising_batch(5, [2, 0, 5, 1])
    _, metrics = dino_loss(outputs, targets, denoise=dn)
    # transformers computes no encoder loss; its per-layer loss on the proposals is the reference.
    _, enc_terms = transformers_loss([outputs["enc"]], torch_targets(targets))
    _, dec_terms = transformers_loss([*outputs["aux"], outputs], torch_targets(targets))
    assert_terms_equal(metrics, enc_terms, suffix="_enc")
    assert_terms_equal(metrics, dec_terms)


@pytest.mark.slow
def test_class_agnostic_encoder_terms_equal_transformers() -> None:
    # Deformable DETR: every class collapsed to class 0; fewer proposals than queries this time.
    outputs, targets = make_batch(5, [2, 0, 6], 20, 8, num_aux=1)
    outputs["enc"] = random_head(np.random.default_rng(6), 3, 12)
    config = dl.FocalSetLossConfig(encoder_weight=0.5, encoder_class_agnostic=True)
    total, metrics = dino_loss(outputs, targets, config=config)

    enc_total, enc_terms = transformers_loss([outputs["enc"]], torch_targets(targets, True))
    dec_total, dec_terms = transformers_loss([*outputs["aux"], outputs], torch_targets(targets))
    assert_terms_equal(metrics, enc_terms, suffix="_enc")
    assert_terms_equal(metrics, dec_terms)
    np.testing.assert_allclose(float(total), dec_total + 0.5 * enc_total, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_equals_transformers_deformable_detr_model() -> None:
    """End to end: the loss DeformableDetrForObjectDetection computes from its own outputs."""
    config = transformers.DeformableDetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=transformers.ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16, 16, 32],
            depths=[1, 1, 1, 1],
            layer_type="basic",
            out_features=["stage2", "stage3", "stage4"],
        ),
        d_model=32,
        encoder_layers=1,
        decoder_layers=3,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_n_points=2,
        decoder_n_points=2,
        num_queries=24,
        num_labels=NUM_CLASSES,
        two_stage=False,
        auxiliary_loss=True,
        class_cost=2,
        bbox_cost=5,
        giou_cost=2,
    )
    torch.manual_seed(0)
    model = transformers.DeformableDetrForObjectDetection(config).eval()
    _, targets = make_batch(7, [3, 0, 1], 1, 5, num_aux=0)
    with torch.no_grad():
        ref = model(pixel_values=torch.randn(3, 3, 48, 64), labels=torch_targets(targets))

    def head(logits: torch.Tensor, boxes: torch.Tensor) -> dict:
        return {"logits": logits.numpy(), "boxes": boxes.numpy()}

    outputs = head(ref.logits, ref.pred_boxes)
    outputs["aux"] = [head(a["logits"], a["pred_boxes"]) for a in ref.auxiliary_outputs]
    total, metrics = dino_loss(outputs, targets)
    np.testing.assert_allclose(float(total), float(ref.loss), rtol=1e-5, atol=1e-5)
    assert_terms_equal(metrics, {k: float(v) for k, v in ref.loss_dict.items() if "loss" in k})


def numpy_focal(logits: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    prob = 1 / (1 + np.exp(-logits))
    ce = np.maximum(logits, 0) - logits * onehot + np.log1p(np.exp(-np.abs(logits)))
    p_t = prob * onehot + (1 - prob) * (1 - onehot)
    return (ALPHA * onehot + (1 - ALPHA) * (1 - onehot)) * ce * (1 - p_t) ** GAMMA


def numpy_giou(a: np.ndarray, b: np.ndarray) -> float:
    a = np.concatenate([a[:2] - a[2:] / 2, a[:2] + a[2:] / 2])
    b = np.concatenate([b[:2] - b[2:] / 2, b[:2] + b[2:] / 2])
    inter = np.prod(np.clip(np.minimum(a[2:], b[2:]) - np.maximum(a[:2], b[:2]), 0, None))
    union = np.prod(a[2:] - a[:2]) + np.prod(b[2:] - b[:2]) - inter
    hull = np.prod(np.maximum(a[2:], b[2:]) - np.minimum(a[:2], b[:2]))
    return inter / union - (hull - union) / hull


def numpy_denoising_reference(dn: dict, targets: dict, groups: int) -> list[dict[str, float]]:
    """DINO's denoising loss per decoder layer, with its index bookkeeping written out as loops.

    Group g of slots holds positives at g*2M + m and negatives at g*2M + M + m for target slot m;
    positives learn the target's class and box, negatives learn "no class"; copies of padded
    targets take no part.
    """
    num_layers, batch, _, _ = dn["logits"].shape
    num_slots = targets["mask"].shape[1]
    normalizer = max(targets["mask"].sum(), 1) * groups
    per_layer = []
    for layer in range(num_layers):
        ce = bbox = giou = 0.0
        for b in range(batch):
            for m in np.flatnonzero(targets["mask"][b]):
                label, box = targets["labels"][b, m], targets["boxes"][b, m].astype(np.float64)
                for g in range(groups):
                    pos, neg = g * 2 * num_slots + m, g * 2 * num_slots + num_slots + m
                    onehot = np.eye(NUM_CLASSES)[label]
                    ce += numpy_focal(dn["logits"][layer, b, pos].astype(np.float64), onehot).sum()
                    ce += numpy_focal(
                        dn["logits"][layer, b, neg].astype(np.float64), 0 * onehot
                    ).sum()
                    pred = dn["boxes"][layer, b, pos].astype(np.float64)
                    bbox += np.abs(pred - box).sum()
                    giou += 1 - numpy_giou(pred, box)
        per_layer.append(
            {
                "loss_ce": ce / normalizer,
                "loss_bbox": bbox / normalizer,
                "loss_giou": giou / normalizer,
            }
        )
    return per_layer


make_cdn_queries = jax.jit(
    functools.partial(
        denoising.make_cdn_queries, num_classes=NUM_CLASSES, num_queries=12, num_dn_queries=30
    )
)


def denoising_batch(seed: int, num_real: list[int]) -> tuple[dict, dict, dict]:
    """Outputs with every head (aux, enc, dn) at one set of shapes, so the tests share a compile."""
    rng = np.random.default_rng(seed)
    outputs, targets = make_batch(seed, num_real, 12, 5, num_aux=2)
    outputs["enc"] = random_head(rng, len(num_real), 12)
    dn = make_cdn_queries(
        jax.random.key(seed), targets["labels"], targets["boxes"], targets["mask"]
    )
    shape = (3, len(num_real), dn["labels"].shape[1])
    outputs["dn"] = {
        "logits": rng.normal(size=(*shape, NUM_CLASSES)).astype(np.float32),
        "boxes": random_boxes(rng, shape),
    }
    return outputs, targets, dn


def weighted_total(metrics: dict) -> float:
    return sum(
        float(v) * {"ce": 1, "bbox": 5, "giou": 2}[k.split("_")[1]] for k, v in metrics.items()
    )


@pytest.mark.slow
def test_denoising_loss_equals_numpy_reference() -> None:
    outputs, targets, dn = denoising_batch(8, [2, 0, 5, 1])
    total, metrics = dino_loss(outputs, targets, denoise=dn)
    groups = 3  # 30 // (2 * 5)
    assert dn["labels"].shape[1] == 2 * 5 * groups
    reference = numpy_denoising_reference(outputs["dn"], targets, groups)
    for layer, ref in enumerate(reference):
        suffix = "_dn" if layer == len(reference) - 1 else f"_dn_{layer}"
        assert_terms_equal(metrics, ref, suffix)
    # 3 decoder layers, the encoder and 3 denoising layers, all at the default weights.
    assert len(metrics) == 3 * 7
    np.testing.assert_allclose(float(total), weighted_total(metrics), rtol=1e-5)


@pytest.mark.slow
def test_num_boxes_override_scales_every_term() -> None:
    outputs, targets, dn = denoising_batch(9, [2, 4, 0, 1])
    _, own = dino_loss(outputs, targets, denoise=dn)
    # Doubling the normalizer (as if other devices held as many boxes) halves every term: the
    # focal loss is normalized by the box count too, unlike DETR's cross-entropy.
    _, halved = dino_loss(outputs, targets, denoise=dn, num_boxes=2 * targets["mask"].sum())
    assert set(own) == set(halved)
    for k in own:
        np.testing.assert_allclose(halved[k], own[k] / 2, rtol=1e-5, err_msg=k)


@jax.jit
def loss_and_grad(outputs: dict, targets: dict, dn: dict) -> tuple:
    def loss(outputs: dict) -> jax.Array:
        return dl.focal_set_loss(outputs, targets, denoise=dn)[0]

    return jax.value_and_grad(loss)(outputs)


@pytest.mark.slow
@pytest.mark.parametrize("num_real", [[0, 3, 5, 1], [0, 0, 0, 0]])
def test_gradients_finite(num_real: list[int]) -> None:
    outputs, targets, dn = denoising_batch(10, num_real)
    targets["boxes"][~targets["mask"]] = 0.0  # the pipeline pads with zeros: degenerate boxes

    value, grads = loss_and_grad(outputs, targets, dn)
    assert np.isfinite(value)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == 2 * 5  # logits and boxes of the final, 2 aux, enc and dn heads
    for path, grad in leaves:
        name, grad = jax.tree_util.keystr(path), np.asarray(grad)
        assert np.isfinite(grad).all(), name
        if "logits" in name:
            # Matched heads always learn, at least towards "no class"; denoising copies exist
            # only for real targets.
            assert grad.any() == ("dn" not in name or sum(num_real) > 0), name
        else:
            # With nothing to regress no box gets any gradient.
            assert grad.any() == (sum(num_real) > 0), name


def test_compiles_once_for_any_target_count() -> None:
    compiled_before = dino_loss._cache_size()
    for num_real in ([0, 0, 0, 0], [3, 1, 5, 2], [5, 5, 5, 5]):
        outputs, targets, dn = denoising_batch(11, num_real)
        total, _ = dino_loss(outputs, targets, denoise=dn)
        assert np.isfinite(total)
    assert dino_loss._cache_size() - compiled_before <= 1


def test_bad_inputs_raise() -> None:
    outputs, targets, dn = denoising_batch(12, [1, 2, 0, 3])
    with pytest.raises(ValueError, match="denoise"):
        dl.focal_set_loss(outputs, targets)
    with pytest.raises(ValueError, match=r"outputs\['dn'\]"):
        dl.focal_set_loss({**outputs, "aux": outputs["aux"][:1]}, targets, denoise=dn)
    bad = {**targets, "labels": np.where(targets["mask"], NUM_CLASSES, 0).astype(np.int32)}
    with pytest.raises(ValueError, match="labels"):
        dl.focal_set_loss(outputs, bad, denoise=dn)
    with pytest.raises(ValueError, match="boxes"):
        dl.focal_set_loss(outputs, {**targets, "boxes": targets["boxes"][..., :2]}, denoise=dn)
