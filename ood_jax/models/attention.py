"""Softmax dot-product attention whose backward pass recomputes the attention weights.

The forward pass keeps only each row's max and sum, and the backward pass recomputes the weights
from q and k and takes the softmax's gradient in closed form (FlashAttention's backward,
unchunked). Outputs are the plain formula's operations in the same order, so they do not change.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Masked logits get float32's minimum rather than -inf: its exp is exactly 0 next to any real
# key, but a row with no allowed key is uniform instead of NaN, so an all-padding filler example
# cannot poison the loss. As with `jnp.where`, masked logits get no gradient.
_MASKED = float(jnp.finfo(jnp.float32).min)


def combined_mask(key_mask: jax.Array | None, attention_mask: jax.Array | None) -> jax.Array | None:
    """One boolean mask broadcastable to [B, heads, Q, K] (True = may attend) from a key
    padding mask [B, K] and an attention mask [Q, K] or [B, Q, K]; None if neither."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if attention_mask is not None:
        if attention_mask.ndim == 2:
            attention_mask = attention_mask[None]
        mask = attention_mask[:, None] if mask is None else mask & attention_mask[:, None]
    return mask


def attention_logits(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Scaled, masked float32 logits [B, heads, Q, K] of q [B, Q, heads, D], k [B, K, heads, D]."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = logits * q.shape[-1] ** -0.5
    return logits if mask is None else jnp.where(mask, logits, _MASKED)


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """softmax over keys of `attention_logits`, float32; for paths that need the weights
    themselves (dropout on them)."""
    return jax.nn.softmax(attention_logits(q, k, mask), axis=-1)


def weighted_values(weights: jax.Array, v: jax.Array) -> jax.Array:
    """[B, Q, heads, D]: weights [B, heads, Q, K] (cast to v's dtype) times v [B, K, heads, D]."""
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)


@jax.custom_vjp
def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """softmax(q k^T / sqrt(D), masked) v: q [B, Q, heads, D], k and v [B, K, heads, D], `mask`
    boolean broadcastable to [B, heads, Q, K] (`combined_mask`) -> [B, Q, heads, D] in v's dtype.
    Equal to `weighted_values(attention_weights(q, k, mask), v)`, with a backward pass that
    recomputes the weights instead of keeping them."""
    return _forward(q, k, v, mask)[0]


def _forward(q, k, v, mask):
    logits = attention_logits(q, k, mask)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    unnormalized = jnp.exp(logits - row_max)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    out = weighted_values(unnormalized / total, v)
    return out, (q, k, v, mask, out, row_max, total)


# Autodiff through softmax(q k^T) v keeps the [B, heads, Q, K] weights and differentiates the
# softmax's normalization as a division, which XLA:CPU runs as a chain of passes over that
# tensor. DINO's decoder self-attention has ~1000 queries (900 + denoising groups): 64 MB of
# weights per layer at batch 2, whose backward took a quarter of the CPU train step. Here the
# gradient is p * (dp - rowsum(g * out)), from weights recomputed out of q, k and the row stats.
def _backward(residuals: tuple[Any, ...], grad_out: jax.Array):
    q, k, v, mask, out, row_max, total = residuals
    weights = jnp.exp(attention_logits(q, k, mask) - row_max) / total
    grad_v = jnp.einsum(
        "bhqk,bqhd->bkhd", weights.astype(v.dtype), grad_out, preferred_element_type=jnp.float32
    )
    grad_weights = jnp.einsum("bqhd,bkhd->bhqk", grad_out, v, preferred_element_type=jnp.float32)
    # sum_k p_k * dp_k = grad_out . out: a [B, Q, heads] reduction instead of one over K.
    row_dot = jnp.einsum("bqhd,bqhd->bhq", grad_out.astype(jnp.float32), out.astype(jnp.float32))
    row_dot = row_dot[..., None]
    grad_logits = weights * (grad_weights - row_dot)
    if mask is not None:
        grad_logits = jnp.where(mask, grad_logits, 0.0)
    grad_logits = (grad_logits * q.shape[-1] ** -0.5).astype(q.dtype)
    grad_q = jnp.einsum("bhqk,bkhd->bqhd", grad_logits, k, preferred_element_type=jnp.float32)
    grad_k = jnp.einsum("bhqk,bqhd->bkhd", grad_logits, q, preferred_element_type=jnp.float32)
    return (
        grad_q.astype(q.dtype),
        grad_k.astype(k.dtype),
        grad_v.astype(v.dtype),
        None,
    )


dot_product_attention.defvjp(_forward, _backward)
