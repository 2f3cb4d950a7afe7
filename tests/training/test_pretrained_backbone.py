"""ImageNet backbone weights enter a fresh train state, sharded, and misfits fail by name."""

import jax
import ml_collections
import numpy as np
import pytest
import torch
import torchvision

from ood_jax.models import backbones, convert, registry
from ood_jax import sharding
from ood_jax.train import optim, pretrain, train


def _model_config(backbone_weights):
    config = ml_collections.ConfigDict()
    config.name = "detr"
    config.backbone_weights = str(backbone_weights)
    config.args = dict(
        num_classes=3,
        num_queries=4,
        hidden_dim=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        ffn_dim=32,
        backbone="resnet18",
        backbone_norm="frozen",
    )
    return config


def _state(model_config):
    model = registry.build_model(model_config)
    optim_config = ml_collections.ConfigDict(
        dict(
            lr=1e-4,
            backbone_lr=1e-5,
            backbone_pattern="backbone/.*",
            frozen_pattern=None,
            weight_decay=1e-4,
            clip_norm=0.1,
            b1=0.9,
            b2=0.999,
            decay_epochs=(),
            decay_factor=0.1,
        )
    )
    image_shape = (64, 64, 3)
    params = jax.eval_shape(
        lambda r: model.init(r, np.zeros((1, *image_shape), np.float32))["params"],
        jax.random.key(0),
    )
    optimizer, _ = optim.make_optimizer(optim_config, params, steps_per_epoch=10)
    # Compiled: op by op, the detector's initialization took 2.4 times as long (13.2 s, 5.6 s).
    init = jax.jit(train.create_train_state, static_argnums=(0, 1, 3))
    state = init(model, optimizer, jax.random.key(0), image_shape)
    mesh = sharding.make_mesh([("data", -1)])
    return state, sharding.tree_shardings(state, mesh, [(".*", "replicate")])


@pytest.mark.slow
def test_torchvision_weights_replace_the_backbone(tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    with torch.no_grad():
        for bn in (m for m in reference.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)
    model_config = _model_config(path)
    state, shardings = _state(model_config)

    loaded = train.load_pretrained_backbone(state, model_config.args, path, shardings)
    expected = convert.resnet_from_torch(
        {k: v.numpy() for k, v in reference.state_dict().items()},
        backbones.build_backbone("resnet18", "frozen"),
    )
    np.testing.assert_array_equal(
        loaded.params["backbone"]["stem_conv"]["kernel"],
        expected["params"]["stem_conv"]["kernel"],
    )
    np.testing.assert_array_equal(
        loaded.model_state["batch_stats"]["backbone"]["stem_norm"]["mean"],
        reference.bn1.running_mean.numpy(),
    )
    # The rest of the detector is untouched.
    np.testing.assert_array_equal(
        loaded.params["input_projection"]["kernel"], state.params["input_projection"]["kernel"]
    )


@pytest.mark.slow
def test_a_c4_detector_takes_a_whole_torchvision_checkpoint(tmp_path):
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)
    model_config = _model_config(path)
    model_config.args["backbone_last_stage"] = 3
    state, shardings = _state(model_config)

    loaded = train.load_pretrained_backbone(state, model_config.args, path, shardings)
    assert sorted(k for k in loaded.params["backbone"] if k.startswith("stage4")) == []
    np.testing.assert_array_equal(
        loaded.params["backbone"]["stage3_block1"]["conv2"]["kernel"],
        reference.layer3[1].conv2.weight.detach().numpy().transpose(2, 3, 1, 0),
    )


@pytest.mark.slow
def test_wrong_architecture_fails_naming_the_file(tmp_path):
    path = tmp_path / "resnet34.pth"
    torch.save(torchvision.models.resnet34().state_dict(), path)
    model_config = _model_config(path)
    state, shardings = _state(model_config)
    with pytest.raises((KeyError, ValueError), match="layer|resnet34|stage"):
        train.load_pretrained_backbone(state, model_config.args, path, shardings)


def test_dense_pretraining_targets_match_a_loop():
    rng = np.random.default_rng(3)
    batch, slots, grid, num_classes = 3, 5, (4, 6), 4
    centers = rng.uniform(0.0, 1.0, (batch, slots, 2))
    sizes = rng.uniform(0.01, 0.6, (batch, slots, 2))
    boxes = np.concatenate([centers, sizes], -1).astype(np.float32)
    labels = rng.integers(0, num_classes, (batch, slots)).astype(np.int32)
    box_mask = rng.random((batch, slots)) < 0.7
    got = np.asarray(pretrain.dense_targets(boxes, labels, box_mask, grid, num_classes))

    want = np.zeros((batch, *grid, num_classes), np.float32)
    height, width = grid
    for b, m in zip(*np.nonzero(box_mask)):
        cx, cy, w, h = boxes[b, m].astype(np.float64)
        for i in range(height):
            for j in range(width):
                centre_y, centre_x = (i + 0.5) / height, (j + 0.5) / width
                covers = abs(centre_x - cx) <= w / 2 and abs(centre_y - cy) <= h / 2
                centred = int(cy * height) == i and int(cx * width) == j
                if covers or centred:
                    want[b, i, j, labels[b, m]] = 1.0
    np.testing.assert_array_equal(got, want)
    assert 0 < want.sum() < want.size
