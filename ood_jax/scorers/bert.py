"""BERT (Devlin et al. 2019) as the text tower of a two-tower model, as LiT's BERT towers run it.

LiT-B16B, LiT-B16B_2 and LiT-L16L (Zhai et al. 2022) embed text with flaxformer's `BertEncoder`,
wrapped by vit_jax's `models_lit.BertModel` and big_vision's `proj/flaxformer/bert.Model`. At
inference that is word + position + segment embeddings, post-norm layers, tanh GELU, zero
padding masked, and the [CLS] state without BERT's pooler (docs/guide/scorer-models.md).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ood_jax.models import vit

LN_EPS = 1e-12  # flaxformer's BertBaseConfig / BertLargeConfig layer_norm_epsilon
ACTIVATION = "gelu_tanh"  # flaxformer's make_mlp_block: flax.linen.gelu (approximate=True)


class BertLayer(nn.Module):
    """One post-norm BERT layer over [B, L, width], under a [B, 1, L, L] mask (True = attend)."""

    num_heads: int
    mlp_dim: int
    ln_eps: float = LN_EPS
    activation: str = ACTIVATION
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        norm = functools.partial(nn.LayerNorm, epsilon=self.ln_eps, dtype=self.dtype)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dtype=self.dtype, attention_fn=vit.attention, name="attention"
        )(x, mask=mask)
        x = norm(name="attention_norm")(x + y)
        y = vit.MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name="ffn")(x)
        return norm(name="ffn_norm")(x + y)


class BertEncoder(nn.Module):
    """[B, L] token ids (+ optional [B, L] mask, nonzero = a token) -> [B, L, width] states.

    Without a mask, tokens equal to `pad_token_id` are padding (LiT's rule).

    Attributes:
      vocab_size, num_positions, num_segments: word, position and segment table sizes; L must be
        <= num_positions.
      width, depth, num_heads, mlp_dim, ln_eps, activation: the layers (`vit.ACTIVATIONS` keys).
      pad_token_id: the id that marks padding when no mask is given.
      dtype: computation dtype; parameters stay float32.
    """

    vocab_size: int
    num_positions: int
    num_segments: int
    width: int
    depth: int
    num_heads: int
    mlp_dim: int
    ln_eps: float = LN_EPS
    activation: str = ACTIVATION
    pad_token_id: int = 0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        length = input_ids.shape[-1]
        if length > self.num_positions:
            raise ValueError(
                f"text length {length} exceeds the {self.num_positions} position embeddings"
            )
        embed = functools.partial(nn.Embed, features=self.width, dtype=self.dtype)
        x = embed(self.vocab_size, name="word_embeddings")(input_ids)
        x = x + embed(self.num_positions, name="position_embeddings")(jnp.arange(length))
        # Every segment id is 0: both LiT wrappers pass `segment_ids=zeros`.
        x = x + embed(self.num_segments, name="segment_embeddings")(jnp.zeros_like(input_ids))
        x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="embed_norm")(x)

        valid = input_ids != self.pad_token_id if attention_mask is None else attention_mask != 0
        # Padding hides keys only, as in transformers' BertModel; flaxformer masks a pair when
        # either is padding. They differ only in the states at padding positions, which no real
        # position attends to, so the [CLS] state is the same and every state is transformers'.
        mask = valid[:, None, None, :]
        for i in range(self.depth):
            x = BertLayer(
                self.num_heads,
                self.mlp_dim,
                ln_eps=self.ln_eps,
                activation=self.activation,
                dtype=self.dtype,
                name=f"layer_{i}",
            )(x, mask)
        return x


class BertTextTower(nn.Module):
    """[B, L] token ids (+ optional mask) -> [B, proj_dim]: the [CLS] state, projected.

    No BERT pooler (Dense + tanh): the LiT wrappers take `x[:, 0]`, and big_vision's `load`
    drops the pooler weights of the BERT checkpoint it starts from.

    A text tower for `clip.CLIP` (its `text`), beside `towers.TextTower`.

    Attributes:
      encoder: the `BertEncoder`; its parameters live under "encoder".
      max_len: tokens per text the model was trained with, what `CLIP.text_length` reports and
        a tokenizer pads to (LiT's 16), fewer than the encoder's position embeddings (512).
      proj_dim, proj_bias: the output projection ("proj"); None for no projection.
    """

    encoder: BertEncoder
    max_len: int
    proj_dim: int | None = None
    proj_bias: bool = True

    @property
    def vocab_size(self) -> int:
        return self.encoder.vocab_size

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        x = self.encoder(input_ids, attention_mask)[:, 0]
        if self.proj_dim is not None:
            x = nn.Dense(
                self.proj_dim, use_bias=self.proj_bias, dtype=self.encoder.dtype, name="proj"
            )(x)
        return x
