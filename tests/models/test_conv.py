"""ood_jax.models.conv against lax.conv_general_dilated, and ResNet's frozen stages."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from ood_jax.models import conv, resnet

LAYOUT = ("NHWC", "HWIO", "NHWC")


def _value_and_grads(fn, x, w, probe):
    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32) * probe)

    return fn(x, w), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel, stride, dilation, padding, size",
    [
        (1, 1, 1, ((0, 0), (0, 0)), (9, 7)),
        (1, 2, 1, ((0, 0), (0, 0)), (9, 8)),
        (1, 3, 1, ((1, 0), (0, 2)), (10, 8)),
        (3, 1, 1, ((1, 1), (1, 1)), (8, 8)),
        (3, 2, 1, ((1, 1), (1, 1)), (9, 11)),
        (3, 1, 2, ((2, 2), (2, 2)), (10, 9)),
        (3, 2, 2, ((2, 1), (0, 2)), (12, 10)),
        (7, 2, 1, ((3, 3), (3, 3)), (16, 13)),
        (2, 3, 1, ((0, 1), (1, 0)), (11, 9)),
    ],
)
def test_value_and_gradients_match_lax(kernel, stride, dilation, padding, size):
    rng = np.random.default_rng(kernel * 100 + stride * 10 + dilation)
    x = jnp.asarray(rng.standard_normal((2, *size, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((kernel, kernel, 5, 6)), jnp.float32)

    def ours(x, w):
        return conv.conv_general_dilated(
            x, w, (stride, stride), padding, rhs_dilation=(dilation,) * 2, dimension_numbers=LAYOUT
        )

    def reference(x, w):
        return lax.conv_general_dilated(
            x, w, (stride, stride), padding, rhs_dilation=(dilation,) * 2, dimension_numbers=LAYOUT
        )

    probe = jnp.asarray(rng.standard_normal(reference(x, w).shape), jnp.float32)
    y, (gx, gw) = _value_and_grads(ours, x, w, probe)
    y_ref, (gx_ref, gw_ref) = _value_and_grads(reference, x, w, probe)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernel", [1, 3])
def test_bfloat16_gradients_keep_the_dtype(kernel):
    rng = np.random.default_rng(kernel)
    x = jnp.asarray(rng.standard_normal((2, 8, 8, 4)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((kernel, kernel, 4, 8)), jnp.bfloat16)
    pad = ((kernel // 2, kernel // 2),) * 2
    probe = jnp.ones((2, 8, 8, 8), jnp.float32)
    _, (gx, gw) = _value_and_grads(
        lambda x, w: conv.conv_general_dilated(x, w, (1, 1), pad, dimension_numbers=LAYOUT),
        x,
        w,
        probe,
    )
    _, (gx_ref, gw_ref) = _value_and_grads(
        lambda x, w: lax.conv_general_dilated(
            x.astype(jnp.float32), w.astype(jnp.float32), (1, 1), pad, dimension_numbers=LAYOUT
        ),
        x,
        w,
        probe,
    )
    assert gx.dtype == gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(gx.astype(np.float32), gx_ref, rtol=2e-2, atol=0.1)
    np.testing.assert_allclose(gw.astype(np.float32), gw_ref, rtol=2e-2, atol=0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"feature_group_count": 2},
        {"lhs_dilation": (2, 2)},
        {"dimension_numbers": ("NCHW", "OIHW", "NCHW")},
    ],
)
def test_other_convolutions_fall_back_to_lax(kwargs):
    rng = np.random.default_rng(1)
    nchw = "dimension_numbers" in kwargs
    x = jnp.asarray(rng.standard_normal((2, 4, 6, 6) if nchw else (2, 6, 6, 4)), jnp.float32)
    w_in = 2 if "feature_group_count" in kwargs else 4
    w = jnp.asarray(rng.standard_normal((4, w_in, 3, 3) if nchw else (3, 3, w_in, 4)), jnp.float32)
    kwargs = {"dimension_numbers": LAYOUT, **kwargs}

    def loss(fn):
        return jax.grad(lambda w: jnp.sum(fn(x, w, (1, 1), ((1, 1), (1, 1)), **kwargs) ** 2))(w)

    np.testing.assert_allclose(
        loss(conv.conv_general_dilated), loss(lax.conv_general_dilated), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_resnet_gradients_match_lax_convolutions_frozen_stages_get_none_remat_the_same(
    monkeypatch,
):
    images = jnp.asarray(np.random.default_rng(2).standard_normal((2, 64, 64, 3)), jnp.float32)
    ours = resnet.build("resnet18", norm="frozen", dilation=True)
    variables = ours.init(jax.random.key(0), images)

    def grads(module):
        def loss(params):
            out = module.apply({**variables, "params": params}, images)
            return sum(jnp.mean(v**2) for v in out.values())

        return jax.jit(jax.grad(loss))(variables["params"])

    # The same network on lax's convolution: patch flax's Conv default for one build.
    class LaxConv(nn.Conv):
        def __post_init__(self):
            object.__setattr__(self, "conv_general_dilated", lax.conv_general_dilated)
            super().__post_init__()

    ours_grads = grads(ours)
    with monkeypatch.context() as patch:
        patch.setattr(resnet.nn, "Conv", LaxConv)
        reference = grads(resnet.build("resnet18", norm="frozen", dilation=True))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
        ours_grads,
        reference,
    )

    frozen = grads(ours.clone(frozen_stages=1))
    for name, tree in frozen.items():
        norm = sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(tree))
        if name.startswith(("stem_", "stage1_")):
            assert norm == 0.0, name
        else:
            assert norm > 0.0, name

    # Recomputing the trained blocks in the backward pass changes no gradient.
    recomputed = grads(ours.clone(frozen_stages=1, remat=True))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), recomputed, frozen
    )


def test_frozen_stages_out_of_range_is_refused():
    with pytest.raises(ValueError, match="frozen_stages"):
        resnet.build("resnet18", frozen_stages=5).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
