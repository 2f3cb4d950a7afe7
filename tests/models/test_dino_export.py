"""DINO -> IDEA-Research/DINO's checkpoint layout (`ood_jax.models.dino_export`).

* random variables of a small R50 DINO (every leaf drawn, so a mis-mapped tensor cannot hide),
  4-scale with per-layer heads and 5-scale with shared ones, go out and come back through
  `convert_deformable.dino_from_official` bitwise, as the same module;
* the default DINO-4scale R50 gives exactly the keys and shapes of test_dino_model's official
  state dict (no num_batches_tracked: IDEA's FrozenBatchNorm2d has none);
* checkpoint.pth loads strictly into a PyTorch module tree built as IDEA's DINO builds its own
  (torchvision's ResNet under IntermediateLayerGetter, the official layers of
  test_dino_model, tied head ModuleLists) from dino_args.json, and back through
  `convert_deformable.load_official_dino`;
* what IDEA's DINO cannot express is refused with one line naming the field, and a directory
  that is no export is left alone.
"""

import copy
import dataclasses
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

import jax  # noqa: E402
from flax import traverse_util  # noqa: E402
from test_dino_model import (  # noqa: E402
    _OfficialDecoderLayer,
    _OfficialEncoderLayer,
    _official_state,
)
from torchvision.models._utils import IntermediateLayerGetter  # noqa: E402

from ood_jax.models import convert_deformable, convert_torch, dino, dino_export  # noqa: E402

# IDEA's decoder runs at width 256 only; the rest is small.
SMALL = dict(
    num_classes=5,
    num_queries=12,
    hidden_dim=256,
    num_heads=4,
    num_encoder_layers=1,
    num_decoder_layers=2,
    ffn_dim=64,
    encoder_points=2,
    decoder_points=3,
    num_label_embeddings=7,
    backbone="resnet50",
)
FOUR_SCALE = dict(SMALL, shared_decoder_heads=False)
FIVE_SCALE = dict(
    SMALL, num_feature_levels=5, backbone_stages=("stage1", "stage2", "stage3", "stage4")
)


def _random_variables(module) -> dict:
    rng = np.random.default_rng(0)
    abstract = convert_torch.abstract_variables(module)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), abstract)


def _assert_bitwise_equal(got, expected) -> None:
    got, expected = traverse_util.flatten_dict(got), traverse_util.flatten_dict(expected)
    assert set(got) == set(expected), set(got) ^ set(expected)
    for path, value in expected.items():
        assert got[path].dtype == value.dtype, path
        assert np.array_equal(np.asarray(got[path]), value), path


def _fields(module) -> dict:
    return {
        f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.name != "parent"
    }


@pytest.mark.slow
@pytest.mark.parametrize("args", [FOUR_SCALE, FIVE_SCALE], ids=["4scale_unshared", "5scale"])
def test_state_dict_imports_back_bitwise(args) -> None:
    module = dino.DINO(**args)
    variables = _random_variables(module)
    state = dino_export.official_state_dict(module, variables)
    layers = module.num_decoder_layers
    assert state["transformer.level_embed"].shape == (module.num_feature_levels, 256)
    assert state["transformer.decoder.layers.1.self_attn.in_proj_weight"].shape == (768, 256)
    for i in range(layers):
        for prefix in ("", "transformer.decoder."):
            assert f"{prefix}class_embed.{i}.weight" in state
            assert f"{prefix}bbox_embed.{i}.layers.2.bias" in state
    same = np.array_equal(state["class_embed.0.weight"], state["class_embed.1.weight"])
    assert same == module.shared_decoder_heads

    imported, back = convert_deformable.dino_from_official(
        state,
        num_heads=module.num_heads,
        encoder_points=module.encoder_points,
        decoder_points=module.decoder_points,
    )
    assert _fields(imported) == _fields(module)
    _assert_bitwise_equal(back, variables)


@pytest.mark.slow
def test_default_dino_4scale_has_the_official_keys_and_shapes() -> None:
    module = dino.DINO()
    # Values do not matter here: zeros cost no drawing and no memory until copied.
    abstract = convert_torch.abstract_variables(module, 960)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
    ours = {k: v.shape for k, v in dino_export.official_state_dict(module, zeros).items()}
    assert ours == {k: v.shape for k, v in _official_state().items()}


class _MLP(torch.nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:]))


