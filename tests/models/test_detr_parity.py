"""Parity of the Flax DETR and ResNet with transformers and torchvision, on random weights.

Every checkpoint tensor is randomized (including biases, BatchNorm statistics and the heads,
which the references initialize to constants) so a mis-mapped tensor cannot hide behind a
default value. Inputs are padded so the pixel mask reaches the feature map.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")
pytest.importorskip("timm")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from ood_jax.models import backbones, convert, detr, resnet  # noqa: E402
from ood_jax.testing.random_variables import random_variables  # noqa: E402

ATOL = 1e-4
_TINY = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=3,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    num_queries=5,
    num_labels=3,
)


def _small_detr(**fields) -> detr.DETR:
    """A DETR of a ResNet-18 and a small transformer, with `fields` changed."""
    small = dict(
        num_classes=3,
        num_queries=4,
        hidden_dim=32,
        num_heads=4,
        num_encoder_layers=1,
        num_decoder_layers=2,
        ffn_dim=64,
        backbone="resnet18",
    )
    return detr.DETR(**{**small, **fields})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values of a sensible scale for every floating tensor of `model`."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            elif t.ndim >= 2:
                t.copy_(normal(t.shape, t[0].numel() ** -0.5))
            elif name.endswith("weight"):
                t.copy_(1 + normal(t.shape, 0.1))
            else:
                t.copy_(normal(t.shape, 0.1))


def _nhwc(x: torch.Tensor) -> jax.Array:
    return jnp.asarray(x.permute(0, 2, 3, 1).numpy())


def _max_abs(ours: jax.Array, ref: torch.Tensor) -> float:
    return float(np.abs(np.asarray(ours) - ref.detach().numpy()).max())


def _inputs(height: int = 128, width: int = 160) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, height, width, dtype=torch.long)
    # Padding below and right of the second image, reaching feature rows and columns at
    # strides 16 and 32.
    mask[1, height // 2 :, :] = 0
    mask[1, :, width * 9 // 16 :] = 0
    return images, mask


def _heads(model: torch.nn.Module, hidden: torch.Tensor) -> tuple:
    return model.class_labels_classifier(hidden), model.bbox_predictor(hidden).sigmoid()


# name -> (checkpoint file, DetrConfig kwargs).
DETR_CASES = {
    # facebook/detr-resnet-50's layout, with transformers' auxiliary_loss decoder.
    "timm-resnet18-auxloss": (
        "safetensors",
        dict(use_timm_backbone=True, backbone="resnet18", auxiliary_loss=True, **_TINY),
    ),
    "timm-resnet50-dc5": (
        "safetensors",
        dict(use_timm_backbone=True, backbone="resnet50", dilation=True, **_TINY),
    ),
    # A torch pickle of the live state dict: the other file format, and transformers 5.x
    # module names instead of the legacy ones save_pretrained writes.
    "hf-resnet-bottleneck": (
        "bin",
        dict(
            use_timm_backbone=False,
            backbone_config=dict(
                depths=[1, 2, 1, 1],
                hidden_sizes=[16, 32, 64, 128],
                embedding_size=8,
                layer_type="bottleneck",
                out_features=["stage4"],
            ),
            **_TINY,
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(DETR_CASES))
def test_detr_matches_transformers(case: str, tmp_path) -> None:
    file_format, kwargs = DETR_CASES[case]
    kwargs = dict(kwargs)
    if "backbone_config" in kwargs:
        kwargs["backbone_config"] = transformers.ResNetConfig(**kwargs["backbone_config"])
    config = transformers.DetrConfig(use_pretrained_backbone=False, **kwargs)
    model = transformers.DetrForObjectDetection(config).eval()
    _randomize(model, seed=1)
    model.save_pretrained(tmp_path)
    if file_format == "bin":
        (tmp_path / "model.safetensors").unlink()
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")

    images, pixel_mask = _inputs()
    with torch.no_grad():
        if config.auxiliary_loss:
            # transformers returns auxiliary outputs only alongside a loss.
            labels = [{"class_labels": torch.tensor([0]), "boxes": torch.tensor([[0.5] * 4])}] * 2
            ref = model(pixel_values=images, pixel_mask=pixel_mask, labels=labels)
            ref_aux = [(a["logits"], a["pred_boxes"]) for a in ref.auxiliary_outputs]
        else:
            # The paper's auxiliary outputs: every decoder layer's output through the shared
            # final LayerNorm and the heads (hidden_states[0] is the decoder's input).
            ref = model(pixel_values=images, pixel_mask=pixel_mask, output_hidden_states=True)
            layernorm = model.model.decoder.layernorm
            ref_aux = [_heads(model, layernorm(h)) for h in ref.decoder_hidden_states[1:-1]]

    module, variables = convert.detr_from_hf(tmp_path)
    out = jax.jit(module.apply)(variables, _nhwc(images), jnp.asarray(pixel_mask.numpy()))

    diffs = {"logits": _max_abs(out["logits"], ref.logits)}
    diffs["boxes"] = _max_abs(out["boxes"], ref.pred_boxes)
    assert len(out["aux"]) == len(ref_aux) == config.decoder_layers - 1
    for i, (aux, (logits, boxes)) in enumerate(zip(out["aux"], ref_aux)):
        diffs[f"aux{i}.logits"] = _max_abs(aux["logits"], logits)
        diffs[f"aux{i}.boxes"] = _max_abs(aux["boxes"], boxes)
    print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) < ATOL, diffs


@pytest.mark.slow
def test_detr_pixel_mask_and_bfloat16() -> None:
    module = _small_detr(num_queries=5)
    images, pixel_mask = _inputs(64, 96)
    images, pixel_mask = _nhwc(images), jnp.asarray(pixel_mask.numpy())
    variables = random_variables(module, images)
    apply = jax.jit(module.apply)
    masked = apply(variables, images, pixel_mask)
    unmasked = apply(variables, images, jnp.ones_like(pixel_mask))

    # No mask means all pixels are real; padding changes only the padded example.
    default = jax.jit(module.apply)(variables, images)
    np.testing.assert_allclose(default["logits"], unmasked["logits"], atol=1e-6)
    np.testing.assert_allclose(masked["logits"][0], unmasked["logits"][0], atol=1e-6)
    assert np.abs(masked["logits"][1] - unmasked["logits"][1]).max() > 1e-3

    # bfloat16 compute keeps float32 parameters and returns float32 outputs near float32's.
    low = jax.jit(module.clone(dtype=jnp.bfloat16).apply)(variables, images, pixel_mask)
    assert low["logits"].dtype == low["boxes"].dtype == jnp.float32
    assert np.abs(low["boxes"] - masked["boxes"]).max() < 0.05


@pytest.mark.slow
def test_query_groups_train_alone_and_infer_with_the_first() -> None:
    module = _small_detr(dropout=0.0, num_query_groups=3)
    images, _ = _inputs(64, 64)
    images = _nhwc(images)
    variables = random_variables(module, images)
    grouped = jax.jit(lambda v, x: module.apply(v, x, train=True))(variables, images)
    assert grouped["logits"].shape == (2, 12, 4)

    # Each group sees only itself: any group run alone (its queries as a one-group model's)
    # reproduces its slice of the grouped run, and inference runs the first group alone.
    apply_single = jax.jit(module.clone(num_query_groups=1).apply)
    table = variables["params"]["query_position_embeddings"]["embedding"]
    for g in range(3):
        params = {**variables["params"]}
        params["query_position_embeddings"] = {"embedding": table[4 * g : 4 * (g + 1)]}
        alone = apply_single({**variables, "params": params}, images)
        for key in ("logits", "boxes"):
            np.testing.assert_allclose(
                grouped[key][:, 4 * g : 4 * (g + 1)], alone[key], atol=1e-5, err_msg=f"{key} {g}"
            )
        if g == 0:
            inferred = jax.jit(module.apply)(variables, images)
            np.testing.assert_allclose(inferred["logits"], alone["logits"], atol=1e-6)


def _torchvision_stages(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    stages = {}
    for i in range(1, 5):
        x = getattr(model, f"layer{i}")(x)
        stages[f"stage{i}"] = x
    return stages


def _random_torchvision(arch: str, dilation: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(replace_stride_with_dilation=[False, False, dilation])
    _randomize(model, seed=2)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,norm,dilation",
    [
        ("resnet18", "batch", False),
        ("resnet18", "frozen", False),
        ("resnet50", "batch", False),
        ("resnet50", "frozen", True),
    ],
)
def test_resnet_matches_torchvision(arch: str, norm: str, dilation: bool) -> None:
    model = _random_torchvision(arch, dilation)
    flax_model = resnet.build(arch, norm=norm, dilation=dilation)
    variables = convert.resnet_from_torch(model.state_dict(), flax_model)
    if norm == "frozen":
        # The optimizer sees convolution kernels only.
        leaves = jax.tree_util.tree_leaves_with_path(variables["params"])
        assert all(jax.tree_util.keystr(p).endswith("['kernel']") for p, _ in leaves)

    images = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = _torchvision_stages(model, images)
    out = jax.jit(flax_model.apply)(variables, _nhwc(images))
    for name, feature in ref.items():
        diff = _max_abs(out[name], feature.permute(0, 2, 3, 1))
        print(arch, norm, name, f"{diff:.1e}")
        assert diff < ATOL, (name, diff)


@pytest.mark.slow
def test_resnet_batchnorm_train_mode_matches_torchvision() -> None:
    model = _random_torchvision("resnet18")
    flax_model = resnet.build("resnet18", norm="batch")
    variables = convert.resnet_from_torch(model.state_dict(), flax_model)
    images = torch.randn(4, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = _torchvision_stages(model.train(), images)
    out, _ = flax_model.apply(variables, _nhwc(images), train=True, mutable=["batch_stats"])
    diff = _max_abs(out["stage4"], ref["stage4"].permute(0, 2, 3, 1))
    assert diff < ATOL, diff


@pytest.mark.slow
def test_c4_trunk_is_torchvisions_first_three_stages() -> None:
    """A trunk ending at stage 3 loads a whole torchvision checkpoint (layer4 is left out) and
    computes its first three stages; a DETR on it has no stage 4 and projects stage 3's map."""
    model = _random_torchvision("resnet50")
    flax_model = resnet.build("resnet50", norm="frozen", last_stage=3)
    variables = convert.resnet_from_torch(model.state_dict(), flax_model)
    assert not [k for k in variables["params"] if k.startswith("stage4")]

    images = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = _torchvision_stages(model, images)
    out = jax.jit(flax_model.apply)(variables, _nhwc(images))
    assert sorted(out) == ["stage1", "stage2", "stage3"]
    for name, feature in out.items():
        assert _max_abs(feature, ref[name].permute(0, 2, 3, 1)) < ATOL, name

    module = _small_detr(backbone_last_stage=3)
    x = jnp.zeros((1, 64, 96, 3))
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), x))
    assert "stage4_block0" not in shapes["params"]["backbone"]
    # The input projection reads stage 3's 256 channels.
    assert shapes["params"]["input_projection"]["kernel"].shape[-2] == 256


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(last_stage=0), "last_stage must be in"),
        (dict(last_stage=5), "last_stage must be in"),
        (dict(last_stage=3, dilation=True), "dilation dilates stage 4"),
        (dict(last_stage=2, frozen_stages=3), "frozen_stages=3 freezes stages after"),
    ],
)
def test_a_trunk_that_cannot_end_there_is_refused(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        resnet.build("resnet18", **fields).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


def test_a_neck_reading_a_stage_the_trunk_leaves_out_is_refused() -> None:
    with pytest.raises(ValueError, match=r"read stage4, which backbone_last_stage=3 leaves out"):
        backbones.BackboneConfig.from_args(
            {"backbone_last_stage": 3}, stages=backbones.MULTI_SCALE_STAGES
        )


@pytest.mark.parametrize("stages", [("stage2", "res4"), ("stage", "stage3"), ("stage5",)])
def test_a_neck_reading_no_resnet_stage_is_refused_by_name(stages) -> None:
    bad = next(s for s in stages if s not in backbones.RESNET_STAGES)
    with pytest.raises(ValueError, match=rf"'{bad}' is no ResNet stage; use names of stage1, "):
        backbones.BackboneConfig.from_args({"backbone_last_stage": 3, "backbone_stages": stages})


def test_conversion_names_unused_missing_and_misshapen_keys(tmp_path) -> None:
    state = {k: v.numpy() for k, v in torchvision.models.resnet18().state_dict().items()}
    module = resnet.build("resnet18", norm="frozen")

    extra = dict(state, **{"layer1.0.se.fc.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(KeyError, match=r"layer1\.0\.se\.fc\.weight"):
        convert.resnet_from_torch(extra, module)

    missing = {k: v for k, v in state.items() if k != "layer2.0.downsample.1.running_var"}
    with pytest.raises(KeyError, match="stage2_block0/proj_norm/var"):
        convert.resnet_from_torch(missing, module)

    misshapen = dict(state, **{"conv1.weight": np.zeros((64, 3, 5, 5), np.float32)})
    with pytest.raises(ValueError, match=r"conv1\.weight"):
        convert.resnet_from_torch(misshapen, module)

    # The same strictness through a transformers checkpoint directory.
    config = transformers.DetrConfig(
        use_timm_backbone=True, backbone="resnet18", use_pretrained_backbone=False, **_TINY
    )
    transformers.DetrForObjectDetection(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.decoder.layernorm.bias"]
    weights["model.decoder.extra.weight"] = np.zeros(3, np.float32)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.decoder\.extra\.weight.*decoder/layernorm/bias"):
        convert.detr_from_hf(tmp_path)
