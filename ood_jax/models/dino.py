"""DINO (Zhang et al., 2023): DETR with improved denoising anchor boxes.

Built from the Deformable DETR blocks (`ood_jax.models.deformable_detr`), with DINO's mixed query
selection, look-forward-twice box refinement and contrastive denoising queries
(`ood_jax.models.denoising`). The family's surface for `ood_jax.models.registry`: `Model`,
`postprocess`, `make_loss` (`ood_jax.models.focal_set_loss`) and `load_backbone`.
Outputs and departures from the reference code: docs/guide/detector-models.md.
"""

import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from ood_jax.models import backbones, detr
from ood_jax.models import deformable_detr as ddetr
from ood_jax.models.backbones import load_backbone as load_backbone
from ood_jax.models.position_embedding import sine_embedding
from ood_jax.models.registry import LossFn

DINO_TOP_K = 300


class MLP(nn.Module):
    """Dense layers with ReLU between them (`layers_0`, `layers_1`, ...)."""

    features: tuple[int, ...]
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, width in enumerate(self.features):
            x = nn.Dense(width, dtype=self.dtype, name=f"layers_{i}")(x)
            if i < len(self.features) - 1:
                x = nn.relu(x)
        return x


def anchor_sine_embedding(anchors: jax.Array, num_features: int) -> jax.Array:
    """[..., 4] cxcywh anchors -> [..., 4 * num_features], coordinates in DINO's (y, x, w, h)
    order, temperature 10000."""
    yxwh = jnp.stack([anchors[..., 1], anchors[..., 0], anchors[..., 2], anchors[..., 3]], -1)
    return sine_embedding(yxwh * (2 * math.pi), num_features)


