"""A drop-in `conv_general_dilated` for `flax.linen.Conv` whose gradients XLA:CPU runs fast.

On CPU the kernel gradient is one matrix product of im2col patches with the output gradient,
and a 1x1 convolution's input gradient a matrix product that reads the kernel in place; every
other platform, and the forward pass everywhere, keep XLA's own rules.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_LAYOUT = ("NHWC", "HWIO", "NHWC")


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: Any,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    precision: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """`lax.conv_general_dilated`'s signature and result. Only 2-D NHWC/HWIO convolutions
    without input dilation or feature groups take the fast-gradient path; everything else goes
    to `lax.conv_general_dilated` unchanged."""
    fallback = functools.partial(
        lax.conv_general_dilated,
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        precision=precision,
        **kwargs,
    )
    if (
        lhs.ndim != 4
        or kwargs
        or precision is not None
        or feature_group_count != 1
        or isinstance(padding, str)
        or any(d != 1 for d in (lhs_dilation or ()))
        or lhs.dtype != rhs.dtype
        or lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        != lax.conv_dimension_numbers(lhs.shape, rhs.shape, _LAYOUT)
    ):
        return fallback()
    return _conv(
        lhs,
        rhs,
        tuple(int(s) for s in window_strides),
        tuple((int(lo), int(hi)) for lo, hi in padding),
        tuple(int(d) for d in (rhs_dilation or (1, 1))),
    )


def _lax_conv(x, w, strides, padding, dilation):
    return lax.conv_general_dilated(
        x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=_LAYOUT
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _conv(x, w, strides, padding, dilation):
    return _lax_conv(x, w, strides, padding, dilation)


def _conv_fwd(x, w, strides, padding, dilation):
    return _lax_conv(x, w, strides, padding, dilation), (x, w)


# XLA differentiates a convolution w.r.t. its kernel by a convolution whose window is the whole
# output map, which XLA:CPU runs 5-10x slower than the forward pass (a 1x1 convolution over an
# 80x80 map: 40 ms against 4 ms); a ResNet-50's backward pass cost six forward passes. For a 1x1
# kernel, XLA's input-gradient rule also first copies the kernel transposed.
def _conv_bwd(strides, padding, dilation, residuals, grad_out):
    x, w = residuals

    def xla_input_rule(w, grad_out):
        return jax.vjp(lambda x: _lax_conv(x, w, strides, padding, dilation), x)[1](grad_out)[0]

    def matmul_input_rule(w, grad_out):
        return pointwise_input_gradient(w, grad_out, x.shape, strides, padding)

    def xla_kernel_rule(x, grad_out):
        return jax.vjp(lambda w: _lax_conv(x, w, strides, padding, dilation), w)[1](grad_out)[0]

    def im2col_kernel_rule(x, grad_out):
        return kernel_gradient(x, grad_out, w.shape, strides, padding, dilation)

    if w.shape[:2] == (1, 1):
        grad_x = lax.platform_dependent(w, grad_out, cpu=matmul_input_rule, default=xla_input_rule)
    else:
        grad_x = xla_input_rule(w, grad_out)
    grad_w = lax.platform_dependent(x, grad_out, cpu=im2col_kernel_rule, default=xla_kernel_rule)
    return grad_x, grad_w


_conv.defvjp(_conv_fwd, _conv_bwd)


def kernel_gradient(
    x: jax.Array,
    grad_out: jax.Array,
    kernel_shape: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    dilation: Sequence[int],
) -> jax.Array:
    """d(sum(conv(x, w) * grad_out)) / dw as one matmul: patches [N, kh*kw*C] x grad [N, O]."""
    kh, kw, channels, features = kernel_shape
    (sh, sw), (dh, dw) = strides, dilation
    out_h, out_w = grad_out.shape[1:3]
    padded = jnp.pad(x, ((0, 0), *padding, (0, 0)))
    patches = [
        lax.slice(
            padded,
            (0, i * dh, j * dw, 0),
            (x.shape[0], i * dh + sh * (out_h - 1) + 1, j * dw + sw * (out_w - 1) + 1, channels),
            (1, sh, sw, 1),
        )
        for i in range(kh)
        for j in range(kw)
    ]
    patches = jnp.concatenate(patches, axis=-1) if len(patches) > 1 else patches[0]
    # As matrices, [pixels, K] and [pixels, O]: XLA:CPU contracts their major dimension in place.
    # Contracting (b, h, w) of the 4-D arrays instead makes it copy one of them transposed, with
    # every elementwise op that produced it (a whole residual chain) fused into the copy.
    grad = jnp.einsum(
        "pk,po->ko",
        patches.reshape(-1, patches.shape[-1]),
        grad_out.reshape(-1, features),
        preferred_element_type=jnp.float32,
    )
    return grad.reshape(kh, kw, channels, features).astype(x.dtype)


def pointwise_input_gradient(
    kernel: jax.Array,
    grad_out: jax.Array,
    input_shape: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
) -> jax.Array:
    """d(sum(conv(x, w) * grad_out)) / dx for a 1x1 kernel: grad [N, O] x kernel [C, O]^T.

    XLA's rule is a convolution with the kernel transposed, and XLA:CPU copies that transposed
    kernel (8 MB for ResNet's 1024->2048 projection) at a few GB/s on every step; the matmul
    reads the kernel as it is. Output pixel i of a stride-s convolution read input pixel
    i * s - pad_low, so the product is spread back with interior padding, and cropped or padded
    at the edges to the input's size.
    """
    channels, features = kernel.shape[2:]
    grad = jnp.einsum(
        "po,ko->pk",
        grad_out.reshape(-1, features),
        kernel.reshape(channels, features),
        preferred_element_type=jnp.float32,
    ).astype(grad_out.dtype)
    grad = grad.reshape(*grad_out.shape[:3], channels)
    edges = [(0, 0, 0)]
    for size, out_size, stride, (low, _) in zip(
        input_shape[1:3], grad_out.shape[1:3], strides, padding
    ):
        high = size - ((out_size - 1) * stride + 1 - low)
        edges.append((-low, high, stride - 1))
    return lax.pad(grad, jnp.zeros((), grad.dtype), (*edges, (0, 0, 0)))
