"""ood_jax.models.attention: the recomputing backward against PyTorch's attention and against
autodiff of the plain formula, with key padding, attention masks and rows with no allowed key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ood_jax.models import attention

B, Q, K, H, D = 2, 7, 9, 3, 8


def draw(seed: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Q, H, D))
    k, v = (rng.standard_normal((B, K, H, D)) for _ in range(2))
    grad = rng.standard_normal((B, Q, H, D))
    return [jnp.asarray(x, dtype) for x in (q, k, v, grad)]


def masks(seed: int, empty_row: bool):
    """A key padding mask [B, K] and a per-example attention mask [B, Q, K], every row with at
    least one allowed key unless `empty_row` (then query 2 of example 0 may attend to none)."""
    rng = np.random.default_rng(seed)
    key_mask = np.ones((B, K), bool)
    key_mask[1, -3:] = False
    attention_mask = rng.random((B, Q, K)) > 0.4
    attention_mask[..., 0] = True
    if empty_row:
        attention_mask[0, 2] = False
    return jnp.asarray(key_mask), jnp.asarray(attention_mask)


def plain(q, k, v, mask):
    return attention.weighted_values(attention.attention_weights(q, k, mask), v)


def gradients(fn, q, k, v, grad, mask):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
    return out, vjp(grad)


@pytest.mark.parametrize("masked", [False, True])
def test_outputs_and_gradients_match_torch(masked):
    q, k, v, grad = draw(0)
    key_mask, attention_mask = masks(1, empty_row=False)
    mask = attention.combined_mask(key_mask, attention_mask) if masked else None
    out, grads = gradients(jax.jit(attention.dot_product_attention), q, k, v, grad, mask)

    # torch takes [B, heads, L, D] and a boolean mask with True = may attend, as ours.
    tq, tk, tv = (torch.tensor(np.asarray(x)).transpose(1, 2).requires_grad_() for x in (q, k, v))
    torch_mask = None if mask is None else torch.tensor(np.asarray(mask))
    torch_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch_mask)
    torch_out.backward(torch.tensor(np.asarray(grad)).transpose(1, 2))
    np.testing.assert_allclose(out, torch_out.detach().transpose(1, 2).numpy(), atol=2e-6)
    for ours, theirs in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(ours, theirs.grad.transpose(1, 2).numpy(), atol=5e-6)


@pytest.mark.parametrize("empty_row", [False, True])
def test_equals_the_plain_formula_and_its_autodiff(empty_row):
    """Bit-equal outputs; gradients within float32 rounding. A row with no allowed key (torch
    gives NaN there) is uniform, and its masked logits get no gradient."""
    q, k, v, grad = draw(2)
    mask = attention.combined_mask(*masks(3, empty_row))
    out, grads = gradients(jax.jit(attention.dot_product_attention), q, k, v, grad, mask)
    want_out, want_grads = gradients(jax.jit(plain), q, k, v, grad, mask)
    np.testing.assert_array_equal(out, want_out)
    for ours, want in zip(grads, want_grads):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)
    if empty_row:
        np.testing.assert_allclose(out[0, 2], jnp.mean(v[0], axis=0), rtol=1e-6, atol=1e-7)
        # All its logits are masked: its query gets no gradient.
        np.testing.assert_array_equal(grads[0][0, 2], 0.0)
        assert np.all(np.isfinite(np.asarray(grads[0]))) and np.any(grads[0][0, 1] != 0)


def test_bfloat16_keeps_the_dtype_and_follows_float32():
    q, k, v, grad = draw(4)
    mask = attention.combined_mask(*masks(5, empty_row=False))
    out32, grads32 = gradients(attention.dot_product_attention, q, k, v, grad, mask)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v, grad)]
    out16, grads16 = gradients(attention.dot_product_attention, *low, mask)
    assert out16.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads16)
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, atol=0.05)
    for g16, g32 in zip(grads16, grads32):
        np.testing.assert_allclose(g16.astype(jnp.float32), g32, atol=0.1)


def test_combined_mask_is_both_masks():
    key_mask, attention_mask = masks(6, empty_row=True)
    mask = attention.combined_mask(key_mask, attention_mask)
    assert mask.shape == (B, 1, Q, K)
    np.testing.assert_array_equal(mask[:, 0], key_mask[:, None, :] & attention_mask)
    shared = attention.combined_mask(None, attention_mask[0])
    assert shared.shape == (1, 1, Q, K)
    assert attention.combined_mask(None, None) is None
