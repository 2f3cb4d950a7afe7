"""Deformable DETRs exported as transformers directories (`transformers_export.write`), loaded
by transformers itself.

Random-weight models (every variable drawn, so a mis-mapped tensor cannot hide behind an
initialization constant) are written, loaded with `from_pretrained` (no missing, unexpected or
mismatched keys), run on padded inputs against our module, and read back by our importer bit
for bit. DETR's export is tested on a trained run in tests/training/test_export.py.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402

from ood_jax.data import pipeline  # noqa: E402
from ood_jax.models import convert_deformable, registry, transformers_export  # noqa: E402
from ood_jax.testing.random_variables import random_variables  # noqa: E402

TINY = dict(
    num_classes=3,
    num_queries=7,
    hidden_dim=32,
    num_heads=4,
    num_encoder_layers=1,
    num_decoder_layers=2,
    ffn_dim=64,
    encoder_points=2,
    decoder_points=3,
    backbone="resnet18",
)
CASES = {
    # DINO's options: queries from the encoder's top-k proposals, one class head per layer; our
    # one box head goes into each of transformers' per-layer box heads.
    "two-stage-refine": dict(two_stage=True, with_box_refine=True, shared_box_head=True),
    # Learned queries, one class and one box head shared by every layer; two backbone maps and
    # one extra level, a trainable BatchNorm and dropout rates of our own.
    "plain-c4-c5": dict(
        num_feature_levels=3,
        backbone_stages=("stage3", "stage4"),
        backbone_norm="batch",
        dropout=0.05,
        attention_dropout=0.02,
    ),
}
INPUT = {"eval_size": 96, "max_size": 128}


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    images = rng.standard_normal((2, 96, 128, 3)).astype(np.float32)
    mask = np.ones((2, 96, 128), bool)
    # The second image is padded below and to the right, down to the coarsest level.
    mask[1, 60:, :] = False
    mask[1, :, 72:] = False
    return images, mask


def by_path(variables) -> dict[str, np.ndarray]:
    """Leaves by module path, whichever collection holds them (a trainable BatchNorm keeps
    scale and bias in params; transformers' frozen one, in batch_stats)."""
    flat = jax.tree_util.tree_leaves_with_path(variables)
    return {jax.tree_util.keystr(path[1:]): np.asarray(leaf) for path, leaf in flat}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_deformable_detr_export_loads_in_transformers_and_predicts_as_ours(case, tmp_path):
    args = {**TINY, **CASES[case]}
    module = registry.build_model(
        ml_collections.ConfigDict({"name": "deformable_detr", "args": args})
    )
    images, mask = inputs()
    variables = random_variables(module, images)
    names = ["cat", "dog", "person"]
    out = transformers_export.write(
        tmp_path / "hf",
        "deformable_detr",
        args,
        INPUT,
        variables,
        names,
        pipeline.IMAGENET_MEAN,
        pipeline.IMAGENET_STD,
        extra_files={"README.md": "# card\n"},
    )
    assert (out / "README.md").read_text() == "# card\n"
    model, info = transformers.DeformableDetrForObjectDetection.from_pretrained(
        out, output_loading_info=True
    )
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    model.eval()
    assert model.config.id2label == dict(enumerate(names))
    processor = transformers.DeformableDetrImageProcessor.from_pretrained(out)
    assert processor.size == {"shortest_edge": 96, "longest_edge": 128}
    assert list(processor.image_mean) == list(pipeline.IMAGENET_MEAN)

    ours = jax.jit(module.apply)(variables, jnp.asarray(images), jnp.asarray(mask))
    with torch.no_grad():
        theirs = model(
            pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2).copy()),
            pixel_mask=torch.from_numpy(mask.astype(np.int64)),
        )
    # float32 noise grows with the values through ~30 layers: 1e-5 of the output's scale.
    for name, reference in (("logits", theirs.logits), ("boxes", theirs.pred_boxes)):
        difference = np.abs(np.asarray(ours[name]) - reference.numpy()).max()
        scale = max(1.0, float(np.abs(reference.numpy()).max()))
        print(f"{case}: transformers' {name} against ours: max |difference| {difference:.2e}")
        assert difference <= 1e-5 * scale, (name, difference, scale)

    # Read back by our importer: the same architecture and every variable bit for bit.
    reread_module, reread = convert_deformable.deformable_detr_from_hf(out)
    for field in ("num_queries", "num_feature_levels", "two_stage", "with_box_refine"):
        assert getattr(reread_module, field) == getattr(module, field), field
    # The importer reads head sharing from the tensors; ours None ties as transformers does.
    ties = {
        "shared_class_head": not module.two_stage,
        "shared_box_head": not module.with_box_refine,
    }
    for field, tied in ties.items():
        ours = getattr(module, field)
        assert getattr(reread_module, field) == (tied if ours is None else ours), field
    assert reread_module.backbone_stages == module.backbone_stages
    written, read = by_path(variables), by_path(reread)
    assert read.keys() == written.keys()
    for path, value in written.items():
        np.testing.assert_array_equal(read[path], value, err_msg=path)
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "DeformableDetrForObjectDetection"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        ({"backbone": "vit_s16"}, r"backbone='vit_s16'.*cannot be exported"),
        ({"backbone_stages": ("stage2", "stage4")}, r"backbone_stages=.*last stages"),
        ({"backbone_last_stage": 3}, r"backbone_last_stage=3.*to the last stage"),
        ({"shared_class_head": False}, r"shared_class_head=False.*shares that head"),
        (
            {"two_stage": True, "with_box_refine": False, "shared_box_head": False},
            "shared_box_head",
        ),
    ],
)
def test_deformable_detr_export_refuses_what_transformers_cannot_express(args, message):
    with pytest.raises(ValueError, match=message):
        transformers_export.deformable_detr_config({**TINY, **args}, None)


def test_a_c4_detr_is_refused():
    with pytest.raises(ValueError, match=r"backbone_last_stage=3: transformers' DETR runs"):
        transformers_export.detr_config({**TINY, "backbone_last_stage": 3}, None)


def test_a_family_transformers_has_not_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model is dino; this format is written for detr and"):
        transformers_export.write(tmp_path, "dino", TINY, INPUT, {}, None, (0,) * 3, (1,) * 3)
