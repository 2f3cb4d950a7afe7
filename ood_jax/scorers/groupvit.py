"""GroupViT (Xu et al. 2022) as a two-tower Flax module, at inference, after transformers'
`GroupViTModel` (5.x).

The image tower groups patch tokens into segment tokens stage by stage, each image token
assigned to exactly one group (transformers' hard assignment, what its Gumbel assignment is
outside training); the image features are the mean of the final segment tokens. The text tower
is CLIP's. Both go through an MLP projection and are scored as CLIP: `exp(t) * cos`.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ood_jax.models import resnet, vit
from ood_jax.scorers import clip, towers


def hard_softmax(logits: jax.Array, axis: int) -> jax.Array:
    """One-hot at the softmax's argmax over `axis`, with the softmax's gradient.

    Written as transformers' `one_hot - stop_gradient(soft) + soft` rather than the one-hot
    itself: the forward values then round as theirs do (the 1 is 1 up to an ulp).
    """
    soft = jax.nn.softmax(logits.astype(jnp.float32), axis=axis)
    hard = jax.nn.one_hot(jnp.argmax(soft, axis=axis), logits.shape[axis], axis=axis)
    return hard - jax.lax.stop_gradient(soft) + soft


class TokenMixer(nn.Module):
    """An MLP along the token axis: [B, N, D] -> [B, num_tokens, D] (GroupViTMixerMLP)."""

    mlp_dim: int
    num_tokens: int
    activation: str = "gelu"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        vit.check_activation(self.activation)
        y = jnp.swapaxes(x, 1, 2)
        y = nn.Dense(self.mlp_dim, dtype=self.dtype, name="fc1")(y)
        y = vit.ACTIVATIONS[self.activation](y)
        y = nn.Dense(self.num_tokens, dtype=self.dtype, name="fc2")(y)
        return jnp.swapaxes(y, 1, 2)


class AssignAttention(nn.Module):
    """Single-head attention from image tokens to groups with the hard assignment.

    [B, G, D] groups, [B, N, D] image tokens -> [B, G, D]. The one-hot runs over the groups (each
    token picks one group), then each group's row is normalized over its tokens, with `eps`
    keeping a group that received no token finite.
    """

    eps: float = 1.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, groups: jax.Array, tokens: jax.Array) -> jax.Array:
        dense = functools.partial(nn.Dense, groups.shape[-1], dtype=self.dtype)
        q = dense(name="q_proj")(groups)
        k = dense(name="k_proj")(tokens)
        v = dense(name="v_proj")(tokens)
        logits = (q @ jnp.swapaxes(k, -1, -2)) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
        assign = hard_softmax(logits, axis=-2)
        assign = assign / (assign.sum(axis=-1, keepdims=True) + self.eps)
        return dense(name="proj")(assign.astype(self.dtype) @ v)


class CrossAttentionBlock(nn.Module):
    """Groups attend to image tokens (GroupViTCrossAttentionLayer): no norm before the attention,
    a pre-norm MLP, and a LayerNorm on the output."""

    num_heads: int
    mlp_dim: int
    ln_eps: float = 1e-5
    activation: str = "gelu"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, queries: jax.Array, tokens: jax.Array) -> jax.Array:
        norm = functools.partial(nn.LayerNorm, epsilon=self.ln_eps, dtype=self.dtype)
        x = queries + nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dtype=self.dtype, attention_fn=vit.attention, name="attn"
        )(queries, tokens)
        y = vit.MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name="mlp")(
            norm(name="norm2")(x)
        )
        return norm(name="norm_post")(x + y)


class GroupingBlock(nn.Module):
    """[B, N, D] image tokens and [B, G, D] group tokens -> [B, num_groups, D] segment tokens
    (GroupViTTokenAssign).

    Attributes:
      num_groups: output segments.
      num_heads, mlp_dim: the cross-attention block's.
      tokens_mlp_dim, channels_mlp_dim: hidden widths of the token mixer and of the output MLP
        (`assign_mlp_ratio` times the width).
      assign_eps: `AssignAttention.eps`.
    """

    num_groups: int
    num_heads: int
    mlp_dim: int
    tokens_mlp_dim: int
    channels_mlp_dim: int
    assign_eps: float = 1.0
    ln_eps: float = 1e-5
    activation: str = "gelu"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, groups: jax.Array) -> jax.Array:
        norm = functools.partial(nn.LayerNorm, epsilon=self.ln_eps, dtype=self.dtype)
        groups = norm(name="norm_tokens")(groups)
        tokens = norm(name="norm_x")(tokens)
        groups = TokenMixer(
            self.tokens_mlp_dim,
            self.num_groups,
            activation=self.activation,
            dtype=self.dtype,
            name="mlp_inter",
        )(groups)
        groups = norm(name="norm_post_tokens")(groups)
        groups = CrossAttentionBlock(
            self.num_heads,
            self.mlp_dim,
            ln_eps=self.ln_eps,
            activation=self.activation,
            dtype=self.dtype,
            name="pre_assign_attn",
        )(groups, tokens)
        x = AssignAttention(self.assign_eps, dtype=self.dtype, name="assign")(groups, tokens)
        x = x + groups
        y = vit.MlpBlock(
            self.channels_mlp_dim, dtype=self.dtype, activation=self.activation, name="mlp_channels"
        )(norm(name="norm_new_x")(x))
        return x + y


class Stage(nn.Module):
    """Blocks over image + group tokens, then grouping (GroupViTStage).

    Returns (tokens, group tokens): the segment tokens (the image tokens unchanged in a stage
    without group tokens) and this stage's group tokens after the blocks, which seed the next
    stage's (None without group tokens).

    Attributes:
      depth, num_heads, mlp_dim: the blocks.
      num_group_tokens: learned group tokens; 0 for a stage that only runs blocks.
      num_groups: segments the grouping block outputs.
      tokens_mlp_dim, channels_mlp_dim, assign_eps: the `GroupingBlock`'s.
    """

    depth: int
    num_heads: int
    mlp_dim: int
    num_group_tokens: int
    num_groups: int
    tokens_mlp_dim: int
    channels_mlp_dim: int
    assign_eps: float = 1.0
    ln_eps: float = 1e-5
    activation: str = "gelu"
    dtype: Any = jnp.float32

    def group_tokens(self, batch: int, width: int, prev: jax.Array | None) -> jax.Array:
        """[batch, num_group_tokens, width]: the learned tokens, plus the previous stage's
        mixed into as many."""
        tokens = self.param("group_token", nn.initializers.zeros, (1, self.num_group_tokens, width))
        tokens = jnp.broadcast_to(tokens.astype(self.dtype), (batch, *tokens.shape[1:]))
        if prev is None:
            return tokens
        prev = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="group_projector_norm")(
            prev
        )
        return tokens + TokenMixer(
            width // 2,
            self.num_group_tokens,
            activation=self.activation,
            dtype=self.dtype,
            name="group_projector",
        )(prev)

    @nn.compact
    def __call__(
        self, x: jax.Array, prev_groups: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None]:
        b, n, d = x.shape
        if self.num_group_tokens:
            x = jnp.concatenate([x, self.group_tokens(b, d, prev_groups)], axis=1)
        x = towers.encoder_blocks(self, x)
        if not self.num_group_tokens:
            return x, None
        x, groups = x[:, :n], x[:, n:]
        x = GroupingBlock(
            self.num_groups,
            self.num_heads,
            self.mlp_dim,
            self.tokens_mlp_dim,
            self.channels_mlp_dim,
            assign_eps=self.assign_eps,
            ln_eps=self.ln_eps,
            activation=self.activation,
            dtype=self.dtype,
            name="downsample",
        )(x, groups)
        return x, groups


class VisionEncoder(nn.Module):
    """[B, H, W, 3] normalized pixels -> [B, width]: the mean of the final segment tokens.

    Attributes:
      width, num_heads, mlp_dim, patch_size: the transformer.
      pos_grid: the (rows, cols) patch grid the position embeddings are learned for; inputs must
        have it (as transformers without `interpolate_pos_encoding`).
      depths, num_group_tokens, num_groups: per stage (transformers' `depths`,
        `num_group_tokens`, `num_output_groups`).
      tokens_mlp_dim, channels_mlp_dim, assign_eps: the grouping blocks'.
    """

    width: int
    num_heads: int
    mlp_dim: int
    patch_size: int
    pos_grid: tuple[int, int]
    depths: tuple[int, ...]
    num_group_tokens: tuple[int, ...]
    num_groups: tuple[int, ...]
    tokens_mlp_dim: int
    channels_mlp_dim: int
    assign_eps: float = 1.0
    ln_eps: float = 1e-5
    activation: str = "gelu"
    dtype: Any = jnp.float32

    def embed(self, images: jax.Array) -> jax.Array:
        p = self.patch_size
        x = nn.Conv(
            self.width, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype, name="embedding"
        )(images)
        b, h, w, d = x.shape
        if (h, w) != tuple(self.pos_grid):
            raise ValueError(
                f"images give a {h}x{w} patch grid; the position embeddings are learned for "
                f"{self.pos_grid[0]}x{self.pos_grid[1]}"
            )
        x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm_embed")(
            x.reshape(b, h * w, d)
        )
        pos = self.param("pos_embedding", nn.initializers.zeros, (1, h * w, d))
        return x + pos.astype(x.dtype)

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        x, groups = self.embed(images), None
        for i, depth in enumerate(self.depths):
            x, groups = Stage(
                depth,
                self.num_heads,
                self.mlp_dim,
                self.num_group_tokens[i],
                self.num_groups[i],
                self.tokens_mlp_dim,
                self.channels_mlp_dim,
                assign_eps=self.assign_eps,
                ln_eps=self.ln_eps,
                activation=self.activation,
                dtype=self.dtype,
                name=f"stage_{i}",
            )(x, groups)
        x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm")(x)
        return x.mean(axis=1)


class ProjectionHead(nn.Module):
    """Linear -> BatchNorm (frozen statistics, "batch_stats") -> ReLU -> Linear."""

    hidden_dim: int
    out_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.hidden_dim, dtype=self.dtype, name="fc1")(x)
        x = nn.relu(resnet.FrozenBatchNorm(dtype=self.dtype, name="bn")(x))
        return nn.Dense(self.out_dim, dtype=self.dtype, name="fc2")(x)


class ImageTower(nn.Module):
    """`VisionEncoder` then `ProjectionHead`: [B, H, W, 3] -> [B, out_dim]."""

    encoder: VisionEncoder
    head: ProjectionHead

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        return self.head(self.encoder(images))


class GroupViT(clip.CLIP, kw_only=True):
    """`clip.CLIP` with GroupViT's image tower and an MLP head ("text_head") on CLIP's text
    tower, which must have no projection of its own. Fields are keyword-only (`text_head` follows
    CLIP's defaulted `logit_scale_init`).

    Attributes:
      text_head: projects the pooled text state into the shared space.
    """

    image: ImageTower
    text: towers.TextTower
    text_head: ProjectionHead

    def text_features(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None
    ) -> jax.Array:
        """[B, L] token ids -> [B, D] projected features, not normalized."""
        return self.text_head(self.text(input_ids, attention_mask)).astype(jnp.float32)
