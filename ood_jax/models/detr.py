"""DETR (Carion et al., 2020): ResNet -> 1x1 projection -> post-norm transformer -> set prediction.

The layout follows the paper's code and transformers' `DetrForObjectDetection`, whose submodule
names it keeps (so the converter's tables stay short). The family's surface for
`ood_jax.models.registry`: `Model` (`DETR`), `postprocess`, `make_loss` (the softmax set loss of
`ood_jax.models.set_loss`) and `load_backbone`.
"""

import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from ood_jax.models import attention, backbones, conv
from ood_jax.models.backbones import load_backbone as load_backbone
from ood_jax.models.position_embedding import sine_position_embedding
from ood_jax.models.registry import LossFn

LN_EPS = 1e-5

_xavier = nn.initializers.xavier_uniform()


class Attention(nn.Module):
    """Multi-head attention with separate query/key/value inputs, a key padding mask [B, K] and
    an optional attention mask [Q, K] or [B, Q, K] (True = may attend)."""

    num_heads: int
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        key_mask: jax.Array | None = None,
        train: bool = False,
        attention_mask: jax.Array | None = None,
    ) -> jax.Array:
        dim = query.shape[-1]
        if dim % self.num_heads:
            raise ValueError(f"hidden_dim {dim} is not divisible by num_heads {self.num_heads}")
        head_dim = dim // self.num_heads

        def project(x: jax.Array, name: str) -> jax.Array:
            y = nn.Dense(dim, dtype=self.dtype, kernel_init=_xavier, name=name)(x)
            return y.reshape(*x.shape[:-1], self.num_heads, head_dim)

        q = project(query, "q_proj")
        k = project(key, "k_proj")
        v = project(value, "v_proj")
        mask = attention.combined_mask(key_mask, attention_mask)
        if train and self.dropout > 0:  # dropout acts on the weights: they must exist
            weights = attention.attention_weights(q, k, mask)
            weights = nn.Dropout(self.dropout)(weights, deterministic=False)
            out = attention.weighted_values(weights, v)
        else:
            out = attention.dot_product_attention(q, k, v, mask)
        out = out.reshape(*query.shape[:-1], dim)
        return nn.Dense(dim, dtype=self.dtype, kernel_init=_xavier, name="o_proj")(out)


class FeedForward(nn.Module):
    """Linear -> ReLU -> dropout -> linear."""

    hidden_dim: int
    dropout: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        y = nn.Dense(self.hidden_dim, dtype=self.dtype, kernel_init=_xavier, name="fc1")(x)
        y = nn.Dropout(self.dropout)(nn.relu(y), deterministic=not train)
        return nn.Dense(x.shape[-1], dtype=self.dtype, kernel_init=_xavier, name="fc2")(y)


class _Layer(nn.Module):
    """Fields and the residual + LayerNorm step shared by encoder and decoder layers."""

    num_heads: int
    ffn_dim: int
    dropout: float = 0.1
    dtype: Any = jnp.float32

    def attention(self, name: str) -> Attention:
        return Attention(self.num_heads, self.dropout, self.dtype, name=name)

    def add_norm(self, x: jax.Array, y: jax.Array, name: str, train: bool) -> jax.Array:
        y = nn.Dropout(self.dropout)(y, deterministic=not train)
        return nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name=name)(x + y)

    def feed_forward(self, x: jax.Array, train: bool) -> jax.Array:
        y = FeedForward(self.ffn_dim, self.dropout, self.dtype, name="mlp")(x, train)
        return self.add_norm(x, y, "final_layer_norm", train)


class EncoderLayer(_Layer):
    @nn.compact
    def __call__(
        self, x: jax.Array, pos: jax.Array, mask: jax.Array, train: bool = False
    ) -> jax.Array:
        qk = x + pos
        y = self.attention("self_attn")(qk, qk, x, mask, train)
        x = self.add_norm(x, y, "self_attn_layer_norm", train)
        return self.feed_forward(x, train)


