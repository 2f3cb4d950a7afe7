"""Max pooling whose gradient XLA:CPU runs fast, for the ResNet stem.

XLA differentiates `lax.reduce_window` max by a windowed reduction over (value, index) pairs,
which XLA:CPU runs slowly (178 ms for a [32, 64, 64, 64] input, 54 ms here). On CPU the
gradient here goes to the first maximum of each window in row-major order, as PyTorch's
`max_pool2d` routes it, by one strided view per window offset; other platforms, and the
forward pass everywhere, keep XLA's own rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _pool(x: jax.Array, window: int, stride: int, pad: int) -> jax.Array:
    return lax.reduce_window(
        x,
        -jnp.inf,
        lax.max,
        (1, window, window, 1),
        (1, stride, stride, 1),
        ((0, 0), (pad, pad), (pad, pad), (0, 0)),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def max_pool(x: jax.Array, window: int, stride: int, pad: int) -> jax.Array:
    """[B, H, W, C] -> max over `window` x `window` windows every `stride` pixels, with `pad`
    pixels of -inf on each side (ResNet's stem: 3, 2, 1)."""
    return _pool(x, window, stride, pad)


def _max_pool_forward(x, window, stride, pad):
    y = _pool(x, window, stride, pad)
    return y, (x, y)


def _max_pool_backward(window, stride, pad, residuals, grad):
    x, y = residuals

    def xla_rule(x, grad):
        return jax.vjp(lambda x: _pool(x, window, stride, pad), x)[1](grad)[0]

    def strided_rule(x, grad):
        return first_maximum_gradient(x, y, grad, window, stride, pad)

    return (lax.platform_dependent(x, grad, cpu=strided_rule, default=xla_rule),)


def first_maximum_gradient(
    x: jax.Array, y: jax.Array, grad: jax.Array, window: int, stride: int, pad: int
) -> jax.Array:
    """d(sum(max_pool(x) * grad)) / dx with each window's gradient on its first maximum."""
    padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=-jnp.inf)
    _, out_h, out_w, _ = y.shape
    span_h, span_w = stride * (out_h - 1) + 1, stride * (out_w - 1) + 1
    taken = jnp.zeros(y.shape, bool)
    grad_padded = jnp.zeros(padded.shape, grad.dtype)
    for i in range(window):
        for j in range(window):
            view = padded[:, i : i + span_h : stride, j : j + span_w : stride]
            first = (view == y) & ~taken
            taken = taken | first
            # The window offset's share, spread back to its input pixels (zeros between them).
            grad_padded = grad_padded + lax.pad(
                jnp.where(first, grad, 0),
                jnp.zeros((), grad.dtype),
                (
                    (0, 0, 0),
                    (i, padded.shape[1] - i - span_h, stride - 1),
                    (j, padded.shape[2] - j - span_w, stride - 1),
                    (0, 0, 0),
                ),
            )
    return grad_padded[:, pad : pad + x.shape[1], pad : pad + x.shape[2]]


max_pool.defvjp(_max_pool_forward, _max_pool_backward)