class DINO(backbones.MultiScaleBackboneFields):
    """DINO detector.

    `apply(variables, images, pixel_mask=None, train=False, denoise=None)` returns "logits"
    [B, Q, C] (sigmoid) and "boxes" [B, Q, 4] (cxcywh) of the last decoder layer's matching
    queries, "aux" (earlier layers), "enc" (the K selected proposals) and, given `denoise`, "dn"
    ({"logits" [L, B, D, C], "boxes" [L, B, D, 4]}); float32.

    Attributes:
      num_classes: object classes (sigmoid logits).
      num_queries: matching queries = selected encoder proposals (900).
      hidden_dim, num_heads, ffn_dim, dropout: transformer width, heads, FFN width, dropout.
      num_encoder_layers, num_decoder_layers: depth (6 and 6).
      num_feature_levels, encoder_points, decoder_points: deformable attention (4, 4, 4).
      num_label_embeddings: rows of the denoising label embedding (None: num_classes + 1).
      shared_decoder_heads: one class head and one box head for all decoder layers, as DINO's
        released models; the encoder's proposal heads are always their own.
      position_temperature: of the image sine embedding (DINO uses 20).
      backbone, backbone_norm, freeze_backbone, backbone_frozen_stages, dilation,
        backbone_stages: keyword-only, from `backbones.MultiScaleBackboneFields`, as in
        `DeformableDetr`; a ViT name gives the simple feature pyramid of its stride-16 map.
      remat: recompute deformable sampling, every encoder and decoder layer (`deformable_detr.layer_class`) and
        a ResNet backbone's trained blocks (`resnet.ResNet.remat`) in the backward pass from
        their inputs.
      dtype: compute dtype; parameters stay float32.
    """

    family: ClassVar[str] = "dino"

    num_classes: int = 91
    num_queries: int = 900
    hidden_dim: int = 256
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    ffn_dim: int = 2048
    dropout: float = 0.0
    num_feature_levels: int = 4
    encoder_points: int = 4
    decoder_points: int = 4
    num_label_embeddings: int | None = None
    shared_decoder_heads: bool = True
    position_temperature: float = 20.0
    remat: bool = False
    dtype: Any = jnp.float32

    def _select_queries(
        self, memory: jax.Array, flat: ddetr.FlatLevels
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mixed query selection: (detached unsigmoided anchors [B, K, 4], encoder outputs)."""
        num_positions = memory.shape[1]
        if num_positions < self.num_queries:
            raise ValueError(
                f"the image gives {num_positions} encoder positions, fewer than num_queries="
                f"{self.num_queries}; use larger images or fewer queries"
            )
        proposals = ddetr.encoder_proposals(memory, flat.mask, flat.spatial_shapes)
        features = nn.Dense(self.hidden_dim, dtype=self.dtype, name="enc_output")(proposals.memory)
        features = nn.LayerNorm(epsilon=ddetr.LN_EPS, dtype=self.dtype, name="enc_output_norm")(
            features
        )
        logits = nn.Dense(self.num_classes, dtype=self.dtype, name="enc_class_embed")(features)
        logits = logits.astype(jnp.float32)
        anchors = detr.BoxHead(self.hidden_dim, self.dtype, name="enc_bbox_embed")(features)
        anchors = anchors.astype(jnp.float32) + proposals.logits
        # Padding positions (and anchors outside (0.01, 0.99)) are never selected while enough
        # real ones exist; the reference ranks them by the logits of a zeroed feature.
        score = jnp.where(proposals.valid, logits.max(-1), -jnp.inf)
        _, top = jax.lax.top_k(score, self.num_queries)

        def gather(x: jax.Array) -> jax.Array:
            return jnp.take_along_axis(x, top[..., None], axis=1)

        selected = gather(anchors)
        enc = {"logits": gather(logits), "boxes": jax.nn.sigmoid(selected)}
        return jax.lax.stop_gradient(selected), enc

    def _denoising_queries(
        self, denoise: dict[str, jax.Array], batch: int
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(content [B, D, dim], unsigmoided anchors [B, D, 4], attention mask [D+Q, D+Q])."""
        labels, boxes = denoise["labels"], denoise["boxes"]
        num_dn = labels.shape[1]
        total = num_dn + self.num_queries
        mask = denoise["attention_mask"]
        if labels.shape != (batch, num_dn) or boxes.shape != (batch, num_dn, 4):
            raise ValueError(
                f"denoise: labels {labels.shape} and boxes {boxes.shape} must be [B, D] and "
                f"[B, D, 4] with B={batch}"
            )
        if mask.shape != (total, total):
            raise ValueError(
                f"denoise: attention_mask {mask.shape} must be [D + Q, D + Q] = {(total, total)}"
            )
        table = self._label_embedding()
        content = jnp.take(table, labels, axis=0).astype(self.dtype)
        # Empty slots carry zero content, as the reference pads its denoising queries.
        content = jnp.where(denoise["valid"][..., None], content, 0)
        return content, ddetr.inverse_sigmoid(boxes.astype(jnp.float32)), mask

    def _label_embedding(self) -> jax.Array:
        rows = self.num_label_embeddings or self.num_classes + 1
        return nn.Embed(
            rows, self.hidden_dim, embedding_init=nn.initializers.normal(1.0), name="label_enc"
        ).embedding

    def _heads(self) -> tuple[list[nn.Module], list[nn.Module]]:
        count = 1 if self.shared_decoder_heads else self.num_decoder_layers
        class_heads = [
            nn.Dense(self.num_classes, dtype=self.dtype, name=f"class_embed_{i}")
            for i in range(count)
        ]
        box_heads = [
            detr.BoxHead(self.hidden_dim, self.dtype, name=f"bbox_embed_{i}") for i in range(count)
        ]
        if self.shared_decoder_heads:
            return class_heads * self.num_decoder_layers, box_heads * self.num_decoder_layers
        return class_heads, box_heads

    @nn.compact
    def __call__(
        self,
        images: jax.Array,
        pixel_mask: jax.Array | None = None,
        train: bool = False,
        denoise: dict[str, jax.Array] | None = None,
    ) -> dict[str, Any]:
        if pixel_mask is None:
            pixel_mask = jnp.ones(images.shape[:3], bool)
        batch = images.shape[0]
        memory, flat = ddetr.encode_images(
            self, images, pixel_mask, train, self.position_temperature, offset=0.0
        )
        anchors, enc = self._select_queries(memory, flat)
        content = nn.Embed(
            self.num_queries,
            self.hidden_dim,
            embedding_init=nn.initializers.normal(1.0),
            name="tgt_embed",
        ).embedding.astype(self.dtype)
        content = jnp.broadcast_to(content, (batch, *content.shape))

        num_dn, attention_mask = 0, None
        if denoise is None:
            self._label_embedding()  # created at init so a later denoising step finds it
        else:
            dn_content, dn_anchors, attention_mask = self._denoising_queries(denoise, batch)
            num_dn = dn_content.shape[1]
            content = jnp.concatenate([dn_content, content], axis=1)
            anchors = jnp.concatenate([dn_anchors, anchors], axis=1)

        class_heads, box_heads = self._heads()
        hidden, references = self._decode(
            content, anchors, memory, flat, attention_mask, box_heads, train
        )
        logits = jnp.stack([head(h).astype(jnp.float32) for head, h in zip(class_heads, hidden)])
        boxes = jnp.stack(
            [
                jax.nn.sigmoid(head(h).astype(jnp.float32) + ddetr.inverse_sigmoid(ref))
                for head, h, ref in zip(box_heads, hidden, references)
            ]
        )
        match_logits, match_boxes = logits[:, :, num_dn:], boxes[:, :, num_dn:]
        out = {
            "logits": match_logits[-1],
            "boxes": match_boxes[-1],
            "aux": [
                {"logits": lg, "boxes": bx} for lg, bx in zip(match_logits[:-1], match_boxes[:-1])
            ],
            "enc": enc,
        }
        if denoise is not None:
            out["dn"] = {"logits": logits[:, :, :num_dn], "boxes": boxes[:, :, :num_dn]}
        return out

    def _decode(
        self,
        content: jax.Array,
        anchors: jax.Array,
        memory: jax.Array,
        flat: ddetr.FlatLevels,
        attention_mask: jax.Array | None,
        box_heads: list[nn.Module],
        train: bool,
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """Normalized outputs of every layer and the (sigmoid) anchor each layer's box is
        predicted from: the initial anchors, then each layer's refinement WITH its gradient."""
        ref_point_head = MLP((self.hidden_dim, self.hidden_dim), self.dtype, name="ref_point_head")
        norm = nn.LayerNorm(epsilon=ddetr.LN_EPS, dtype=self.dtype, name="decoder_norm")
        x = content
        reference = jax.nn.sigmoid(anchors)
        hidden, references = [], [reference]
        for i in range(self.num_decoder_layers):
            ref_input = ddetr.decoder_reference_input(reference, flat.ratios)
            # The reference hard-codes 128 features per coordinate: hidden_dim // 2 at DINO's 256.
            sine = anchor_sine_embedding(ref_input[:, :, 0], self.hidden_dim // 2)
            query_pos = ref_point_head(sine.astype(self.dtype))
            layer = ddetr.layer_class(ddetr.DeformableDecoderLayer, self.remat)(
                **ddetr.layer_kwargs(self, self.decoder_points),
                attention_dropout=self.dropout,
                name=f"decoder_layers_{i}",
            )
            x = layer(
                x,
                query_pos,
                ref_input,
                memory,
                flat.mask,
                flat.spatial_shapes,
                attention_mask,
                train,
            )
            # The refinement reads the layer's raw output; the prediction heads read it
            # normalized (as the reference implementation does).
            delta = box_heads[i](x).astype(jnp.float32)
            refined = jax.nn.sigmoid(delta + ddetr.inverse_sigmoid(reference))
            # Look forward twice: the next layer starts from the detached refinement, but its box
            # is predicted on `refined` with the gradient, so its loss also trains this layer.
            reference = jax.lax.stop_gradient(refined)
            references.append(refined)
            hidden.append(norm(x))
        return hidden, references[:-1]


def postprocess(outputs: dict[str, jax.Array], top_k: int = DINO_TOP_K) -> dict[str, jax.Array]:
    """The top_k (query, class) pairs by sigmoid score: "scores", "labels", "boxes" (cxcywh),
    each [B, top_k, ...]."""
    return ddetr.postprocess(outputs, top_k)


Model = DINO


def make_loss(config: ml_collections.ConfigDict, model: DINO) -> LossFn:
    """DINO's training loss: the focal set loss over matched queries and encoder proposals plus
    the denoising terms of `config.denoising`'s contrastive denoising queries (num_queries,
    label_noise_ratio, box_noise_scale), weighted by `config.loss`."""
    from ood_jax.models import focal_set_loss, set_loss  # optax: imported for training only

    weights = set_loss.config_weights(config)
    if "denoising" not in config:
        raise ValueError(
            "config.denoising: DINO needs num_queries, label_noise_ratio and box_noise_scale"
        )
    return focal_set_loss.make_loss_fn(
        model, focal_set_loss.FocalSetLossConfig(**weights), config.denoising
    )
