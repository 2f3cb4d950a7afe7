"""ViT backbone and converter against timm's VisionTransformer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from ood_jax.models import vit as vit_lib
from ood_jax.models.convert_vit import vit_from_timm


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    # timm starts biases at 0 and LayerNorms at identity; perturbing every tensor makes the parity
    # test see a transposed or misplaced one.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def timm_tiny() -> torch.nn.Module:
    return perturbed(
        timm.create_model("vit_tiny_patch16_224", pretrained=False, dynamic_img_size=True)
    )


def small_timm(**kwargs) -> VisionTransformer:
    defaults = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=3)
    return perturbed(VisionTransformer(**{**defaults, **kwargs}))


@pytest.mark.slow
@pytest.mark.parametrize("height,width", [(224, 224), (256, 320)])
def test_parity_with_timm(timm_tiny: torch.nn.Module, height: int, width: int) -> None:
    module, variables = vit_from_timm(timm_tiny.state_dict())
    assert module == vit_lib.vit("Ti/16")
    images = np.random.default_rng(0).normal(size=(2, 3, height, width)).astype(np.float32)
    with torch.no_grad():
        tokens = timm_tiny.forward_features(torch.from_numpy(images))[:, 1:].numpy()

    features = jax.jit(module.apply)(variables, images.transpose(0, 2, 3, 1))["features"]
    assert features.shape == (2, height // 16, width // 16, 192)
    np.testing.assert_allclose(features, tokens.reshape(features.shape), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", ["bicubic", "bilinear"])
@pytest.mark.parametrize("size", [(16, 20), (7, 9), (14, 14), (28, 10)])
def test_pos_embedding_resampling_matches_timm(method: str, size: tuple[int, int]) -> None:
    pos = np.random.default_rng(1).normal(size=(1, 1 + 14 * 14, 32)).astype(np.float32)
    expected = resample_abs_pos_embed(
        torch.from_numpy(pos), list(size), num_prefix_tokens=1, interpolation=method
    )[0, 1:].numpy()
    grid = vit_lib.resample_pos_embedding(jnp.asarray(pos[0, 1:]).reshape(14, 14, 32), size, method)
    np.testing.assert_allclose(grid.reshape(-1, 32), expected, atol=1e-5, rtol=0)


def test_without_class_token() -> None:
    ref = small_timm(class_token=False, global_pool="avg", fc_norm=False, dynamic_img_size=True)
    module, variables = vit_from_timm(ref.state_dict(), num_heads=2)
    assert not module.class_token
    images = np.random.default_rng(2).normal(size=(1, 3, 40, 24)).astype(np.float32)
    with torch.no_grad():
        tokens = ref.forward_features(torch.from_numpy(images)).numpy()
    features = jax.jit(module.apply)(variables, images.transpose(0, 2, 3, 1))["features"]
    np.testing.assert_allclose(features, tokens.reshape(features.shape), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "variant,timm_name",
    [
        ("Ti/16", "vit_tiny_patch16_224"),
        ("S/16", "vit_small_patch16_224"),
        ("B/16", "vit_base_patch16_224"),
    ],
)
def test_variant_sizes_match_timm(variant: str, timm_name: str) -> None:
    # weight_init="skip" leaves the tensors uninitialized: only their sizes are needed.
    ref = timm.create_model(timm_name, pretrained=False, num_classes=0, weight_init="skip")
    shapes = jax.eval_shape(
        vit_lib.vit(variant).init, jax.random.key(0), jnp.zeros((1, 224, 224, 3))
    )
    ours = sum(np.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert ours == sum(p.numel() for p in ref.parameters())


def test_drop_path_only_in_training() -> None:
    ref = small_timm()
    module, variables = vit_from_timm(ref.state_dict(), num_heads=2, drop_path_rate=0.5)
    images = np.random.default_rng(3).normal(size=(4, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        tokens = ref.forward_features(torch.from_numpy(images))[:, 1:].numpy()
    apply = jax.jit(module.apply, static_argnames="train")
    nhwc = images.transpose(0, 2, 3, 1)

    evaluated = apply(variables, nhwc)["features"]
    np.testing.assert_allclose(evaluated, tokens.reshape(evaluated.shape), atol=1e-5, rtol=0)
    trained = apply(variables, nhwc, train=True, rngs={"dropout": jax.random.key(0)})["features"]
    assert np.isfinite(trained).all() and not np.allclose(trained, evaluated)


def test_converter_strict_key_accounting() -> None:
    sd = small_timm().state_dict()
    assert "head.weight" in sd  # the classifier is dropped on purpose
    module, _ = vit_from_timm(sd, num_heads=2)
    assert (module.width, module.depth, module.mlp_dim, module.pos_grid) == (64, 2, 256, (4, 4))

    def fails(state_dict: dict, pattern: str) -> None:
        with pytest.raises(ValueError, match=pattern):
            vit_from_timm(state_dict, num_heads=2)

    fails(
        {**sd, "blocks.0.ls1.gamma": torch.ones(64)}, r"unused source key 'blocks\.0\.ls1\.gamma'"
    )
    fails({**sd, "reg_token": torch.ones(1, 4, 64)}, r"unused source key 'reg_token'")
    missing = {k: v for k, v in sd.items() if k != "blocks.1.norm2.bias"}
    fails(missing, r"unfilled target param 'block_1/norm2/bias'")
    fails({**sd, "blocks.0.mlp.fc2.bias": torch.zeros(65)}, r"'block_0/mlp/fc2/bias'.*shape")
    fails({**sd, "pos_embed": sd["pos_embed"][:, :-1]}, "not a square grid")