class DecoderLayer(_Layer):
    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        query_pos: jax.Array,
        memory: jax.Array,
        pos: jax.Array,
        mask: jax.Array,
        train: bool = False,
        num_groups: int = 1,
    ) -> jax.Array:
        # Query groups attend only to themselves: folding them into the batch dimension is exact
        # and costs no mask. Cross-attention is per query, so it runs on all groups at once.
        batch, num_queries, dim = x.shape
        grouped = (batch * num_groups, num_queries // num_groups, dim)
        qk = (x + query_pos).reshape(grouped)
        y = self.attention("self_attn")(qk, qk, x.reshape(grouped), None, train)
        x = self.add_norm(x, y.reshape(x.shape), "self_attn_layer_norm", train)
        y = self.attention("encoder_attn")(x + query_pos, memory + pos, memory, mask, train)
        x = self.add_norm(x, y, "encoder_attn_layer_norm", train)
        return self.feed_forward(x, train)


class Encoder(nn.Module):
    num_layers: int
    num_heads: int
    ffn_dim: int
    dropout: float = 0.1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, pos: jax.Array, mask: jax.Array, train: bool = False
    ) -> jax.Array:
        for i in range(self.num_layers):
            layer = EncoderLayer(
                self.num_heads, self.ffn_dim, self.dropout, self.dtype, name=f"layers_{i}"
            )
            x = layer(x, pos, mask, train)
        return x


class Decoder(nn.Module):
    """Returns the normalized output of every layer, [num_layers, B, Q, D]."""

    num_layers: int
    num_heads: int
    ffn_dim: int
    dropout: float = 0.1
    norm_between_layers: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        query_pos: jax.Array,
        memory: jax.Array,
        pos: jax.Array,
        mask: jax.Array,
        train: bool = False,
        num_groups: int = 1,
    ) -> jax.Array:
        norm = nn.LayerNorm(epsilon=LN_EPS, dtype=self.dtype, name="layernorm")
        x = jnp.zeros_like(query_pos)
        outputs = []
        for i in range(self.num_layers):
            layer = DecoderLayer(
                self.num_heads, self.ffn_dim, self.dropout, self.dtype, name=f"layers_{i}"
            )
            x = layer(x, query_pos, memory, pos, mask, train, num_groups)
            outputs.append(norm(x))
            if self.norm_between_layers:
                x = outputs[-1]
        if self.norm_between_layers:
            outputs[-1] = norm(x)
        return jnp.stack(outputs)


class BoxHead(nn.Module):
    """3-layer MLP to 4 box logits."""

    hidden_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(2):
            x = nn.relu(nn.Dense(self.hidden_dim, dtype=self.dtype, name=f"layers_{i}")(x))
        return nn.Dense(4, dtype=self.dtype, name="layers_2")(x)


