"""Plain pre-norm ViT: a detection backbone, and the image tower of CLIP and SigLIP.

The standard encoder (timm's `VisionTransformer` with `global_pool="token"`, no layer scale, no
register tokens), plus the switches CLIP and SigLIP need (`ood_jax.scorers`). Position
embeddings are stored on a fixed grid and resampled at apply time to the input's patch grid, as
timm's `dynamic_img_size=True` does: any resolution, one compilation per resolution.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

LN_EPS = 1e-6

ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
    # OpenAI CLIP's sigmoid approximation of GELU.
    "quick_gelu": lambda x: x * nn.sigmoid(1.702 * x),
}
POOL_TYPES = (None, "tok", "map")

# Standard patch-16 variants (Dosovitskiy et al. for B; DeiT's Ti and S).
VARIANTS: dict[str, dict[str, int]] = {
    "Ti/16": {"width": 192, "depth": 12, "num_heads": 3, "mlp_dim": 768, "patch_size": 16},
    "S/16": {"width": 384, "depth": 12, "num_heads": 6, "mlp_dim": 1536, "patch_size": 16},
    "B/16": {"width": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072, "patch_size": 16},
}


def resample_pos_embedding(
    grid: jax.Array, size: tuple[int, int], method: str = "bicubic"
) -> jax.Array:
    """Resizes a position-embedding grid [gh, gw, D] to [size[0], size[1], D].

    `method` is "bicubic" or "bilinear". jax.image.resize with antialias=True is torch's
    `F.interpolate(..., antialias=True)` (Keys a=-0.5 cubic, support widened when downsampling),
    which is what timm uses. Interpolation runs in float32 because the result is added to every
    token and low-precision interpolation visibly perturbs it.
    """
    if tuple(grid.shape[:2]) == tuple(size):
        return grid
    out = jax.image.resize(
        grid.astype(jnp.float32), (*size, grid.shape[-1]), method=method, antialias=True
    )
    return out.astype(grid.dtype)


def attention(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Softmax attention, [B, L, H, D] in and out (flax's `attention_fn` interface).

    The same function as `nn.dot_product_attention` (masked logits get the dtype's minimum, so a
    fully masked row attends uniformly), laid out for XLA's CPU backend: heads leading for the
    two batched matmuls, and the softmax normalization applied to the [Lq, D] output instead of
    the [Lq, Lk] weights, which together take attention 2-4x faster there. The softmax runs in
    float32 whatever the computation dtype.
    """
    dtype = query.dtype
    q = jnp.swapaxes(query, -3, -2) * jnp.asarray(query.shape[-1] ** -0.5, dtype)
    k, v = jnp.swapaxes(key, -3, -2), jnp.swapaxes(value, -3, -2)
    logits = (q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    out = (weights.astype(dtype) @ v) / weights.sum(axis=-1, keepdims=True).astype(dtype)
    return jnp.swapaxes(out, -3, -2)


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")


class MlpBlock(nn.Module):
    """Dense -> activation (exact GELU by default) -> Dense, back to the input width."""

    mlp_dim: int
    dtype: Any = jnp.float32
    activation: str = "gelu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        check_activation(self.activation)
        init = nn.initializers.xavier_uniform()
        y = nn.Dense(self.mlp_dim, dtype=self.dtype, kernel_init=init, name="fc1")(x)
        y = ACTIVATIONS[self.activation](y)
        return nn.Dense(x.shape[-1], dtype=self.dtype, kernel_init=init, name="fc2")(y)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block with stochastic depth on both residual branches.

    `mask` ([B, 1, Lq, Lk] or broadcastable, True = attend) restricts attention, e.g. to a causal
    or padding pattern for text; None attends everywhere.
    """

    num_heads: int
    mlp_dim: int
    drop_path_rate: float = 0.0
    dtype: Any = jnp.float32
    ln_eps: float = LN_EPS
    activation: str = "gelu"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool, mask: jax.Array | None = None) -> jax.Array:
        # Dropping whole residual branches per example: broadcasting the mask over tokens and
        # channels turns dropout into timm's DropPath, including its 1 / (1 - rate) rescaling.
        drop_path = nn.Dropout(self.drop_path_rate, broadcast_dims=(1, 2), deterministic=not train)
        y = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm1")(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            kernel_init=nn.initializers.xavier_uniform(),
            attention_fn=attention,
            name="attn",
        )(y, mask=mask)
        x = x + drop_path(y)
        y = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm2")(x)
        y = MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name="mlp")(y)
        return x + drop_path(y)


class MAPHead(nn.Module):
    """Multihead attention pooling (big_vision's `MAPHead`, SigLIP's image head).

    One learned probe attends over all tokens; an MLP block with a residual follows. [B, N, D]
    -> [B, D].
    """

    num_heads: int
    mlp_dim: int
    dtype: Any = jnp.float32
    ln_eps: float = LN_EPS
    activation: str = "gelu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, _, d = x.shape
        probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d))
        probe = jnp.broadcast_to(probe.astype(x.dtype), (b, 1, d))
        x = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            kernel_init=nn.initializers.xavier_uniform(),
            attention_fn=attention,
            name="attn",
        )(probe, x)
        y = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm")(x)
        y = MlpBlock(self.mlp_dim, dtype=self.dtype, activation=self.activation, name="mlp")(y)
        return (x + y)[:, 0]


class ViT(nn.Module):
    """ViT encoder returning a stride-`patch_size` feature map.

    `__call__(images [B, H, W, C], train=False)` returns {"features": [B, H // p, W // p, D]},
    the normalized patch tokens, and with `pool_type` "pooled" [B, D]. The class token takes
    part in attention but is not in "features". Pixels past the last full patch are ignored, as
    in timm, so detection inputs should be padded to a multiple of `patch_size`.

    Attributes:
      width, depth, num_heads, mlp_dim, patch_size: the architecture (see `VARIANTS`).
      class_token: prepend a learned class token (timm's default); its position embedding is the
        first row of `pos_embedding` and is never resampled.
      pos_grid: the (rows, cols) patch grid the position embeddings are stored at.
      resample_method: "bicubic" (timm's default) or "bilinear".
      drop_path_rate: stochastic depth, increasing linearly from 0 at the first block to this at
        the last, as timm; needs a "dropout" rng when `train=True` and the rate is non-zero.
      dtype: computation dtype; parameters stay float32.
      ln_eps: epsilon of every LayerNorm (timm 1e-6, CLIP 1e-5).
      activation: MLP activation, a key of `ACTIVATIONS`.
      patch_bias: whether the patch embedding has a bias (CLIP's has none).
      ln_pre: a LayerNorm ("norm_pre") on the embedded tokens before the first block (CLIP).
      pool_type: None (feature map only), "tok" (the normalized class token) or "map" (a
        `MAPHead` over the normalized tokens); the pooled vector is returned as "pooled".
    """

    width: int
    depth: int
    num_heads: int
    mlp_dim: int
    patch_size: int = 16
    class_token: bool = True
    pos_grid: tuple[int, int] = (14, 14)
    resample_method: str = "bicubic"
    drop_path_rate: float = 0.0
    dtype: Any = jnp.float32
    ln_eps: float = LN_EPS
    activation: str = "gelu"
    patch_bias: bool = True
    ln_pre: bool = False
    pool_type: str | None = None

    @property
    def stride(self) -> int:
        return self.patch_size

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> dict[str, jax.Array]:
        if self.pool_type not in POOL_TYPES:
            raise ValueError(f"unknown pool_type {self.pool_type!r}; known: {POOL_TYPES}")
        if self.pool_type == "tok" and not self.class_token:
            raise ValueError('pool_type "tok" needs class_token=True')
        p = self.patch_size
        x = nn.Conv(
            self.width,
            (p, p),
            strides=(p, p),
            padding="VALID",
            use_bias=self.patch_bias,
            dtype=self.dtype,
            name="embedding",
        )(images)
        b, h, w, d = x.shape

        num_prefix = int(self.class_token)
        gh, gw = self.pos_grid
        pos = self.param(
            "pos_embedding",
            nn.initializers.normal(stddev=0.02),
            (1, num_prefix + gh * gw, d),
        )
        grid = resample_pos_embedding(
            pos[0, num_prefix:].reshape(gh, gw, d), (h, w), self.resample_method
        )
        x = x.reshape(b, h * w, d) + grid.reshape(1, h * w, d).astype(x.dtype)
        if self.class_token:
            cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
            cls = (cls + pos[:, :num_prefix]).astype(x.dtype)
            x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), x], axis=1)
        if self.ln_pre:
            x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm_pre")(x)

        for i, rate in enumerate(np.linspace(0.0, self.drop_path_rate, self.depth)):
            x = EncoderBlock(
                self.num_heads,
                self.mlp_dim,
                drop_path_rate=float(rate),
                dtype=self.dtype,
                ln_eps=self.ln_eps,
                activation=self.activation,
                name=f"block_{i}",
            )(x, train=train)
        x = nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype, name="norm")(x)
        out = {"features": x[:, num_prefix:].reshape(b, h, w, d)}
        if self.pool_type == "tok":
            out["pooled"] = x[:, 0]
        elif self.pool_type == "map":
            out["pooled"] = MAPHead(
                self.num_heads,
                self.mlp_dim,
                dtype=self.dtype,
                ln_eps=self.ln_eps,
                activation=self.activation,
                name="map_head",
            )(x)
        return out


def vit(variant: str, **kwargs: Any) -> ViT:
    """`vit("B/16", drop_path_rate=0.1)`: a `VARIANTS` entry with any field overridden."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown ViT variant {variant!r}; known: {sorted(VARIANTS)}")
    return ViT(**{**VARIANTS[variant], **kwargs})