class _IdeaDINO(torch.nn.Module):
    """The parameter tree of IDEA's DINO (models/dino/dino.py, deformable_transformer.py,
    backbone.py) for a ResNet and DINO-4scale's settings, built from its config fields."""

    def __init__(self, a: dict):
        super().__init__()
        dim, levels, nn = a["hidden_dim"], a["num_feature_levels"], torch.nn
        config = transformers.DeformableDetrConfig(
            d_model=dim, num_feature_levels=levels, use_timm_backbone=False
        )
        resnet = getattr(torchvision.models, a["backbone"])(
            norm_layer=torchvision.ops.FrozenBatchNorm2d
        )
        indices = a["return_interm_indices"]
        body = IntermediateLayerGetter(resnet, {f"layer{i + 1}": str(i) for i in indices})
        self.backbone = nn.ModuleList([nn.Module()])  # Joiner(backbone, position embedding)
        self.backbone[0].body = body
        channels = [256, 512, 1024, 2048][4 - len(indices) :]
        proj = [nn.Sequential(nn.Conv2d(c, dim, 1), nn.GroupNorm(32, dim)) for c in channels]
        for i in range(levels - len(channels)):
            source = channels[-1] if i == 0 else dim
            proj.append(nn.Sequential(nn.Conv2d(source, dim, 3, 2, 1), nn.GroupNorm(32, dim)))
        self.input_proj = nn.ModuleList(proj)

        t = self.transformer = nn.Module()
        t.level_embed = nn.Parameter(torch.zeros(levels, dim))
        t.encoder, t.decoder = nn.Module(), nn.Module()
        heads, ffn = a["nheads"], a["dim_feedforward"]
        t.encoder.layers = nn.ModuleList(
            _OfficialEncoderLayer(config, dim, heads, a["enc_n_points"], ffn)
            for _ in range(a["enc_layers"])
        )
        t.decoder.layers = nn.ModuleList(
            _OfficialDecoderLayer(config, dim, heads, a["dec_n_points"], ffn)
            for _ in range(a["dec_layers"])
        )
        t.decoder.norm = nn.LayerNorm(dim)
        t.decoder.ref_point_head = _MLP([2 * dim, dim, dim])
        t.tgt_embed = nn.Embedding(a["num_queries"], dim)
        t.enc_output, t.enc_output_norm = nn.Linear(dim, dim), nn.LayerNorm(dim)
        assert not a["two_stage_class_embed_share"] and not a["two_stage_bbox_embed_share"]
        t.enc_out_class_embed = nn.Linear(dim, a["num_classes"])
        t.enc_out_bbox_embed = _MLP([dim, dim, dim, 4])
        self.label_enc = nn.Embedding(a["dn_labelbook_size"] + 1, dim)

        def head_list(head, shared):
            return nn.ModuleList(
                head if shared else copy.deepcopy(head) for _ in range(a["dec_layers"])
            )

        self.class_embed = head_list(
            nn.Linear(dim, a["num_classes"]), a["dec_pred_class_embed_share"]
        )
        self.bbox_embed = head_list(_MLP([dim, dim, dim, 4]), a["dec_pred_bbox_embed_share"])
        t.decoder.class_embed, t.decoder.bbox_embed = self.class_embed, self.bbox_embed


@pytest.mark.slow
def test_checkpoint_loads_strictly_into_idea_modules_and_back(tmp_path) -> None:
    module = dino.DINO(**FOUR_SCALE)
    variables = _random_variables(module)
    out = dino_export.write_official_dino(
        tmp_path / "dino", FOUR_SCALE, variables, extra_files={"MODEL_CARD.md": "# card\n"}
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "MODEL_CARD.md",
        dino_export.CHECKPOINT_FILE,
        dino_export.ARGS_FILE,
    ]
    args = json.loads((out / dino_export.ARGS_FILE).read_text())
    assert args == dino_export.idea_config(module)
    assert (args["dn_labelbook_size"], args["dec_pred_class_embed_share"]) == (6, False)

    checkpoint = torch.load(out / dino_export.CHECKPOINT_FILE, weights_only=True)
    assert list(checkpoint) == ["model"]
    idea = _IdeaDINO(args)
    # Strict: every name IDEA's modules have, and nothing else, with its shape.
    idea.load_state_dict(checkpoint["model"], strict=True)
    assert set(idea.state_dict()) == set(checkpoint["model"])
    # A head's two names share one storage in the file, as torch saves IDEA's tied modules.
    tied = [checkpoint["model"][f"{p}class_embed.1.weight"] for p in ("", "transformer.decoder.")]
    assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    np.testing.assert_array_equal(
        idea.transformer.decoder.class_embed[1].weight.detach().numpy(),
        np.asarray(variables["params"]["class_embed_1"]["kernel"]).T,
    )

    imported, back = convert_deformable.load_official_dino(
        out / dino_export.CHECKPOINT_FILE,
        num_heads=args["nheads"],
        encoder_points=args["enc_n_points"],
        decoder_points=args["dec_n_points"],
    )
    assert _fields(imported) == _fields(module)
    _assert_bitwise_equal(back, variables)


@pytest.mark.parametrize(
    "field, value",
    [
        ("backbone", "S/16"),
        ("backbone", "resnet18"),
        ("backbone_stages", ("stage3", "stage4")),
        ("num_feature_levels", 1),
    ],
)
def test_what_idea_cannot_express_is_refused_in_one_line(tmp_path, field, value) -> None:
    args = dict(FOUR_SCALE, **{field: value})
    if field == "num_feature_levels":
        args["backbone_stages"] = ("stage4",)
    with pytest.raises(ValueError, match=f"config.model.args.{field}=") as raised:
        dino_export.write_official_dino(tmp_path / "out", args, variables={})
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_small_width_is_refused() -> None:
    with pytest.raises(ValueError, match=r"config\.model\.args\.hidden_dim=32: .*d_model 256"):
        dino_export.official_state_dict(dino.DINO(**dict(SMALL, hidden_dim=32)), {})


def test_a_directory_that_is_no_export_is_left_alone(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="no DINO export"):
        dino_export.write_official_dino(tmp_path, FOUR_SCALE, variables={})
    assert (tmp_path / "notes.txt").read_text() == "keep"


def test_missing_torch_is_one_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="needs PyTorch"):
        dino_export.write_official_dino(tmp_path / "out", FOUR_SCALE, variables={})
