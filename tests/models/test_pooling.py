"""The stem's max pool: XLA's forward pass, PyTorch's gradient (each window's first maximum)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ood_jax.models import pooling


@pytest.mark.parametrize("shape", [(2, 9, 12, 3), (1, 16, 16, 5)])
def test_max_pool_and_its_gradient_match_torch_ties_included(shape):
    rng = np.random.default_rng(0)
    # Half-integers: many windows hold their maximum twice, where the routing matters.
    x = np.round(rng.normal(size=shape) * 2) / 2
    x = x.astype(np.float32)
    y, vjp = jax.vjp(lambda x: pooling.max_pool(x, 3, 2, 1), jnp.asarray(x))
    grad = rng.normal(size=y.shape).astype(np.float32)
    (ours,) = vjp(jnp.asarray(grad))

    xt = torch.tensor(x).permute(0, 3, 1, 2).requires_grad_()
    yt = torch.nn.functional.max_pool2d(xt, 3, 2, 1)
    yt.backward(torch.tensor(grad).permute(0, 3, 1, 2))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().permute(0, 2, 3, 1).numpy())
    np.testing.assert_allclose(
        np.asarray(ours), xt.grad.permute(0, 2, 3, 1).numpy(), rtol=0, atol=1e-6
    )
    # The forward pass is flax's.
    flax_pool = nn.max_pool(jnp.asarray(x), (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(flax_pool))
    # XLA's own rule (what other platforms run) gives the same gradient.
    xla = jax.vjp(
        lambda x: nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1))), jnp.asarray(x)
    )[1](jnp.asarray(grad))[0]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=0, atol=1e-6)
    # And the input has windows whose maximum is there twice.
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
    tied = [
        (padded[b, 2 * i : 2 * i + 3, 2 * j : 2 * j + 3, c] == y[b, i, j, c]).sum() > 1
        for b, i, j, c in np.ndindex(*y.shape)
    ]
    assert sum(tied) > 10


def test_the_strided_gradient_is_cpus_alone():
    grad = jax.jit(jax.grad(lambda x: pooling.max_pool(x, 3, 2, 1).sum()))
    x = jax.ShapeDtypeStruct((1, 8, 8, 2), jnp.float32)

    def module(platforms):
        return jax.export.export(grad, platforms=platforms)(x).mlir_module()

    assert "select_and_scatter" in module(("cuda", "tpu"))
    assert "select_and_scatter" not in module(("cpu",))