class DETR(backbones.BackboneFields):
    """DETR detector.

    `apply(variables, images [B, H, W, 3], pixel_mask=None, train=False)` returns "logits"
    [B, Q, num_classes + 1] (the last class "no object"), "boxes" [B, Q, 4] (normalized cxcywh)
    and "aux" (one {"logits", "boxes"} per earlier decoder layer, from the same heads); float32.
    Images come ImageNet-normalized and padded to one shape, `pixel_mask` [B, H, W] True on real
    pixels. `train=True` needs a "dropout" rng, and with `backbone_norm="batch"` a mutable
    "batch_stats" collection.

    Attributes:
      num_classes: object classes, without the extra "no object" logit.
      num_queries: object queries (detection slots).
      hidden_dim, num_heads, ffn_dim, dropout: transformer width, heads, FFN width, dropout
        (on attention weights, the FFN hidden layer and each residual branch).
      num_encoder_layers, num_decoder_layers: transformer depth.
      backbone, backbone_norm, freeze_backbone, backbone_frozen_stages, dilation: keyword-only,
        from `backbones.BackboneFields` (one record: `self.backbone_config`). A ResNet's last
        stage or a plain ViT's feature map feeds the transformer; `backbone_norm="frozen"` is the
        paper's choice; `freeze_backbone` runs the backbone in inference mode behind a
        stop_gradient.
      num_query_groups: Group DETR (Chen et al., 2023): in training, this many independent
        copies of the queries, each matched one-to-one to the targets and attending only to its
        own group, give the decoder several times the supervision per image at little cost;
        inference uses the first group alone, so the deployed model is plain DETR.
      norm_between_decoder_layers: transformers' decoder when its config has
        `auxiliary_loss=True`: each layer's normalized output is what the next layer reads, and
        the last is normalized twice (the paper normalizes only what the heads read).
        Checkpoints trained that way need it; `detr_from_hf` sets it.
      dtype: compute dtype; parameters stay float32.
    """

    family: ClassVar[str] = "detr"

    num_classes: int
    num_queries: int = 100
    hidden_dim: int = 256
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    ffn_dim: int = 2048
    dropout: float = 0.1
    num_query_groups: int = 1
    norm_between_decoder_layers: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, images: jax.Array, pixel_mask: jax.Array | None = None, train: bool = False
    ) -> dict[str, Any]:
        backbone = self.backbone_config.build(self.dtype, name="backbone")
        features = backbone(images, train and not self.freeze_backbone)
        features = backbones.last_map(features)
        if self.freeze_backbone:
            features = jax.lax.stop_gradient(features)
        batch, height, width, _ = features.shape

        if pixel_mask is None:
            pixel_mask = jnp.ones(images.shape[:3], bool)
        mask = backbones.resize_mask(pixel_mask, (height, width))
        pos = sine_position_embedding(mask, self.hidden_dim // 2).astype(self.dtype)
        pos = pos.reshape(batch, height * width, self.hidden_dim)
        mask = mask.reshape(batch, height * width)

        src = nn.Conv(
            self.hidden_dim,
            (1, 1),
            dtype=self.dtype,
            conv_general_dilated=conv.conv_general_dilated,
            name="input_projection",
        )(features)
        src = src.reshape(batch, height * width, self.hidden_dim)
        memory = Encoder(
            self.num_encoder_layers,
            self.num_heads,
            self.ffn_dim,
            self.dropout,
            self.dtype,
            name="encoder",
        )(src, pos, mask, train)

        num_groups = self.num_query_groups if train else 1
        query_pos = nn.Embed(
            self.num_queries * self.num_query_groups,
            self.hidden_dim,
            embedding_init=nn.initializers.normal(1.0),
            dtype=self.dtype,
            name="query_position_embeddings",
        )(jnp.arange(self.num_queries * num_groups))
        query_pos = jnp.broadcast_to(query_pos, (batch, *query_pos.shape))
        hidden = Decoder(
            self.num_decoder_layers,
            self.num_heads,
            self.ffn_dim,
            self.dropout,
            self.norm_between_decoder_layers,
            self.dtype,
            name="decoder",
        )(query_pos, memory, pos, mask, train, num_groups)

        logits = nn.Dense(self.num_classes + 1, dtype=self.dtype, name="class_labels_classifier")(
            hidden
        ).astype(jnp.float32)
        boxes = jax.nn.sigmoid(
            BoxHead(self.hidden_dim, self.dtype, name="bbox_predictor")(hidden).astype(jnp.float32)
        )
        aux = [{"logits": logits[i], "boxes": boxes[i]} for i in range(self.num_decoder_layers - 1)]
        return {"logits": logits[-1], "boxes": boxes[-1], "aux": aux}


def postprocess(outputs: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """DETR's post-processing: every query is a detection of its most likely real class."""
    probs = jax.nn.softmax(outputs["logits"].astype(jnp.float32), axis=-1)[..., :-1]
    return {
        "scores": probs.max(-1),
        "labels": probs.argmax(-1).astype(jnp.int32),
        "boxes": outputs["boxes"].astype(jnp.float32),
    }


Model = DETR


def make_loss(config: ml_collections.ConfigDict, model: DETR) -> LossFn:
    """DETR's training loss: Hungarian matching and the softmax set loss
    (`set_loss.set_loss`, with Group DETR's query groups), weighted by `config.loss`."""
    from ood_jax.models import set_loss  # optax: imported for training only

    loss = functools.partial(
        set_loss.set_loss,
        config=set_loss.SetLossConfig(**set_loss.config_weights(config)),
        num_query_groups=model.num_query_groups,
    )
    return set_loss.make_loss_fn(model, loss)
