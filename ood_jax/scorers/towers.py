"""The two towers of a CLIP-style model: a ViT image encoder and a transformer text encoder.

Both end in one pooled vector per example, optionally projected into the shared embedding space:
`ImageTower` is `ood_jax.models.vit.ViT` with a pooled output (the class token, CLIP, or the
attention-pooling head, SigLIP); `TextTower` runs pre-norm blocks under a causal (CLIP) or
bidirectional (SigLIP) mask and pools one token's state as transformers' `CLIPTextModel` /
`SiglipTextModel` (5.x) do (`pooled_positions`).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ood_jax.models import vit

TEXT_MASKS = ("causal", "bidirectional")
TEXT_POOLS = ("argmax", "eos", "last")


class ImageTower(nn.Module):
    """[B, H, W, 3] normalized pixels -> [B, proj_dim] (or [B, width] without projection).

    Attributes:
      encoder: a `vit.ViT` with `pool_type` set.
      proj_dim: output width of the linear projection ("proj"); None for no projection.
      proj_bias: whether the projection has a bias.
    """

    encoder: vit.ViT
    proj_dim: int | None = None
    proj_bias: bool = False

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        if self.encoder.pool_type is None:
            raise ValueError("ImageTower needs an encoder with a pool_type")
        x = self.encoder(images, train=False)["pooled"]
        if self.proj_dim is not None:
            x = nn.Dense(
                self.proj_dim, use_bias=self.proj_bias, dtype=self.encoder.dtype, name="proj"
            )(x)
        return x


def text_attention_mask(valid: jax.Array, causal: bool) -> jax.Array:
    """[B, L] key validity -> boolean [B, 1, L, L] (True = attend), causal if asked."""
    length = valid.shape[-1]
    mask = jnp.broadcast_to(
        valid[:, None, None, :].astype(bool), (*valid.shape[:1], 1, length, length)
    )
    if causal:
        mask = mask & jnp.tril(jnp.ones((length, length), bool))
    return mask


def pooled_positions(input_ids: jax.Array, pool: str, eos_token_id: int | None) -> jax.Array:
    """[B, L] token ids -> [B] index of the token whose state is pooled.

    `pool` is "argmax": the first position of the largest token id (OpenAI CLIP, whose
    end-of-text token is the largest id; transformers uses it when the config's eos_token_id is
    the legacy 2); "eos": the first position equal to `eos_token_id` (position 0 when there is
    none); or "last": the last position of the padded sequence (SigLIP, trained with sticky end
    tokens).
    """
    if pool == "argmax":
        return jnp.argmax(input_ids, axis=-1)
    if pool == "eos":
        return jnp.argmax((input_ids == eos_token_id).astype(jnp.int32), axis=-1)
    if pool == "last":
        return jnp.full(input_ids.shape[:1], input_ids.shape[-1] - 1)
    raise ValueError(f"unknown text pool {pool!r}; known: {TEXT_POOLS}")


def encoder_blocks(module: nn.Module, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """`module.depth` pre-norm `vit.EncoderBlock`s at inference, "block_{i}" in `module`'s scope.

    Called from the compact `__call__` of `module` (a `TextTower` or a `groupvit.Stage`), whose
    num_heads, mlp_dim, ln_eps, activation and dtype fields it reads.
    """
    for i in range(module.depth):
        x = vit.EncoderBlock(
            module.num_heads,
            module.mlp_dim,
            dtype=module.dtype,
            ln_eps=module.ln_eps,
            activation=module.activation,
            name=f"block_{i}",
        )(x, train=False, mask=mask)
    return x


class TextTower(nn.Module):
    """[B, L] int token ids (+ optional [B, L] attention mask) -> [B, proj_dim or width].

    Attributes:
      vocab_size, max_len: token and position table sizes; L must be <= max_len.
      width, depth, num_heads, mlp_dim, ln_eps, activation: the transformer (see `vit`).
      mask: "causal" or "bidirectional" self-attention.
      pool: "argmax", "eos" or "last" (`pooled_positions`); `eos_token_id` is needed for "eos".
      proj_dim, proj_bias: the output projection ("proj"); None for no projection.
      dtype: computation dtype; parameters stay float32.
    """

    vocab_size: int
    max_len: int
    width: int
    depth: int
    num_heads: int
    mlp_dim: int
    ln_eps: float = 1e-5
    activation: str = "quick_gelu"
    mask: str = "causal"
    pool: str = "eos"
    eos_token_id: int | None = None
    proj_dim: int | None = None
    proj_bias: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        if self.mask not in TEXT_MASKS:
            raise ValueError(f"unknown text mask {self.mask!r}; known: {TEXT_MASKS}")
        if self.pool == "eos" and self.eos_token_id is None:
            raise ValueError('text pool "eos" needs eos_token_id')
        length = input_ids.shape[-1]
        if length > self.max_len:
            raise ValueError(f"text length {length} exceeds the {self.max_len} position embeddings")

        x = nn.Embed(self.vocab_size, self.width, dtype=self.dtype, name="token_embedding")(
            input_ids
        )
        pos = self.param(
            "pos_embedding", nn.initializers.normal(stddev=0.01), (self.max_len, self.width)
        )
        x = x + pos[:length].astype(x.dtype)

        valid = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask != 0
        mask = text_attention_mask(valid, causal=self.mask == "causal")
        x = encoder_blocks(self, x, mask)
        x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm")(x)

        index = pooled_positions(input_ids, self.pool, self.eos_token_id)
        x = jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]
        if self.proj_dim is not None:
            x = nn.Dense(self.proj_dim, use_bias=self.proj_bias, dtype=self.dtype, name="proj")(x)
        return x
