"""Parity of the Flax Deformable DETR with transformers' PyTorch one, on random weights.

Each case builds a small `DeformableDetrForObjectDetection`, randomizes every tensor (biases,
BatchNorm statistics, GroupNorms, level embeddings and heads included, so a mis-mapped tensor
cannot hide behind a constant initialization), saves it, converts it with
`convert_deformable.deformable_detr_from_hf` and compares final, auxiliary and (two-stage)
encoder outputs on padded inputs whose pixel mask reaches every feature level. This also pins
our deformable attention against transformers' inside a whole model.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("timm")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from ood_jax.models import convert_deformable, deformable_detr  # noqa: E402

ATOL = 1e-4
_TINY = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_n_points=2,
    decoder_n_points=3,
    num_queries=5,
    two_stage_num_proposals=6,
    num_labels=3,
    auxiliary_loss=True,
)
_TINY_RESNET = dict(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], embedding_size=8)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values of a sensible scale for every floating tensor of `model`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            elif t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) * t[0].numel() ** -0.5)
            elif name.endswith("weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))


def _inputs(height: int = 96, width: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, height, width, dtype=torch.long)
    # The second image is padded below and to the right, down to the stride-64 level.
    mask[1, height * 5 // 8 :, :] = 0
    mask[1, :, width * 9 // 16 :] = 0
    return images, mask


def _nhwc(x: torch.Tensor) -> jax.Array:
    return jnp.asarray(x.permute(0, 2, 3, 1).numpy())


def _max_abs(ours: jax.Array, ref: torch.Tensor) -> float:
    return float(np.abs(np.asarray(ours) - ref.detach().numpy()).max())


# name -> (checkpoint file, DeformableDetrConfig kwargs).
CASES = {
    # SenseTime/deformable-detr's layout (timm ResNet, C3-C5 + one extra level) with DINO's
    # options: queries from the encoder's top-k proposals, iterative box refinement.
    "timm-resnet18-two-stage-refine": (
        "safetensors",
        dict(use_timm_backbone=True, backbone="resnet18", two_stage=True, with_box_refine=True),
    ),
    # A torch pickle of the live state dict: tied heads appear twice and module names are the
    # transformers 5.x ones. Two backbone levels and two extra levels.
    "hf-resnet-refine": (
        "bin",
        dict(
            use_timm_backbone=False,
            backbone_config=dict(
                **_TINY_RESNET, layer_type="bottleneck", out_features=["stage3", "stage4"]
            ),
            with_box_refine=True,
        ),
    ),
    # transformers' default backbone wiring (stage4 only) and three levels: two extra levels
    # from stride-2 convolutions; one shared head, 2-d reference points throughout.
    "hf-resnet-plain-3-levels": (
        "safetensors",
        dict(
            use_timm_backbone=False,
            backbone_config=dict(**_TINY_RESNET, layer_type="basic", out_features=["stage4"]),
            num_feature_levels=3,
        ),
    ),
}


def _hf_model(kwargs: dict, seed: int = 1) -> "transformers.DeformableDetrForObjectDetection":
    kwargs = dict(kwargs)
    if "backbone_config" in kwargs:
        kwargs["backbone_config"] = transformers.ResNetConfig(**kwargs["backbone_config"])
    config = transformers.DeformableDetrConfig(use_pretrained_backbone=False, **kwargs, **_TINY)
    model = transformers.DeformableDetrForObjectDetection(config).eval()
    _randomize(model, seed)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_deformable_detr_matches_transformers(case: str, tmp_path) -> None:
    file_format, kwargs = CASES[case]
    model = _hf_model(kwargs)
    model.save_pretrained(tmp_path)
    if file_format == "bin":
        (tmp_path / "model.safetensors").unlink()
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")

    images, pixel_mask = _inputs()
    # transformers returns auxiliary outputs only alongside a loss.
    labels = [{"class_labels": torch.tensor([0]), "boxes": torch.tensor([[0.5] * 4])}] * 2
    with torch.no_grad():
        ref = model(pixel_values=images, pixel_mask=pixel_mask, labels=labels)

    module, variables = convert_deformable.deformable_detr_from_hf(tmp_path)
    out = jax.jit(module.apply)(variables, _nhwc(images), jnp.asarray(pixel_mask.numpy()))

    diffs = {"logits": _max_abs(out["logits"], ref.logits)}
    diffs["boxes"] = _max_abs(out["boxes"], ref.pred_boxes)
    assert len(out["aux"]) == len(ref.auxiliary_outputs) == model.config.decoder_layers - 1
    for i, (aux, theirs) in enumerate(zip(out["aux"], ref.auxiliary_outputs)):
        diffs[f"aux{i}.logits"] = _max_abs(aux["logits"], theirs["logits"])
        diffs[f"aux{i}.boxes"] = _max_abs(aux["boxes"], theirs["pred_boxes"])
    if model.config.two_stage:
        diffs["enc.logits"] = _max_abs(out["enc"]["logits"], ref.enc_outputs_class)
        diffs["enc.boxes"] = _max_abs(out["enc"]["boxes"], ref.enc_outputs_coord_logits.sigmoid())
    else:
        assert "enc" not in out
    print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) < ATOL, diffs


@pytest.mark.slow
def test_heads_follow_the_checkpoint_and_conversion_is_strict(tmp_path) -> None:
    """Head sharing is read from the tensors; unused, missing and disagreeing tied tensors are
    errors naming the keys."""
    model = _hf_model(CASES["timm-resnet18-two-stage-refine"][1])
    model.save_pretrained(tmp_path)
    module, variables = convert_deformable.deformable_detr_from_hf(tmp_path)
    # Two decoder heads of each kind and the encoder's: nothing shared in a two-stage model.
    assert not module.shared_class_head and not module.shared_box_head
    params = variables["params"]
    np.testing.assert_array_equal(
        params["class_embed_2"]["kernel"], model.class_embed[2].weight.detach().numpy().T
    )

    weights = load_file(tmp_path / "model.safetensors")
    extra = dict(weights, **{"model.decoder.extra.weight": np.zeros(3, np.float32)})
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.decoder\.extra\.weight"):
        convert_deformable.deformable_detr_from_hf(tmp_path)

    missing = {k: v for k, v in weights.items() if k != "model.pos_trans_norm.bias"}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="pos_trans_norm/bias"):
        convert_deformable.deformable_detr_from_hf(tmp_path)

    # A top-level copy of a decoder head that disagrees with it is not one tied tensor.
    untied = dict(weights)
    untied["class_embed.0.bias"] = weights["model.decoder.class_embed.0.bias"] + 1
    save_file(untied, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"class_embed\.0\.bias"):
        convert_deformable.deformable_detr_from_hf(tmp_path)


def test_postprocess_matches_transformers_image_processor() -> None:
    """Top-k over queries x classes of the sigmoid scores, as transformers post-processes."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 40, 7)).astype(np.float32)
    boxes = rng.uniform(0.1, 0.9, (2, 40, 4)).astype(np.float32)
    ours = deformable_detr.postprocess({"logits": logits, "boxes": boxes}, top_k=100)
    processor = transformers.DeformableDetrImageProcessor()
    outputs = transformers.models.deformable_detr.modeling_deformable_detr
    ref = processor.post_process_object_detection(
        outputs.DeformableDetrObjectDetectionOutput(
            logits=torch.tensor(logits), pred_boxes=torch.tensor(boxes)
        ),
        threshold=-1.0,
        top_k=100,
    )
    for i, r in enumerate(ref):
        np.testing.assert_allclose(ours["scores"][i], r["scores"].numpy(), atol=1e-6)
        np.testing.assert_array_equal(ours["labels"][i], r["labels"].numpy())
        cx, cy, w, h = np.moveaxis(np.asarray(ours["boxes"][i]), -1, 0)
        xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
        np.testing.assert_allclose(xyxy, r["boxes"].numpy(), atol=1e-6)
